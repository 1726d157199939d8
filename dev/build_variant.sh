#!/usr/bin/env bash
# Build the kernel library of another branch or commit, for a same-lease A/B on the GPU machine:
#
#   bash dev/build_variant.sh REV OUT_DIR
#
# Checks REV out into a temporary worktree, copies this tree's build/kernels there (the exports
# `ffi/build.py` already built here), exports again only the kernels whose module differs
# between HEAD and REV (and any export REV adds), relinks, and copies libjax_dsa_sm90.so to
# OUT_DIR (put it under build/ and carry it; on the GPU machine copy it over
# jax_dsa/_lib/libjax_dsa_sm90.so between two runs). Needs CUTE_DSL_ARCH=sm_90a in the
# environment, as ffi/build.py does. VARIANT_MODULES="bwd ..." adds kernel modules to re-export
# (for a REV that changes what they import from jax_dsa/cute, e.g. constants.py).
# VARIANT_ONLY="bwd ..." restricts the re-exports to those modules (for a REV whose change to
# common.py touches only their arguments, which would otherwise re-export every kernel).
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1
out=$2
root=$(pwd)
[ -d build/kernels ] || { echo "build/kernels missing: run ffi/build.py here first" >&2; exit 2; }
wt=$(mktemp -d /tmp/jax_dsa_variant.XXXXXX)
trap 'git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git worktree add --detach "$wt" "$rev" >/dev/null
mkdir -p "$wt/build"
cp -r build/kernels "$wt/build/"
changed=$(git diff --name-only HEAD "$rev" -- ffi/kernels/sm90/ | xargs -r -n1 basename |
          sed 's/\.py$//' | tr '\n' ' ')
changed="$changed ${VARIANT_MODULES:-}"
cd "$wt/ffi"
python - "$changed" "${VARIANT_ONLY:-}" <<'EOF'
import os
import sys

import build

changed = set(sys.argv[1].split())
only = set(sys.argv[2].split())
todo = [prefix for _, prefix, module, _, _ in build.exports()
        if (module in changed or "common" in changed
            or not os.path.isfile(os.path.join("..", "build", "kernels", prefix + ".o")))
        and (not only or module in only)]
for prefix in todo:
    print(f"[variant] export {prefix}: {build._export_one(prefix, '../build/kernels'):.1f}s",
          flush=True)
EOF
cd "$wt"
python ffi/build.py --out jax_dsa/_lib --relink | tail -1
mkdir -p "$root/$out"
cp jax_dsa/_lib/libjax_dsa_sm90.so "$root/$out/"
echo "[variant] $rev -> $out/libjax_dsa_sm90.so"

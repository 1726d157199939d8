#!/usr/bin/env bash
# Same-lease A/B of kernel libraries on the GPU machine: `examples/benchmark.py --long` on the
# given rows with each library in turn, ROUNDS rounds (default 2), summary lines printed, full
# logs under $OUT (or build/ab):
#
#   ROUNDS=2 bash dev/ab_libs.sh "V4-Flash S=8K,V4-Pro S=8K" bwd build/libs/main build/libs/new ...
#
# Each DIR holds a libjax_dsa_sm90.so (dev/build_variant.sh makes one from a branch or commit);
# it is copied over jax_dsa/_lib/libjax_dsa_sm90.so before its run, and the first DIR's library
# is put back at the end. Carry the DIRs and jax_dsa/_lib. A variant that changes the Python side
# (e.g. constants.py) needs that tree checked out: the timing does not depend on it.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
shapes=$1
passes=$2
shift 2
out="${OUT:-build/ab}"
mkdir -p "$out"
for round in $(seq "${ROUNDS:-2}"); do
  for dir in "$@"; do
    cp "$dir/libjax_dsa_sm90.so" jax_dsa/_lib/libjax_dsa_sm90.so
    name=$(basename "$dir")
    start=$(date +%s)
    timeout "${AB_TIMEOUT:-150}" python3 examples/benchmark.py --long --shapes "$shapes" \
      --impls cute --passes "$passes" --batches 5 --out "$out/bench_$name" \
      > "$out/$name.$round.log" 2>&1
    echo "== $name round $round rc=$? $(( $(date +%s) - start )) s"
    grep -E "^(V|TP|decode)" "$out/$name.$round.log" | cut -c1-60
  done
done
cp "$1/libjax_dsa_sm90.so" jax_dsa/_lib/libjax_dsa_sm90.so

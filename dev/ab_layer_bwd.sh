#!/usr/bin/env bash
# Same-lease A/B of kernel libraries on the DSA layer's attention backward (the workload of the
# layer benchmark: T 4096 at the end of S 64K, the V4 shapes), with the cuDNN-frontend peer on
# the same lists when it is installed in $SITE (dev/peer_wheels.sh stage1 / install, same lease):
#
#   ROUNDS=2 SHAPES="V4-Flash V4-Pro" bash dev/ab_layer_bwd.sh build/libs/main build/libs/new ...
#
# Each DIR holds a libjax_dsa_sm90.so (dev/build_variant.sh); it is copied over
# jax_dsa/_lib/libjax_dsa_sm90.so before its runs, and the first DIR's library is put back at
# the end. Per round and shape: `dev/profile_layer.py LABEL attn_bwd N` for each library (burst
# of 10 calls after 3 s idle, then N back-to-back calls, wall clock), then the peer through
# `dev/peer_cudnn_training.py` on the lists our indexer selected (CUDA events), written once
# by `examples/benchmark_layer.py --save-lists` into $OUT/lists. Summary lines printed; logs
# under $OUT (or build/ab_layer).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-build/ab_layer}"
SITE=${SITE:-/tmp/site}
mkdir -p "$out"
declare -A calls=([V4-Flash]=1200 [V4-Pro]=400)
declare -A peer_label=([V4-Flash]=v4flash [V4-Pro]=v4pro)
peer=0
if [ -d "$SITE/cudnn" ]; then
  peer=1
  cp "$1/libjax_dsa_sm90.so" jax_dsa/_lib/libjax_dsa_sm90.so
  timeout 240 python3 examples/benchmark_layer.py --impls cute --batches 1 --calls 1 \
    --save-lists "$out/lists" > "$out/lists.log" 2>&1 || { echo "lists failed"; peer=0; }
fi
for round in $(seq "${ROUNDS:-2}"); do
  for shape in ${SHAPES:-V4-Flash V4-Pro}; do
    for dir in "$@"; do
      cp "$dir/libjax_dsa_sm90.so" jax_dsa/_lib/libjax_dsa_sm90.so
      name=$(basename "$dir")
      timeout "${AB_TIMEOUT:-150}" python3 dev/profile_layer.py "$shape" attn_bwd \
        "${calls[$shape]}" > "$out/$name.$shape.$round.log" 2>&1
      grep -E "burst|sustained|rror" "$out/$name.$shape.$round.log" | sed "s/^/$name r$round /"
    done
    if [ $peer = 1 ]; then
      PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH" timeout 180 \
        python3 dev/peer_cudnn_training.py "${peer_label[$shape]}" attn_bwd "$out/lists" \
        "${calls[$shape]}" > "$out/peer.$shape.$round.log" 2>&1
      grep -E "burst|sustained|FAILED|rror" "$out/peer.$shape.$round.log" | sed "s/^/peer r$round /"
    fi
  done
done
cp "$1/libjax_dsa_sm90.so" jax_dsa/_lib/libjax_dsa_sm90.so

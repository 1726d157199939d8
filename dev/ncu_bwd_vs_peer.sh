#!/usr/bin/env bash
# Our layer attention backward kernel against the peer's main backward kernel, one ncu profile
# each (warp stall reasons, throughput, memory), on the GPU machine, in one call:
#
#   bash dev/ncu_bwd_vs_peer.sh [V4-Flash|V4-Pro] LISTS_DIR
#
# The peer must be installed in $SITE (dev/peer_wheels.sh install, same lease) and LISTS_DIR
# hold the lists `examples/benchmark_layer.py --save-lists` wrote, so both kernels run the
# same entries. Writes $OUT/ncu_{ours,peer}_<label>.csv (ncu --page details) and prints the
# stall breakdown of both side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
LABEL=${1:-V4-Flash}
LISTS=${2:?lists directory}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-build/ncu}
mkdir -p "$OUT"
short=$(echo "$LABEL" | tr 'A-Z' 'a-z' | tr -d '-')
SECTIONS=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats
          --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio")
NCU=(ncu --cache-control none --clock-control none "${SECTIONS[@]}" --page details --csv)
export PYTHONPATH=$(pwd)
# ours: the one attn_bwd call between cudaProfilerStart / Stop; the backward kernel only
"${NCU[@]}" --profile-from-start off --kernel-name regex:SparseMlaBwd \
  python3 dev/profile_layer.py "$LABEL" attn_bwd > "$OUT/ncu_ours_$short.csv"
# the peer: its main kernel's second launch (the first is the compiling warm-up call)
PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$(pwd) "${NCU[@]}" \
  --kernel-name regex:FlashAttentionDSABackwardSm90_object --launch-skip 1 --launch-count 1 \
  python3 dev/peer_cudnn_training.py "$short" attn_bwd "$LISTS" > "$OUT/ncu_peer_$short.csv"
python3 - "$OUT/ncu_ours_$short.csv" "$OUT/ncu_peer_$short.csv" <<'PY'
import csv, sys

def metrics(path):
    """{metric name (unit): value} of the first profiled kernel in an ncu details CSV."""
    with open(path) as f:
        rows = [r for r in csv.reader(l for l in f if l.startswith('"'))]
    head, body = rows[0], rows[1:]
    col = {k: i for i, k in enumerate(head)}
    first = body[0][col["ID"]]
    out = {}
    for r in body:
        if r[col["ID"]] != first:
            break
        out[f'{r[col["Metric Name"]]} ({r[col["Metric Unit"]]})'] = r[col["Metric Value"]]
    return out

ours, peer = metrics(sys.argv[1]), metrics(sys.argv[2])
keys = [k for k in ours if k in peer]
w = max(len(k) for k in keys)
print(f'{"metric":<{w}}  {"ours":>14}  {"peer":>14}')
for k in keys:
    print(f"{k:<{w}}  {ours[k]:>14}  {peer[k]:>14}")
PY

#!/usr/bin/env bash
# GPU validation from the source tree with jax_dsa/_lib built (carry it to the GPU machine):
#
#   bash dev/gpu_validate.sh [tests-fwd] [tests-bwd] [tests-rest] [tests-sort] [memcheck]
#                            [bench] [bench-indexer] [bench-decode] [bench-order] [bench-layer]
#                            [train-compare] [wgmma-ceiling] [bench-pools]
#                            [profile] [hotlines] [hotlines-layer] [hotlines-decode]
#                                                                         (default: all tests)
#
# Each step has its own time limit (the backward tests take ~6 minutes on an H200, more than 9
# on an H100: run them in their own device call) and writes its full log to $OUT (or
# ./build/gpu); the summary lines are printed. WORKERS=4 runs the test steps under pytest-xdist
# (tests/conftest.py splits the GPU's memory between the workers; -s output is not shown then).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the examples import the source tree
out="${OUT:-build/gpu}"
mkdir -p "$out"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests-fwd tests-bwd tests-rest memcheck)
nvidia-smi -L
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

pytest_step() {  # name seconds files...   (WORKERS=N: N pytest-xdist processes on the GPU)
  local name=$1 secs=$2 par=()
  shift 2
  [ "${WORKERS:-1}" -gt 1 ] && par=(-n "$WORKERS")
  timeout "$secs" python3 -m pytest -q -rf "${par[@]}" "$@" > "$out/$name.log" 2>&1
  rc=$?
  grep -E "passed|failed|FAILED|atomic dkv" "$out/$name.log" | tail -12
}

hot_lines() {  # name seconds top ncu-options... -- command...: source counters, then the hot SASS lines
  local name=$1 secs=$2 top=$3 opts=()
  shift 3
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
  [ $# -gt 0 ] || { echo "hot_lines $name: no -- before the command"; rc=2; return; }
  shift
  timeout "$secs" ncu --clock-control none "${opts[@]}" --section SourceCounters \
    --section WarpStateStats -o "$out/$name" -f "$@" > "$out/$name.log" 2>&1 || rc=$?
  ncu --import "$out/$name.ncu-rep" --page source --csv --print-source sass \
    > "$out/$name.csv" 2>/dev/null || rc=$?
  python3 dev/ncu_hot_lines.py "$out/$name.csv" "$top" | cut -c1-160
}

for step in "${steps[@]}"; do
  start=$(date +%s)
  case "$step" in
    tests-fwd) pytest_step tests-fwd 200 tests/test_gpu_forward.py ;;
    tests-bwd) pytest_step tests-bwd 540 -s tests/test_gpu_backward.py ;;
    tests-rest) pytest_step tests-rest 420 tests/test_gpu_group_union.py \
        tests/test_gpu_training.py tests/test_gpu_indexer.py tests/test_gpu_target.py tests/test_gpu_indexer_loss.py \
        tests/test_native_build.py tests/test_user_facing.py ;;
    memcheck)
      timeout 240 compute-sanitizer --tool memcheck --leak-check no python3 \
        tests/gpu_memcheck_case.py > "$out/memcheck.log" 2>&1
      rc=$?
      grep -E "ERROR SUMMARY|done" "$out/memcheck.log" ;;
    bench)
      timeout 300 python3 examples/benchmark.py --quick --impls cute,cute-det,xla --calls 5 \
        --batches 3 --out "$out/bench" > "$out/bench.log" 2>&1
      rc=$?
      grep -v "^|" "$out/bench.log" | tail -32 ;;
    bench-indexer)
      timeout 300 python3 examples/benchmark_indexer.py --impls cute --out "$out/bench" \
        > "$out/bench_indexer.log" 2>&1
      rc=$?
      grep -v "^|" "$out/bench_indexer.log" | tail -8 ;;
    bench-layer)  # one V4 layer's training step, piece by piece, kernels and reference
      timeout 500 python3 examples/benchmark_layer.py --impls cute,xla > "$out/bench_layer.log" 2>&1
      rc=$?
      tail -16 "$out/bench_layer.log" ;;
    train-compare)  # the DSA layer at the kernels' shapes, trained on the kernels and the reference
      rc=0
      for style in v3.2 v4; do
        timeout 290 python3 examples/train_dsa.py --size kernel --style "$style" --compare \
          --steps 200 --warmup 60 > "$out/train_compare_$style.log" 2>&1 || rc=$?
        tail -3 "$out/train_compare_$style.log"
      done ;;
    bench-pools)  # sparse_mla's second KV pool against one pre-concatenated pool
      timeout 300 python3 dev/bench_two_pools.py > "$out/bench_pools.log" 2>&1
      rc=$?
      tail -3 "$out/bench_pools.log" ;;
    wgmma-ceiling)  # bare wgmma throughput per shape (the score kernel's ceiling)
      timeout 120 python3 dev/wgmma_ceiling.py --out "$out/wgmma" > "$out/wgmma_ceiling.log" 2>&1
      rc=$?
      grep "TFLOP" "$out/wgmma_ceiling.log" ;;
    tests-sort)  # the backward's row order (BwdConfig.sort_rows, the row-order kernel) and the
      # `_long` cases that run it by default
      pytest_step tests-sort 300 tests/test_gpu_backward.py \
        -k "sort or never_writes or rows_order or S40000 or S33000 or S20000" ;;
    bench-order)  # the backward's time per list order, the library's sort and its cost alone
      timeout 400 python3 dev/list_order_bench.py > "$out/bench_order.log" 2>&1
      rc=$?
      grep -E " (bwd|fwd|alone) " "$out/bench_order.log" ;;
    bench-decode)
      timeout 200 python3 dev/bench_decode.py > "$out/bench_decode.log" 2>&1
      rc=$?
      grep "B=" "$out/bench_decode.log" ;;
    profile)  # ncu, one launch per kernel and shape (dev/profile_case.py), headline metrics
      rc=0
      for c in "fwd 64 SparseMlaFwd" "fwd 16 SparseMlaFwd" "bwd 64 SparseMlaBwd" "bwd 16 SparseMlaBwd"; do
        set -- $c
        timeout 120 ncu --clock-control none --launch-skip 1 --launch-count 1 --kernel-name "regex:$3" \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
          --section Occupancy --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 dev/profile_case.py "$1" "$2" 512 > "$out/profile_$1_h$2.log" 2>&1 || rc=$?
        echo "$1 H=$2: $(grep -E "^ +(Duration|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Issue Slots Busy)" \
          "$out/profile_$1_h$2.log" | awk '{$1=$1};1' | tr '\n' ';')"
      done ;;
    hotlines)  # ncu source counters: the SASS lines where the warps wait (dev/ncu_hot_lines.py)
      rc=0
      for c in "fwd 64 0 SparseMlaFwd" "bwd 64 512 SparseMlaBwd"; do
        set -- $c
        hot_lines "src_$1_h$2_k$3" 150 20 --launch-skip 1 --launch-count 1 --kernel-name "regex:$4" -- \
          python3 dev/profile_case.py "$1" "$2" "$3"
      done ;;
    hotlines-decode)  # the same for the decode forward's split kernel (8 tokens, S 64K, 8 parts)
      rc=0
      hot_lines src_decode8 150 30 --launch-skip 1 --launch-count 1 \
        --kernel-name regex:SparseMlaFwdPingPong -- python3 dev/profile_case.py decode 8 ;;
    hotlines-layer)  # the same for the DSA layer's attention backward kernel (V4-Flash)
      rc=0
      hot_lines src_layer_bwd 200 30 --profile-from-start off --kernel-name regex:SparseMlaBwd -- \
        python3 dev/profile_layer.py V4-Flash attn_bwd ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "[$step] rc=$rc in $(( $(date +%s) - start )) s"
done

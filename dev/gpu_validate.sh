#!/usr/bin/env bash
# One device call's worth of GPU validation, from the source tree with jax_dsa/_lib built:
#
#   bash tools/gpu_validate.sh [tests] [memcheck] [bench] [smoke] [profile] [hotlines] [candidates]
#                                                                (default: tests memcheck)
#
# Each step has its own time limit and writes its full log to $OUT (or /tmp/jax_dsa_gpu); the
# summary lines are printed. JAX_DSA_FWD_IMPL / JAX_DSA_BWD_IMPL select kernel variants as usual,
# so a candidate built with `tools/build_kernels.py --experimental` is validated by setting them.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/jax_dsa_gpu}"
mkdir -p "$out"
steps=("$@")

# candidate_tests ENV_VAR TAG forward|backward SECONDS: that pass's GPU tests with the variant
# forced; sets rc on failure (124: timed out, e.g. a hang).
candidate_tests() {
  env "$1=$2" timeout "$4" python3 -m pytest -q "tests/test_gpu_$3.py" > "$out/cand_tests_$2.log" 2>&1
  local r=$?
  [ $r -eq 0 ] || rc=$r
  echo "$3 tests with $2 rc=$r (124: timed out, e.g. a hang): $(tail -1 "$out/cand_tests_$2.log")"
}
[ ${#steps[@]} -gt 0 ] || steps=(tests memcheck)
nvidia-smi -L
echo "FWD_IMPL=${JAX_DSA_FWD_IMPL:-default} BWD_IMPL=${JAX_DSA_BWD_IMPL:-default} commit $(git rev-parse --short HEAD 2>/dev/null)"
for step in "${steps[@]}"; do
  start=$(date +%s)
  case "$step" in
    tests)
      timeout 480 python3 -m pytest -q -s tests/test_gpu_forward.py tests/test_gpu_backward.py \
        tests/test_gpu_training.py tests/test_native_build.py > "$out/tests.log" 2>&1
      rc=$?
      grep -E "passed|failed|FAILED|atomic dkv|noise" "$out/tests.log" | tail -12 ;;
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
    smoke)
      timeout 300 python3 tools/gpu_smoke_fwd.py --impl "${JAX_DSA_FWD_IMPL:-default}" \
        > "$out/smoke.log" 2>&1
      rc=$?
      grep -E "cases passed|FAIL|TIME" "$out/smoke.log" ;;
    profile)  # ncu, one launch per kernel and shape (tools/profile_case.py), headline metrics
      rc=0
      for c in "fwd 64 sparse_mla_fwd" "fwd 16 sparse_mla_fwd" "bwd 64 sparse_mla_bwd" "bwd 16 sparse_mla_bwd"; do
        set -- $c
        timeout 120 ncu --clock-control none --launch-skip 1 --launch-count 1 --kernel-name "regex:$3" \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
          --section Occupancy --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 tools/profile_case.py "$1" "$2" 512 > "$out/profile_$1_h$2.log" 2>&1 || rc=$?
        echo "$1 H=$2: $(grep -E "^ +(Duration|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Issue Slots Busy)" \
          "$out/profile_$1_h$2.log" | awk '{$1=$1};1' | tr '\n' ';')"
      done ;;
    hotlines)  # ncu source counters: the SASS lines where the warps wait (tools/ncu_hot_lines.py)
      rc=0
      for c in "fwd 64 0 sparse_mla_fwd" "bwd 64 512 sparse_mla_bwd"; do
        set -- $c
        timeout 150 ncu --clock-control none --launch-skip 1 --launch-count 1 --kernel-name "regex:$4" \
          --section SourceCounters --section WarpStateStats -o "$out/src_$1_h$2_k$3" -f \
          python3 tools/profile_case.py "$1" "$2" "$3" > "$out/src_$1_h$2_k$3.log" 2>&1 || rc=$?
        ncu --import "$out/src_$1_h$2_k$3.ncu-rep" --page source --csv --print-source sass \
          > "$out/src_$1_h$2_k$3.csv" 2>/dev/null || rc=$?
        python3 tools/ncu_hot_lines.py "$out/src_$1_h$2_k$3.csv" 20 | cut -c1-160
      done ;;
    candidates)  # experimental variants (library built with --experimental), named by
      # FWD_CANDIDATES / BWD_CANDIDATES (space-separated tags): the GPU tests of the pass with
      # the candidate forced first (forward ~40 s, backward ~4 min; a barrier-protocol bug
      # hangs: time limits), then speed against the default
      rc=0
      [ -n "${FWD_CANDIDATES:-}${BWD_CANDIDATES:-}" ] || echo "no FWD_CANDIDATES / BWD_CANDIDATES given"
      for v in ${FWD_CANDIDATES:-}; do candidate_tests JAX_DSA_FWD_IMPL "$v" forward 150; done
      for v in ${BWD_CANDIDATES:-}; do candidate_tests JAX_DSA_BWD_IMPL "$v" backward 330; done
      # speed: tools/ab_bench.py (default and candidates alternated over 3 rounds, ~35 s per
      # benchmark process; ratios to the default of the same round; AB_HEADS=64,128 times only
      # those head counts)
      if [ -n "${FWD_CANDIDATES:-}" ]; then
        timeout 900 python3 tools/ab_bench.py --pass fwd --impls "default,${FWD_CANDIDATES// /,}" \
          --heads "${AB_HEADS:-}" --out "$out/ab_fwd" > "$out/ab_fwd.log" 2>&1 || rc=$?
        tail -8 "$out/ab_fwd.log"
      fi
      if [ -n "${BWD_CANDIDATES:-}" ]; then
        timeout 900 python3 tools/ab_bench.py --pass bwd --impls "default,${BWD_CANDIDATES// /,}" \
          --heads "${AB_HEADS:-}" --out "$out/ab_bwd" > "$out/ab_bwd.log" 2>&1 || rc=$?
        tail -8 "$out/ab_bwd.log"
      fi ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "[$step] rc=$rc in $(( $(date +%s) - start )) s"
done

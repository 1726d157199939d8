#!/usr/bin/env bash
# One device call's worth of GPU validation, from the source tree with jax_dsa/_lib built:
#
#   bash tools/gpu_validate.sh [tests] [memcheck] [bench] [smoke]   (default: tests memcheck)
#
# Each step has its own time limit and writes its full log to $OUT (or /tmp/jax_dsa_gpu); the
# summary lines are printed. JAX_DSA_FWD_IMPL / JAX_DSA_BWD_IMPL select kernel variants as usual,
# so a candidate built with `tools/build_kernels.py --experimental` is validated by setting them.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/jax_dsa_gpu}"
mkdir -p "$out"
steps=("$@")
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
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "[$step] rc=$rc in $(( $(date +%s) - start )) s"
done

#!/usr/bin/env bash
# Builds ./flashmla_bench: a torch-free timing harness around FlashMLA's SM90 sparse prefill kernel
# (sm90::fwd::run_fwd_phase1_kernel<D_QK, /*HAVE_TOPK_LENGTH=*/false>, the function FlashMLA's python
# op flash_mla_sparse_fwd reaches on sm_90a when topk_length is None).
#
# FlashMLA sources are compiled unmodified, extracted from the local git mirrors:
#   FlashMLA  9241ae3ef9bac614dd25e45e507e089f888280e0 (HEAD of the mirror, 2026-04-29)
#   CUTLASS   147f5673d0c1c3dcf66f78d677fd647e4a020219 (the commit FlashMLA's csrc/cutlass submodule pins)
# Usage: ./build_flashmla_bench.sh            (NVCC=/path/to/nvcc, JOBS=1, FORCE=1 (rebuild all objects) may be set)
set -euo pipefail
cd "$(dirname "$0")"
HERE=$PWD
NVCC=${NVCC:-/usr/local/bin/nvcc}
JOBS=${JOBS:-2}
FLASHMLA_GIT=${FLASHMLA_GIT:-/work/.mirror/deepseek-ai+FlashMLA/repo}
CUTLASS_GIT=${CUTLASS_GIT:-/work/.mirror/NVIDIA+cutlass/repo}
FLASHMLA_COMMIT=9241ae3ef9bac614dd25e45e507e089f888280e0
CUTLASS_COMMIT=147f5673d0c1c3dcf66f78d677fd647e4a020219
DEPS=$HERE/deps
FM=$DEPS/FlashMLA/csrc
CL=$DEPS/cutlass

# ---- 1. extract sources (once) ----
if [ ! -f "$FM/sm90/prefill/sparse/phase1.cuh" ]; then
  mkdir -p "$DEPS"
  git --git-dir="$FLASHMLA_GIT" archive --prefix=FlashMLA/ "$FLASHMLA_COMMIT" \
      csrc/defines.h csrc/params.h csrc/utils.h csrc/kerutils csrc/sm90/helpers.h csrc/sm90/prefill/sparse \
    | tar -x -C "$DEPS"
fi
# (the CUTLASS mirror lacks an unrelated media/*.png blob: git may print "invalid object"; harmless, exit code 0)
if [ ! -f "$CL/include/cute/tensor.hpp" ]; then
  mkdir -p "$DEPS"
  git --git-dir="$CUTLASS_GIT" archive --prefix=cutlass/ "$CUTLASS_COMMIT" include tools/util/include \
    | tar -x -C "$DEPS"
fi

# ---- 2. flags: FlashMLA setup.py nvcc flags (sm90 part only) ----
FLAGS=(
  -O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -Wno-deprecated-declarations
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
  -U__CUDA_NO_BFLOAT16_CONVERSIONS__
  --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
  "--ptxas-options=-v,--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage,--warn-on-double-precision-use"
  -lineinfo
  -gencode arch=compute_90a,code=sm_90a
)
INCS=( -I"$FM" -I"$FM/kerutils/include" -I"$FM/sm90" -I"$CL/include" -I"$CL/tools/util/include" )

mkdir -p build
compile() {  # src obj log
  if [ -n "${FORCE:-}" ] || [ ! -f "$2" ] || [ "$1" -nt "$2" ]; then
    echo "[build] $1"
    "$NVCC" "${FLAGS[@]}" "${INCS[@]}" -c "$1" -o "$2" > "$3" 2>&1 || { cat "$3"; echo "FAILED: $1"; return 1; }
    grep -E "registers|spill|smem|Compiling entry" "$3" | grep -v "^$" | sed 's/^/    /' || true
  fi
}

# The two FlashMLA explicit-instantiation TUs (unmodified): d_qk=512 and d_qk=576, HAVE_TOPK_LENGTH=false
pids=()
compile "$FM/sm90/prefill/sparse/instantiations/phase1_k512.cu" build/phase1_k512.o build/phase1_k512.log & pids+=($!)
if [ "$JOBS" -lt 2 ]; then wait "${pids[@]}"; pids=(); fi
compile "$FM/sm90/prefill/sparse/instantiations/phase1_k576.cu" build/phase1_k576.o build/phase1_k576.log & pids+=($!)
compile "$HERE/flashmla_bench.cu" build/flashmla_bench.o build/flashmla_bench.log & pids+=($!)
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
[ $rc -eq 0 ] || { echo "compile failed"; exit 1; }

# ---- 3. link, static CUDA runtime (libcuda.so.1 is dlopen'ed from the driver at run time) ----
"$NVCC" -gencode arch=compute_90a,code=sm_90a -cudart static \
  build/flashmla_bench.o build/phase1_k512.o build/phase1_k576.o -o flashmla_bench
echo "[build] OK: $HERE/flashmla_bench ($(du -h flashmla_bench | cut -f1))"
ldd flashmla_bench || true

"""The H200's bf16 wgmma throughput for the shapes the indexer's score kernel can use, with no
epilogue and no data movement: the ceiling of a score-GEMM schedule.

    python dev/wgmma_ceiling.py [--iters 20000] [--out build/wgmma]      (on the GPU machine)

Writes a CUDA file with one kernel per (N, A operand source, warpgroups per CTA), compiles it
with nvcc for sm_90a and prints TFLOP/s and the fraction of the 989 TFLOP/s dense peak. Each
warpgroup issues groups of 8 wgmma m64nNk16 (bf16 in, fp32 accumulate; A from shared memory
("SS") or registers ("RS"), B from shared memory, 128-byte swizzle) on one accumulator, commits
and waits, `iters` times; one CTA per SM (132 CTAs). The operands' values do not matter; the
descriptors point at zeroed 1 KB-aligned shared memory.

`--random` fills the operands with random bf16 values of magnitude [0.5, 1) instead (the tensor
cores draw more power on toggling data), and `--sustain SEC` launches each kernel back to back
for about SEC seconds (the GPU reaches its power limit within the first ~0.5 s) and prints the
median of the second half of the launches together with the SM clock measured inside the kernel
(clock64 against %globaltimer): the peak this GPU sustains for a long GEMM at its power limit.
`--configs 64RS2,256SS2` keeps only those (N, A source, warpgroups).
"""
import argparse
import os
import subprocess

PEAK = 989.4  # TFLOP/s, H100/H200 SXM dense bf16
SMS = 132
CONFIGS = [(n, mode, wgs) for n in (64, 128, 256) for mode in ("SS", "RS") for wgs in (1, 2)]


def _kernel(n, mode, wgs):
    acc = n // 2
    d_regs = ", ".join(f"%{i}" for i in range(acc))
    if mode == "SS":
        a_op, a_cons, b_idx = f"%{acc}", '"l"(desc_a)', acc + 1
        tail = "p, 1, 1, 0, 0"
    else:
        a_op = "{" + ", ".join(f"%{acc + i}" for i in range(4)) + "}"
        a_cons = ", ".join(f'"r"(a[{i}])' for i in range(4))
        b_idx = acc + 4
        tail = "p, 1, 1, 0"
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(acc))
    ins = f'{a_cons}, "l"(desc_b), "r"(scale_d)'
    asm = (f'"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{b_idx + 1}, 0;\\n'
           f'wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d_regs}}}, {a_op}, '
           f'%{b_idx}, {tail};\\n}}\\n"')
    name = f"k_n{n}_{mode}_{wgs}"
    return name, f"""
__global__ void __launch_bounds__({128 * wgs}, 1) {name}(int iters, float* out) {{
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < 65536 / 4; i += blockDim.x) ((unsigned*)smem)[i] = fill(i);
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
  unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  unsigned long long desc_a = make_desc(base), desc_b = make_desc(base + 16384);
  unsigned a[4] = {{fill(threadIdx.x * 4 + 70001), fill(threadIdx.x * 4 + 70002),
                    fill(threadIdx.x * 4 + 70003), fill(threadIdx.x * 4 + 70004)}};
  unsigned long long c0 = clock64(), t0 = globaltimer();
  int scale_d = 1;  // accumulate (onto zeros at first)
  float d[{acc}];
  #pragma unroll
  for (int i = 0; i < {acc}; ++i) d[i] = 0.f;
  for (int it = 0; it < iters; ++it) {{
    asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
    #pragma unroll
    for (int k = 0; k < 8; ++k) {{
      asm volatile({asm} : {outs} : {ins});
    }}
    asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
  }}
  float s = 0.f;
  #pragma unroll
  for (int i = 0; i < {acc}; ++i) s += d[i];
  if (s == 12345.f) out[threadIdx.x] = s;  // keeps the accumulators live
  if (blockIdx.x == 0 && threadIdx.x == 0) {{
    out[1000] = (float)(clock64() - c0);
    out[1001] = (float)(globaltimer() - t0);
  }}
}}
"""


def source(iters, configs=CONFIGS, random=False, sustain=0.0):
    kernels = [_kernel(*c) for c in configs]
    runs = "\n".join(
        f'  run("{name}", {name}, {n}, "{mode}", {wgs}, iters, out);'
        for (name, _), (n, mode, wgs) in zip(kernels, configs))
    return f"""#include <algorithm>
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>

#define RANDOM {int(random)}
#define SUSTAIN_S {sustain}

// An operand word: two bf16 of magnitude [0.5, 1) with hashed signs and mantissas, or zeros.
__device__ unsigned fill(unsigned i) {{
  if (!RANDOM) return 0u;
  unsigned h = i * 2654435761u;
  h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
  return (h & 0x807F807Fu) | 0x3F003F00u;
}}

__device__ unsigned long long globaltimer() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}}

__device__ unsigned long long make_desc(unsigned addr) {{
  // K-major, 128-byte swizzle: start >> 4, leading byte offset 16 B (unused), stride 1024 B.
  unsigned long long d = (addr & 0x3FFFF) >> 4;
  d |= 1ull << 16;
  d |= (unsigned long long)(1024 >> 4) << 32;
  d |= 1ull << 62;
  return d;
}}
{''.join(src for _, src in kernels)}
template <class K>
void run(const char* name, K kernel, int n, const char* mode, int wgs, int iters, float* out) {{
  int smem = 100 * 1024;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  kernel<<<{SMS}, 128 * wgs, smem>>>(iters / 10, out);  // warm-up
  std::vector<float> times;
  std::vector<double> mhz;
  double spent = 0.0;
  do {{
    cudaEventRecord(e0);
    kernel<<<{SMS}, 128 * wgs, smem>>>(iters, out);
    cudaEventRecord(e1);
    if (cudaEventSynchronize(e1) != cudaSuccess) break;
    float ms = 0.f, clk[2];
    cudaEventElapsedTime(&ms, e0, e1);
    cudaMemcpy(clk, out + 1000, sizeof(clk), cudaMemcpyDeviceToHost);
    times.push_back(ms);
    mhz.push_back(1e3 * clk[0] / clk[1]);
    spent += ms * 1e-3;
  }} while (spent < SUSTAIN_S);
  if (times.empty()) {{
    printf("N %3d %s wgs %d: %s\\n", n, mode, wgs, cudaGetErrorString(cudaGetLastError()));
    return;
  }}
  size_t h = times.size() / 2;  // the second half: at the power limit when sustained
  std::vector<float> t2(times.begin() + h, times.end());
  std::vector<double> m2(mhz.begin() + h, mhz.end());
  std::sort(t2.begin(), t2.end());
  std::sort(m2.begin(), m2.end());
  float ms = t2[t2.size() / 2];
  cudaError_t err = cudaGetLastError();
  double flop = 2.0 * 64 * n * 16 * 8 * (double)iters * wgs * {SMS};
  double tf = flop / (ms * 1e-3) / 1e12;
  printf("N %3d %s wgs %d: %8.3f ms %7.1f TFLOP/s %5.1f %% of {PEAK}, SM clock %.0f MHz "
         "(%zu launches) %s\\n", n, mode, wgs, ms, tf, 100.0 * tf / {PEAK}, m2[m2.size() / 2],
         times.size(), err == cudaSuccess ? "" : cudaGetErrorString(err));
}}

int main() {{
  float* out;
  cudaMalloc(&out, 1024 * sizeof(float));
  int iters = {iters};
{runs}
  return 0;
}}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--out", default=os.path.join("build", "wgmma"))
    ap.add_argument("--random", action="store_true", help="random bf16 operands, not zeros")
    ap.add_argument("--sustain", type=float, default=0.0,
                    help="launch each kernel back to back for about this many seconds")
    ap.add_argument("--configs", default="", help="e.g. 64RS2,256SS2 (default: all)")
    args = ap.parse_args()
    configs = CONFIGS
    if args.configs:
        configs = [c for c in CONFIGS if f"{c[0]}{c[1]}{c[2]}" in args.configs.split(",")]
    os.makedirs(args.out, exist_ok=True)
    cu = os.path.join(args.out, "wgmma_ceiling.cu")
    with open(cu, "w") as f:
        f.write(source(args.iters, configs, args.random, args.sustain))
    exe = os.path.join(args.out, "wgmma_ceiling")
    subprocess.run(["nvcc", "-O3", "-gencode", "arch=compute_90a,code=sm_90a",
                    "-diag-suppress", "177", "-o", exe, cu], check=True)
    subprocess.run([exe], check=True)


if __name__ == "__main__":
    main()

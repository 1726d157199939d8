// Microbenchmark: the forward's data movement alone, without any MMA. Each CTA does what the
// pingpong forward's producer does for one (token, part, head block): it reads its list's
// indices and gathers 64-row blocks of bf16 kv rows into a 2-stage shared-memory ring with
// 16-byte cp.async, then stores its 64 x 512 output tile (bf16). One CTA per SM (the kernel's
// 200+ KB of shared memory), grid order (token, part, head block) as the kernel's. The time of
// a case is a floor for any forward that keeps that grid (its gathers and stores), however it
// computes; "hb 1" is the same work with one CTA per token covering all heads (each row
// gathered once per token), the design the issue asks about.
//   nvcc -O3 -arch=sm_90a dev/fwd_gather_floor.cu -o build/fgf && build/fgf
// Lists: as examples/benchmark.py --long (the 128 positions ending at the token + distinct
// uniform rows of [0, S)), tokens = the last T positions of S.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>
#include <cuda_runtime.h>

#include "median_ms.cuh"

constexpr int WINDOW = 128, BLOCK = 64, D_V = 512;
constexpr int SMEM_BYTES = 200 * 1024;  // forces one CTA per SM, as the kernel's 208-224 KB

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// grid x = (t * P + p) * HB + hb; the CTA gathers entries [p * per, (p + 1) * per) of token t.
// chunks = Dqk * 2 / 16 per row. GATHER = false: the launch, index loads and stores alone.
template <bool GATHER>
__global__ void __launch_bounds__(256) fwd_moves(const uint4* kv, const int* idx, int K, int P,
                                                 int HB, int chunks, uint4* out, uint4* sink) {
  extern __shared__ uint4 ring[];  // 2 stages x BLOCK rows x chunks
  const int cta = blockIdx.x;
  const int p = (cta / HB) % P, t = cta / (HB * P);  // every head block gathers the same rows
  const int per = (K + P - 1) / P;
  const int begin = p * per, end = min(K, begin + per);
  const int* list = idx + (size_t)t * K;
  const int n_blocks = (end - begin + BLOCK - 1) / BLOCK;
  const int stage_chunks = BLOCK * chunks;
  uint4 acc = make_uint4(0, 0, 0, 0);
  __shared__ int rows[2][BLOCK];  // the block's indices, loaded before its gathers
  for (int b = 0; b < n_blocks; ++b) {
    uint4* stage = ring + (b & 1) * stage_chunks;
    if (GATHER) {
      if (threadIdx.x < BLOCK) {
        const int e = begin + b * BLOCK + threadIdx.x;
        rows[b & 1][threadIdx.x] = e < end ? __ldg(list + e) : -1;
      }
      __syncthreads();
      // 16 consecutive threads read one row's 16-byte chunks; each thread walks rows
      for (int r = threadIdx.x / 16; r < BLOCK; r += blockDim.x / 16) {
        const int row = rows[b & 1][r];
        if (row >= 0)
          for (int c = threadIdx.x % 16; c < chunks; c += 16)
            cp_async16(stage + r * chunks + c, kv + (size_t)row * chunks + c);
      }
      cp_commit();
      cp_wait1();  // the previous block has landed: "consume" one 16-byte word of it
    }
    __syncthreads();
    if (b > 0) {
      uint4 x = ring[((b - 1) & 1) * stage_chunks + threadIdx.x];
      acc.x ^= x.x;
    }
  }
  if (GATHER) cp_wait0();
  __syncthreads();
  // the part's output tile: 64 heads x 512 bf16 (64 KB), row-major, 16-byte stores
  uint4* o = out + (size_t)cta * (64 * D_V * 2 / 16);
  for (int i = threadIdx.x; i < 64 * D_V * 2 / 16; i += blockDim.x)
    o[i] = make_uint4(acc.x ^ i, 0, 0, 0);
  if (acc.x == 0x12345678u) sink[0] = acc;
}

struct Case {
  const char* name;
  int T, S, K, Dqk, P, HB;
};

int main() {
  const Case cases[] = {
      {"decode 8 tok,  8 parts, hb 2 (today)", 8, 65536, 2048, 576, 8, 2},
      {"decode 8 tok,  8 parts, hb 1        ", 8, 65536, 2048, 576, 8, 1},
      {"decode 8 tok, 16 parts, hb 1        ", 8, 65536, 2048, 576, 16, 1},
      {"decode 64 tok, 1 part,  hb 2 (today)", 64, 65536, 2048, 576, 1, 2},
      {"decode 64 tok, 1 part,  hb 1        ", 64, 65536, 2048, 576, 1, 1},
      {"decode 64 tok, 2 parts, hb 1        ", 64, 65536, 2048, 576, 2, 1},
      {"V3.2 S 128K prefill,    hb 2 (today)", 4096, 131072, 2048, 576, 1, 2},
      {"V3.2 S 128K prefill,    hb 1        ", 4096, 131072, 2048, 576, 1, 1},
      {"V4-Pro S 64K prefill,   hb 2 (today)", 4096, 65536, 1152, 512, 1, 2},
      {"V4-Pro S 64K prefill,   hb 1        ", 4096, 65536, 1152, 512, 1, 1},
  };
  std::mt19937 rng(1);
  uint4* sink;
  cudaMalloc(&sink, 16);
  cudaFuncSetAttribute(fwd_moves<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  cudaFuncSetAttribute(fwd_moves<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  int dev_l2 = 0;
  cudaDeviceGetAttribute(&dev_l2, cudaDevAttrL2CacheSize, 0);
  printf("L2 %d MB; one CTA per SM (%d KB shared), 256 threads\n", dev_l2 >> 20, SMEM_BYTES >> 10);
  for (const Case& c : cases) {
    std::vector<int> h((size_t)c.T * c.K);
    std::vector<char> used(c.S);
    for (int t = 0; t < c.T; ++t) {
      const int pos = c.S - c.T + t;
      std::fill(used.begin(), used.end(), 0);
      int* l = h.data() + (size_t)t * c.K;
      int n = 0;
      for (int w = 0; w < WINDOW; ++w) {
        l[n++] = pos - w;
        used[pos - w] = 1;
      }
      while (n < c.K) {  // distinct uniform rows
        int r = rng() % c.S;
        if (!used[r]) used[r] = 1, l[n++] = r;
      }
      std::shuffle(l, l + c.K, rng);
    }
    const int chunks = c.Dqk * 2 / 16;
    const int ctas = c.T * c.P * c.HB;
    int* idx;
    uint4 *kv, *out;
    cudaMalloc(&idx, h.size() * 4);
    cudaMalloc(&kv, (size_t)c.S * c.Dqk * 2);
    cudaMalloc(&out, (size_t)ctas * 64 * D_V * 2);
    cudaMemcpy(idx, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
    cudaMemset(kv, 0x3f, (size_t)c.S * c.Dqk * 2);
    auto run = [&](bool gather) {
      if (gather)
        fwd_moves<true><<<ctas, 256, SMEM_BYTES>>>(kv, idx, c.K, c.P, c.HB, chunks, out, sink);
      else
        fwd_moves<false><<<ctas, 256, SMEM_BYTES>>>(kv, idx, c.K, c.P, c.HB, chunks, out, sink);
    };
    for (int i = 0; i < 3; ++i) run(true);
    const int reps = c.T >= 4096 ? 9 : 51;
    const float tg = median_ms([&] { run(true); }, reps);
    const float t0 = median_ms([&] { run(false); }, reps);
    const double gb = double(c.T) * c.HB * c.K * c.Dqk * 2 / 1e9;
    printf("%s: %5d CTAs, gather %.3f GB: %9.1f us (%.2f TB/s) | no gather (launch, stores) "
           "%7.1f us\n", c.name, ctas, gb, tg * 1e3, gb / tg, t0 * 1e3);
    cudaFree(idx);
    cudaFree(kv);
    cudaFree(out);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}

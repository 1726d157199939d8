// Microbenchmark: the L2 traffic of the grouped H=16 backward alone, without any MMA. For the
// benchmark's H=16 lists (T = S = 4096, each token's 128 most recent rows ++ 512 distinct random
// rows) the union of every 4 consecutive tokens' lists is what the grouped backward walks (about
// 1.82 M entries). Per union entry the kernel gathers one bf16 kv row (1 KB at Dqk 512) and adds
// one fp32 dkv row (2 KB) with red.global.add.v4.f32, each warp instruction covering 4 rows x
// 128 B. This times those two streams alone and together, with as many warps as the GPU holds:
// the time of "both" is a floor for any kernel that moves these bytes, however it computes.
//   nvcc -O3 -arch=sm_90a dev/l2_floor_bench.cu -o build/l2f && build/l2f
#include <algorithm>
#include <cstdio>
#include <random>
#include <set>
#include <vector>
#include <cuda_runtime.h>

#include "median_ms.cuh"

constexpr int T = 4096, S = 4096, WINDOW = 128, TOPK = 512, G = 4, D = 512;

__device__ __forceinline__ void red_v4(float* p, float v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(p), "f"(v) : "memory");
}

// One warp per group of 16 entries (grid-stride). GATHER: read the 16 bf16 rows (64 x 16 B
// each) from kv. RED: add 2 KB of fp32 to each of the 16 dkv rows, lane l covering columns
// 4 (l % 8) + 32 c of row 4 q + l / 8 (4 rows x 128 B per instruction).
template <bool GATHER, bool RED>
__global__ void stream(float* dkv, const uint4* kv, const int* rows, int n_groups, uint4* sink) {
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int n_warps = gridDim.x * blockDim.x / 32;
  uint4 acc = make_uint4(0, 0, 0, 0);
  const float v = 1.0f + lane * 1e-3f;
  for (int g = warp; g < n_groups; g += n_warps) {
    const int* r = rows + g * 16;
    if (GATHER) {
#pragma unroll 8
      for (int i = 0; i < 32; ++i) {  // row i / 2, 16-byte chunks (i % 2) * 32 + lane
        uint4 x = __ldcg(kv + (size_t)r[i / 2] * (D / 8) + (i % 2) * 32 + lane);
        acc.x ^= x.x; acc.y ^= x.y; acc.z ^= x.z; acc.w ^= x.w;
      }
    }
    if (RED) {
#pragma unroll 1
      for (int q = 0; q < 4; ++q) {
        float* base = dkv + (size_t)r[4 * q + lane / 8] * D + (lane % 8) * 4;
#pragma unroll
        for (int c = 0; c < D; c += 32) red_v4(base + c, v);
      }
    }
  }
  if (acc.x == 0x12345678u) sink[0] = acc;  // keeps the loads
}

template <bool GATHER, bool RED>
float time_ms(float* dkv, const uint4* kv, const int* rows, int n_groups, uint4* sink, int blocks,
              int threads = 256) {
  return median_ms(
      [&] { stream<GATHER, RED><<<blocks, threads>>>(dkv, kv, rows, n_groups, sink); }, 9);
}

int main() {
  // the benchmark's lists and their unions per group of G tokens
  std::mt19937 rng(1);
  std::vector<int> entries;
  std::vector<int> all(S);
  for (int i = 0; i < S; ++i) all[i] = i;
  for (int t0 = 0; t0 < T; t0 += G) {
    std::set<int> u;
    for (int t = t0; t < t0 + G; ++t) {
      for (int w = 0; w < WINDOW; ++w)  // the window (rows < 0 are invalid entries)
        if (t - WINDOW + 1 + w >= 0) u.insert(t - WINDOW + 1 + w);
      std::shuffle(all.begin(), all.end(), rng);  // TOPK distinct random rows
      for (int k = 0; k < TOPK; ++k) u.insert(all[k]);
    }
    std::vector<int> grp(u.begin(), u.end());
    std::shuffle(grp.begin(), grp.end(), rng);
    entries.insert(entries.end(), grp.begin(), grp.end());
  }
  while (entries.size() % 16) entries.push_back(entries.back());
  const long n = entries.size();
  const int n_groups = n / 16;
  int* rows;
  float* dkv;
  uint4 *kv, *sink;
  cudaMalloc(&rows, n * 4);
  cudaMalloc(&dkv, (size_t)S * D * 4);
  cudaMalloc(&kv, (size_t)S * D * 2);
  cudaMalloc(&sink, 16);
  cudaMemcpy(rows, entries.data(), n * 4, cudaMemcpyHostToDevice);
  cudaMemset(dkv, 0, (size_t)S * D * 4);
  std::vector<unsigned short> h((size_t)S * D);
  for (auto& x : h) x = 0x3f80 + (rng() & 0x7f);  // bf16 values in [1, 2)
  cudaMemcpy(kv, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
  const double red_gb = n * D * 4.0 / 1e9, gather_gb = n * D * 2.0 / 1e9;
  printf("%ld union entries (%.3f of T x (WINDOW + TOPK)): RED %.2f GB, gather %.2f GB\n", n,
         double(n) / (double(T) * (WINDOW + TOPK)), red_gb, gather_gb);
  for (int blocks : {132 * 4, 132 * 8}) {
    float tr = time_ms<false, true>(dkv, kv, rows, n_groups, sink, blocks);
    float tg = time_ms<true, false>(dkv, kv, rows, n_groups, sink, blocks);
    float tb = time_ms<true, true>(dkv, kv, rows, n_groups, sink, blocks);
    printf("blocks=%d: RED alone %.3f ms (%.0f GB/s) | gather alone %.3f ms (%.0f GB/s) | both "
           "%.3f ms\n", blocks, tr, red_gb / tr * 1e3, tg, gather_gb / tg * 1e3, tb);
  }
  // how few warps per SM keep the RED stream at its rate (a design that leaves the REDs to
  // one warpgroup per SM, docs/performance.md "A RED stream that never pauses")
  for (int warps : {2, 4, 8, 16}) {
    float tr = time_ms<false, true>(dkv, kv, rows, n_groups, sink, 132, 32 * warps);
    printf("one CTA per SM, %2d warps: RED alone %.3f ms (%.0f GB/s)\n", warps, tr,
           red_gb / tr * 1e3);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}

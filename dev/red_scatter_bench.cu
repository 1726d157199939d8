// Microbenchmark: L2 fp32 RED throughput vs the footprint of one warp's red.global.add.v4.f32.
// Scatter-adds T*K = 4096*640 rows of 576 fp32 into a [S=4096, 576] buffer at random rows (the
// backward's dKV scatter at the benchmark shape, 6 GB). scatter<R>: each warp instruction covers
// R rows with 512/R contiguous bytes each. Why sparse_mla_bwd_wgmma._scatter transposes its
// accumulator: on the H200 (2026-11-29) 16 rows x 32 B took 2.63 ms, 8 x 64 B 1.93 ms,
// 4 x 128 B 1.60 ms, 1 x 512 B 1.60 ms.
//   nvcc -O3 -arch=sm_90a dev/red_scatter_bench.cu -o build/rb && build/rb
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#include "median_ms.cuh"

constexpr int S = 4096, D = 576;

__device__ __forceinline__ void red_v4(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

template <int ROWS>
__global__ void scatter(float* dkv, const int* rows, int n_groups) {
  // one warp per group of 16 rows; each row gets all D columns
  constexpr int LANES_PER_ROW = 32 / ROWS;
  constexpr int COLS_PER_STEP = LANES_PER_ROW * 4;
  int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  int n_warps = gridDim.x * blockDim.x / 32;
  float v = 1.0f + lane * 1e-3f;
  for (int g = warp; g < n_groups; g += n_warps) {
    const int* r = rows + g * 16;
#pragma unroll 1
    for (int rb = 0; rb < 16; rb += ROWS) {
      int row = r[rb + lane / LANES_PER_ROW];
      float* base = dkv + (size_t)row * D + (lane % LANES_PER_ROW) * 4;
#pragma unroll 4
      for (int c = 0; c < D; c += COLS_PER_STEP) {
        if (c + (lane % LANES_PER_ROW) * 4 < D) red_v4(base + c, v, v, v, v);
      }
    }
  }
}

template <int ROWS>
float run(float* dkv, const int* rows, int n_groups, int blocks) {
  return median_ms([&] { scatter<ROWS><<<blocks, 256>>>(dkv, rows, n_groups); }, 7);
}

int main() {
  const int T = 4096, K = 640;
  const long n_entries = (long)T * K;
  const int n_groups = n_entries / 16;
  std::vector<int> h(n_entries);
  srand(1);
  for (long i = 0; i < n_entries; ++i) h[i] = rand() % S;
  int* rows;
  float* dkv;
  cudaMalloc(&rows, n_entries * 4);
  cudaMalloc(&dkv, (size_t)S * D * 4);
  cudaMemcpy(rows, h.data(), n_entries * 4, cudaMemcpyHostToDevice);
  cudaMemset(dkv, 0, (size_t)S * D * 4);
  double gb = n_entries * D * 4.0 / 1e9;
  for (int blocks : {132 * 2, 132 * 4, 132 * 8}) {
    float t16 = run<16>(dkv, rows, n_groups, blocks);
    float t8 = run<8>(dkv, rows, n_groups, blocks);
    float t4 = run<4>(dkv, rows, n_groups, blocks);
    float t1 = run<1>(dkv, rows, n_groups, blocks);
    printf("blocks=%d  %.2f GB: 16rowsx32B %.3f ms (%.0f GB/s) | 8x64B %.3f ms (%.0f) | 4x128B %.3f ms (%.0f) | 1x512B %.3f ms (%.0f)\n",
           blocks, gb, t16, gb / t16 * 1e3, t8, gb / t8 * 1e3, t4, gb / t4 * 1e3, t1, gb / t1 * 1e3);
  }
  cudaError_t e = cudaGetLastError();
  printf("%s\n", cudaGetErrorString(e));
  return 0;
}

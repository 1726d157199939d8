// How fast can an H200 add 2 KB fp32 rows into an L2-resident dkv with vector atomics?
//
// The backward's dkv scatter issues one red.global.add.v4.f32 per 16 bytes: 2 KB per valid
// (token, entry) pair at Dqk 512, whatever H is. At H <= 16 the measured backward time barely
// depends on H, so this probe measures the ceiling of that traffic alone, on the benchmark's
// index lists (T = S = 4096, window 128 + 512 random picks), with no MMA, no gather and no
// pipeline around it. Three access patterns:
//   row512  : each warp instruction covers one row, 512 contiguous bytes (32 lanes x 16 B);
//   rows4   : each warp instruction covers 4 rows x 128 contiguous bytes (the kernel's pattern);
//   gather  : plain 16-byte loads of the same rows from a bf16 kv (1 KB per pair), for scale.
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90a -o /tmp/probe tools/probe_red_throughput.cu
// && /tmp/probe
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define CHECK(x)                                                                         \
  do {                                                                                   \
    cudaError_t e = (x);                                                                 \
    if (e != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));     \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

constexpr int kTokens = 4096, kRows = 4096, kWindow = 128, kPicks = 512;
constexpr int kEntries = kWindow + kPicks, kCols = 512;

// The instruction the backward kernel issues (common.py: red_add_v4_f32).
__device__ __forceinline__ void red_v4(float4* ptr, float a, float b, float c, float d) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "f"(a),
               "f"(b), "f"(c), "f"(d)
               : "memory");
}

// One warp per (token, entry): 4 instructions of 32 x float4 = one 2 KB row.
__global__ void red_row512(float* dkv, const int* idx, long pairs, float value) {
  long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  for (long p = warp; p < pairs; p += (long)gridDim.x * blockDim.x / 32) {
    int row = idx[p];
    if (row < 0) continue;
    float4* dst = reinterpret_cast<float4*>(dkv + (long)row * kCols);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      red_v4(dst + i * 32 + lane, value, -value, value, 0.5f * value);
  }
}

// One warp per 4 pairs: each instruction covers 8 lanes x 16 B = 128 B of each of 4 rows.
__global__ void red_rows4(float* dkv, const int* idx, long pairs, float value) {
  long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  for (long p0 = warp * 4; p0 < pairs; p0 += (long)gridDim.x * blockDim.x / 32 * 4) {
    long p = p0 + lane / 8;
    int row = p < pairs ? idx[p] : -1;
    float4* dst = reinterpret_cast<float4*>(dkv + (long)row * kCols) + lane % 8;
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (row >= 0) red_v4(dst + i * 8, value, -value, value, 0.5f * value);
  }
}

// One warp per (token, entry): 2 loads of 32 x 16 B = one 1 KB bf16 row.
__global__ void gather_rows(const __nv_bfloat16* kv, const int* idx, long pairs, float* sink) {
  long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  float acc = 0.f;
  for (long p = warp; p < pairs; p += (long)gridDim.x * blockDim.x / 32) {
    int row = idx[p];
    if (row < 0) continue;
    const uint4* src = reinterpret_cast<const uint4*>(kv + (long)row * kCols);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint4 v = src[i * 32 + lane];
      acc += __uint_as_float(v.x ^ v.y ^ v.z ^ v.w);
    }
  }
  if (acc == 1234.5f) *sink = acc;  // keeps the loads alive
}

template <typename Launch>
float median_ms(Launch launch, int reps = 21) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main() {
  std::mt19937 rng(0);
  std::vector<int> idx((long)kTokens * kEntries);
  std::vector<int> perm(kRows);
  long valid = 0;
  for (int t = 0; t < kTokens; ++t) {
    int* row = idx.data() + (long)t * kEntries;
    for (int w = 0; w < kWindow; ++w) row[w] = t - (kWindow - 1) + w >= 0 ? t - (kWindow - 1) + w : -1;
    for (int r = 0; r < kRows; ++r) perm[r] = r;
    for (int j = 0; j < kPicks; ++j) {  // partial Fisher-Yates: 512 distinct random rows
      int k = j + rng() % (kRows - j);
      std::swap(perm[j], perm[k]);
      row[kWindow + j] = perm[j];
    }
    for (int j = 0; j < kEntries; ++j) valid += row[j] >= 0;
  }
  long pairs = idx.size();
  int* d_idx;
  float *d_dkv, *d_sink;
  __nv_bfloat16* d_kv;
  CHECK(cudaMalloc(&d_idx, pairs * sizeof(int)));
  CHECK(cudaMalloc(&d_dkv, (long)kRows * kCols * sizeof(float)));
  CHECK(cudaMalloc(&d_kv, (long)kRows * kCols * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&d_sink, sizeof(float)));
  CHECK(cudaMemcpy(d_idx, idx.data(), pairs * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(d_dkv, 0, (long)kRows * kCols * sizeof(float)));
  CHECK(cudaMemset(d_kv, 0x3c, (long)kRows * kCols * sizeof(__nv_bfloat16)));

  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double red_bytes = valid * 2048.0, load_bytes = valid * 1024.0;
  std::printf("T=S=%d, %d window + %d picks, %ld valid pairs, %d SMs\n", kTokens, kWindow, kPicks,
              valid, sms);
  for (int blocks_per_sm : {4, 8, 16}) {
    int grid = sms * blocks_per_sm, threads = 256;
    float a = median_ms([&] { red_row512<<<grid, threads>>>(d_dkv, d_idx, pairs, 1e-3f); });
    float b = median_ms([&] { red_rows4<<<grid, threads>>>(d_dkv, d_idx, pairs, 1e-3f); });
    float c = median_ms([&] { gather_rows<<<grid, threads>>>(d_kv, d_idx, pairs, d_sink); });
    CHECK(cudaGetLastError());
    std::printf("%2d blocks/SM: row512 %.1f us (%.2f TB/s of RED)  rows4 %.1f us (%.2f TB/s)  "
                "gather %.1f us (%.2f TB/s)\n",
                blocks_per_sm, a * 1e3, red_bytes / a / 1e9, b * 1e3, red_bytes / b / 1e9,
                c * 1e3, load_bytes / c / 1e9);
  }
  // Sanity: row 0 is in the window of tokens 0..127 and in some picks; its first column got
  // value * (number of adds) per launch. Report it so a silent no-op would show.
  float first;
  CHECK(cudaMemcpy(&first, d_dkv, sizeof(float), cudaMemcpyDeviceToHost));
  std::printf("dkv[0][0] after all launches = %g (nonzero expected)\n", first);
  return 0;
}

// Microbenchmark: the forward's data movement alone, without any MMA. Each CTA does what the
// pingpong forward's producer does for one (token, part, head block): it reads its list's
// indices and gathers 64-row blocks of bf16 kv rows into a 2-stage shared-memory ring with
// 16-byte cp.async, then stores its 64 x 512 output tile (bf16). One CTA per SM (the kernel's
// 200+ KB of shared memory), grid order (token, part, head block) as the kernel's. The time of
// a case is a floor for any forward that keeps that grid (its gathers and stores), however it
// computes; "hb 1" is the same work with one CTA per token covering all heads (each row
// gathered once per token), the grid issue 26 asks about.
// "pair, TMA multicast": the two head-block CTAs of a (token, part) form a cluster; each loads
// half of every block's rows with one TMA row box per <= 256 columns, multicast into both CTAs'
// rings (so L2 serves each row once per token), a cluster barrier per block frees a stage; ring
// depth 2 (as the kernel) or 3. "TMA, no multicast" is the same kernel with each CTA loading all
// its rows itself (the cost of the one-row TMA boxes alone).
// "+ combine kernel": for a split (parts > 1) the same gathers and stores, then a kernel that
// merges the parts as the split forward's combine does, timed as one call: the movement floor
// of a split forward with a separate combine.
// Lists: as examples/benchmark.py --long (the 128 positions ending at the token + distinct
// uniform rows of [0, S)), tokens = the last T positions of S. Build and run:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a dev/fwd_gather_floor.cu \
//     -o build/fgf && build/fgf [decode]
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "mbarrier.cuh"
#include "median_ms.cuh"

constexpr int WINDOW = 128, BLOCK = 64, D_V = 512;
constexpr int SMEM_BYTES = 200 * 1024;  // forces one CTA per SM, as the kernel's 208-224 KB
constexpr int TMA_SMEM_BYTES = 3 * BLOCK * 1152;  // up to three stages of Dqk 576 rows (216 KB)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem)), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// The CTA's part of its token's list: grid x = (t * P + p) * HB + hb, entries [begin, end) of
// token t's list (every head block of the token gathers the same rows).
struct Part {
  const int* list;
  int begin, end, n_blocks;
};

__device__ __forceinline__ Part cta_part(const int* idx, int K, int P, int HB) {
  const int cta = blockIdx.x;
  const int p = (cta / HB) % P, t = cta / (HB * P);
  const int per = (K + P - 1) / P;
  const int begin = p * per, end = min(K, begin + per);
  return {idx + (size_t)t * K, begin, end, (end - begin + BLOCK - 1) / BLOCK};
}

// the part's output tile: 64 heads x 512 bf16 (64 KB), row-major, 16-byte stores; acc keeps
// the gathers' loads alive
__device__ __forceinline__ void store_tile(uint4 acc, uint4* out, uint4* sink) {
  uint4* o = out + (size_t)blockIdx.x * (64 * D_V * 2 / 16);
  for (int i = threadIdx.x; i < 64 * D_V * 2 / 16; i += blockDim.x)
    o[i] = make_uint4(acc.x ^ i, 0, 0, 0);
  if (acc.x == 0x12345678u) sink[0] = acc;
}

// chunks = Dqk * 2 / 16 per row. GATHER = false: the launch, index loads and stores alone.
template <bool GATHER>
__global__ void __launch_bounds__(256) fwd_moves(const uint4* kv, const int* idx, int K, int P,
                                                 int HB, int chunks, uint4* out, uint4* sink) {
  extern __shared__ uint4 ring[];  // 2 stages x BLOCK rows x chunks
  const auto [list, begin, end, n_blocks] = cta_part(idx, K, P, HB);
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
  store_tile(acc, out, sink);
}

// The split's combine alone, as fwd_combine does it: the P parts of each (token, head) row (bf16,
// in the order fwd_moves wrote its tiles, 64 heads per tile) merged by their lse, 64 threads per
// row, one 16-byte chunk each; lse_parts filled with zeros (every part valid). Launched right
// after fwd_moves, the pair is the movement floor of a split forward with a combine kernel.
__global__ void __launch_bounds__(256) combine_parts(const uint4* parts, const float* lse_parts,
                                                     int P, int HB, uint4* out) {
  const int row = blockIdx.x * 4 + threadIdx.x / 64, chunk = threadIdx.x % 64;  // row = t*H+h
  const int H = 64 * HB, t = row / H, h = row % H;
  float m = -INFINITY;
  for (int p = 0; p < P; ++p) m = fmaxf(m, lse_parts[(t * P + p) * H + h]);
  float l = 0.f, acc[8] = {};
#pragma unroll 4
  for (int p = 0; p < P; ++p) {
    const float w = __expf(lse_parts[(t * P + p) * H + h] - m);
    l += w;
    const size_t tile = (size_t)(t * P + p) * HB + h / 64;
    const uint4 x = parts[(tile * 64 + h % 64) * 64 + chunk];
    const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&x);
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(v[j]);
      acc[2 * j] += w * f.x;
      acc[2 * j + 1] += w * f.y;
    }
  }
  uint4 o;
  __nv_bfloat162* ov = reinterpret_cast<__nv_bfloat162*>(&o);
  for (int j = 0; j < 4; ++j) ov[j] = __floats2bfloat162_rn(acc[2 * j] / l, acc[2 * j + 1] / l);
  out[(size_t)row * 64 + chunk] = o;
}

// Row boxes per kv row: the fewest boxes of at most 256 columns (a TMA box's limit).
__host__ __device__ constexpr int row_boxes(int Dqk) { return (Dqk + 255) / 256; }

// grid x as fwd_moves; cluster (2, 1, 1) when MULTICAST (the token's two head blocks), rank =
// the CTA's rank in its pair. Each row is row_boxes(Dqk) boxes of Dqk / row_boxes(Dqk) columns.
template <bool MULTICAST>
__global__ void __launch_bounds__(256) fwd_moves_tma(const __grid_constant__ CUtensorMap map,
                                                     const int* idx, int K, int P, int HB,
                                                     int Dqk, int stages, uint4* out,
                                                     uint4* sink) {
  extern __shared__ __align__(1024) unsigned char ring_b[];  // `stages` x BLOCK rows
  __shared__ __align__(8) uint64_t full[3];
  const Part part = cta_part(idx, K, P, HB);  // locals, not a binding: the lambda captures them
  const int* list = part.list;
  const int begin = part.begin, end = part.end, n_blocks = part.n_blocks;
  unsigned rank = 0;
  if (MULTICAST) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const int boxes = row_boxes(Dqk), box_cols = Dqk / boxes, row_bytes = Dqk * 2;
  const int stage_bytes = BLOCK * row_bytes;
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) mbar_init(smem_u32(&full[i]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;"
               ::: "memory");
  // block b: the rows [b * BLOCK, ...) of the part; with MULTICAST this CTA loads half of them
  auto issue = [&](int b) {
    const int valid = min(BLOCK, end - begin - b * BLOCK);
    const int s = b % stages;
    if (threadIdx.x == 0) mbar_expect_tx(smem_u32(&full[s]), valid * row_bytes);
    const int lo = MULTICAST ? int(rank) * (BLOCK / 2) : 0;
    const int hi = MULTICAST ? lo + BLOCK / 2 : BLOCK;
    for (int r = lo + int(threadIdx.x); r < min(hi, valid); r += blockDim.x) {
      const int row = __ldg(list + begin + b * BLOCK + r);
      for (int j = 0; j < boxes; ++j) {
        const unsigned dst =
            smem_u32(ring_b + s * stage_bytes + r * row_bytes + j * box_cols * 2);
        if (MULTICAST)
          asm volatile(
              "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
              ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"
              ::"r"(dst), "l"(&map), "r"(j * box_cols), "r"(row), "r"(smem_u32(&full[s])),
              "h"((unsigned short)3) : "memory");
        else
          asm volatile(
              "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
              " [%0], [%1, {%2, %3}], [%4];"
              ::"r"(dst), "l"(&map), "r"(j * box_cols), "r"(row), "r"(smem_u32(&full[s]))
              : "memory");
      }
    }
  };
  for (int b = 0; b < min(stages - 1, n_blocks); ++b) issue(b);
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int b = 0; b < n_blocks; ++b) {
    if (b >= 1)  // both CTAs have read block b - 1: its stage takes block b + stages - 1
      asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (b + stages - 1 < n_blocks) issue(b + stages - 1);
    mbar_wait(smem_u32(&full[b % stages]), (b / stages) & 1);
    uint4 x = reinterpret_cast<const uint4*>(ring_b + (b % stages) * stage_bytes)[threadIdx.x];
    acc.x ^= x.x;
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  }
  if (n_blocks > 0) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  store_tile(acc, out, sink);
}

// kv [S, Dqk] bf16 as a 2-D tensor map with one-row boxes of Dqk / row_boxes(Dqk) columns
static CUtensorMap row_map(const void* kv, int S, int Dqk) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                              const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                              const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = nullptr;
  if (!encode) {
    cudaDriverEntryPointQueryResult q;
    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode),
                                     12000, cudaEnableDefault, &q);
  }
  CUtensorMap m;
  const cuuint64_t dims[2] = {cuuint64_t(Dqk), cuuint64_t(S)};
  const cuuint64_t strides[1] = {cuuint64_t(Dqk) * 2};
  const cuuint32_t box[2] = {cuuint32_t(Dqk / row_boxes(Dqk)), 1};
  const cuuint32_t elem[2] = {1, 1};
  CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(kv), dims,
                      strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) printf("cuTensorMapEncodeTiled failed: %d\n", int(r));
  return m;
}

template <bool MULTICAST>
static void launch_tma(const CUtensorMap& map, int ctas, const int* idx, int K, int P, int HB,
                       int Dqk, int stages, uint4* out, uint4* sink) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = TMA_SMEM_BYTES;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = MULTICAST ? 2 : 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, fwd_moves_tma<MULTICAST>, map, idx, K, P, HB, Dqk, stages, out,
                     sink);
}

// Per call of `calls` back-to-back launches between two events (median of 5): each launch
// overlaps the previous one's tail, as calls inside one jitted program do; median_ms times one
// launch alone, with its launch latency.
template <class Launch>
float per_call_ms(Launch launch, int calls = 20) {
  return median_ms([&] { for (int i = 0; i < calls; ++i) launch(); }, 5) / calls;
}

struct Case {
  const char* name;
  int T, S, K, Dqk, P, HB;
};

int main(int argc, char** argv) {  // `fgf decode`: the decode cases only
  setvbuf(stdout, nullptr, _IONBF, 0);  // each line out as it comes (a hang is killed by timeout)
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
  for (auto f : {fwd_moves_tma<true>, fwd_moves_tma<false>})
    cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, TMA_SMEM_BYTES);
  int dev_l2 = 0;
  cudaDeviceGetAttribute(&dev_l2, cudaDevAttrL2CacheSize, 0);
  printf("L2 %d MB; one CTA per SM (%d KB shared), 256 threads\n", dev_l2 >> 20, SMEM_BYTES >> 10);
  const bool decode_only = argc > 1 && std::string(argv[1]) == "decode";
  for (const Case& c : cases) {
    if (decode_only && c.T >= 4096) continue;
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
    if (c.T < 4096)
      printf("%*s  back to back: gather %7.1f us | no gather %7.1f us\n", 30, "",
             per_call_ms([&] { run(true); }) * 1e3, per_call_ms([&] { run(false); }) * 1e3);
    if (c.P > 1) {  // a split: the gathers and stores, then the combine kernel, as one call
      const int rows = c.T * 64 * c.HB;
      float* lse_parts;
      uint4* o;
      cudaMalloc(&lse_parts, (size_t)rows * c.P * 4);
      cudaMemset(lse_parts, 0, (size_t)rows * c.P * 4);
      cudaMalloc(&o, (size_t)rows * D_V * 2);
      auto combine = [&] { combine_parts<<<rows / 4, 256>>>(out, lse_parts, c.P, c.HB, o); };
      const float tc = median_ms(combine, reps);
      const float tgc = median_ms([&] { run(true); combine(); }, reps);
      printf("%*s  + combine kernel (%d parts, %.1f MB): combine alone %6.1f us | gathers, stores "
             "and combine %7.1f us | back to back: combine %6.1f us, all %7.1f us | %s\n", 30,
             "", c.P, rows * c.P * 1024 / 1e6, tc * 1e3, tgc * 1e3, per_call_ms(combine) * 1e3,
             per_call_ms([&] { run(true); combine(); }) * 1e3,
             cudaGetErrorString(cudaGetLastError()));
      cudaFree(lse_parts);
      cudaFree(o);
    }
    if (c.HB == 2) {  // the same grid through TMA row boxes: each CTA alone, then pairs
      const CUtensorMap map = row_map(kv, c.S, c.Dqk);
      for (int stages : {2, 3}) {  // the ring's depth: 2 as the kernel, 3 shows latency vs rate
        for (int i = 0; i < 3; ++i)
          launch_tma<true>(map, ctas, idx, c.K, c.P, c.HB, c.Dqk, stages, out, sink);
        const float tm = median_ms(
            [&] { launch_tma<true>(map, ctas, idx, c.K, c.P, c.HB, c.Dqk, stages, out, sink); },
            reps);
        const float ts = median_ms(
            [&] { launch_tma<false>(map, ctas, idx, c.K, c.P, c.HB, c.Dqk, stages, out, sink); },
            reps);
        printf("%*s  %d stages: TMA, no multicast %9.1f us | pair, TMA multicast %9.1f us (%.2f "
               "TB/s of rows delivered, half from L2) | %s\n", 30, "", stages, ts * 1e3,
               tm * 1e3, gb / tm, cudaGetErrorString(cudaGetLastError()));
      }
    }
    cudaFree(idx);
    cudaFree(kv);
    cudaFree(out);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}

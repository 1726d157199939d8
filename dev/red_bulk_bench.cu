// Microbenchmark: the backward's dKV scatter as per-thread red.global.add.v4.f32 (today's
// kernel: each warp instruction 4 rows x 128 B; or 16 rows x 32 B, the shape a wgmma fragment
// gives without the shared-memory round trip) against bulk reductions from shared memory
// (cp.reduce.async.bulk.global.shared::cta.add.f32, one 256-byte op per row and 64-column
// chunk, issued by one thread, completed by the copy engine), on the H = 128 workload's rows:
// T tokens, each a list of a 128-row window ending at its position plus random rows of [0, S),
// each token's list added `dup` times back to back (the two 64-head CTAs of a token), one CTA
// per (token, copy) walking 64-entry blocks and 64-column chunks, D fp32 columns per row.
// Question: does the bulk form reach a higher reduction rate, in L2 (S 4K) and past it
// (S 64K: a 128 MB accumulator)? With arguments (T K D S ...) it also gives the RED stream's
// time alone at a benchmark shape: the floor of a backward that adds each entry `dup` times.
//   nvcc -O3 -std=c++17 -arch=sm_90a dev/red_bulk_bench.cu -o build/rbb && build/rbb [T K D S]...
// `build/rbb floor [--orders given,sorted,waves] T K D S DUP ...` times the backward's gathers
// and REDs alone and together, with the lists in each order.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <cuda_runtime.h>

#include "median_ms.cuh"

__device__ __forceinline__ void red_v4(float* p, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w) : "memory");
}

// Today's form: 128 threads = 4 warps; per 64-row block and 64-column chunk each warp covers 16
// rows, one instruction = 4 rows x 128 B (8 lanes per row).
template <int D>
__global__ void scatter_red(float* dkv, const int* idx, int K, int dup) {
  const int* list = idx + (size_t)(blockIdx.x / dup) * K;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float4 v = make_float4(1.f, 1.f, 1.f, 1.f);
  for (int blk = 0; blk < K; blk += 64) {
#pragma unroll 1
    for (int c = 0; c < D; c += 64) {
#pragma unroll
      for (int rr = 0; rr < 16; rr += 4) {
        int r = blk + warp * 16 + rr + lane / 8;
        int row = r < K ? list[r] : -1;
        if (row >= 0)
          for (int half = 0; half < 2; ++half)
            red_v4(dkv + (size_t)row * D + c + half * 32 + (lane % 8) * 4, v);
      }
    }
  }
}

// The register-fragment form: the v4 RED as a wgmma accumulator fragment gives it after one
// lane-pair shuffle (not timed here): per 16-row slab and 8-column group, lane l holds 4 floats
// of row l / 4 + 8 (l % 2) at columns 4 ((l % 4) / 2) of the group, so one instruction = 16 rows
// x 32 B, with no shared-memory round trip before it.
template <int D>
__global__ void scatter_red_frag(float* dkv, const int* idx, int K, int dup) {
  const int* list = idx + (size_t)(blockIdx.x / dup) * K;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float4 v = make_float4(1.f, 1.f, 1.f, 1.f);
  for (int blk = 0; blk < K; blk += 64) {
    int r = blk + warp * 16 + lane / 4 + 8 * (lane % 2);
    int row = r < K ? list[r] : -1;
#pragma unroll 1
    for (int c = 0; c < D; c += 64) {
      if (row >= 0)
#pragma unroll
        for (int j = 0; j < 8; ++j)
          red_v4(dkv + (size_t)row * D + c + 8 * j + 4 * ((lane % 4) / 2), v);
    }
  }
}

// The bulk form: each chunk (64 rows x 64 fp32 = 16 KB) written to one of two shared-memory
// buffers, then 64 threads each issue one 256-byte bulk reduction of a row; a buffer is
// rewritten only after its reductions have read it (wait_group.read).
template <int D>
__global__ void scatter_bulk(float* dkv, const int* idx, int K, int dup) {
  __shared__ __align__(128) float buf[2][64 * 64];
  const int* list = idx + (size_t)(blockIdx.x / dup) * K;
  int t = threadIdx.x;
  int n = 0;
  for (int blk = 0; blk < K; blk += 64) {
    int r = blk + t % 64;
    int row = r < K ? list[r] : -1;
#pragma unroll 1
    for (int c = 0; c < D; c += 64, ++n) {
      float* b = buf[n & 1];
      if (t < 64) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // per thread
      __syncthreads();
      for (int i = t; i < 64 * 16; i += blockDim.x)
        reinterpret_cast<float4*>(b)[i] = make_float4(1.f, 1.f, 1.f, 1.f);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
      if (t < 64 && row >= 0) {
        unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(b + t * 64));
        float* dst = dkv + (size_t)row * D + c;
        asm volatile(
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], 256;"
            ::"l"(dst), "r"(src) : "memory");
      }
      if (t < 64) asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (t < 64) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// The backward's data movement alone, no MMA: each CTA (token, copy) gathers its list's bf16 kv
// rows (D * 2 bytes each) and adds one fp32 dkv row (today's 4 x 128 B RED form) per entry, and
// reads its 64 heads' Q and dO (D + 512 columns, bf16) and writes their dQ (D, bf16) once.
// GATHER / RED select the streams; 4 warps per CTA, at full occupancy (up to 16 CTAs per SM,
// more in flight than the backward's one CTA per SM) and at 2 CTAs per SM (8 warps issuing, as
// the backward's two consumer warpgroups). Past L2 more REDs in flight can be slower.
template <int D, bool GATHER, bool RED>
__global__ void __launch_bounds__(128) move_floor(const uint4* kv, float* dkv, const int* idx,
                                                  int K, int dup, const uint4* qdo, uint4* dq,
                                                  uint4* sink) {
  constexpr int CH = D * 2 / 16;  // 16-byte chunks per bf16 row
  const int t = blockIdx.x / dup;
  const int* list = idx + (size_t)t * K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint4 acc = make_uint4(0, 0, 0, 0);
  const uint4* q = qdo + (size_t)t * 64 * (CH + 64);  // the token's Q and dO, 64 heads
  for (int i = threadIdx.x; i < 64 * (CH + 64); i += 128) acc.x ^= __ldcg(q + i).x;
  const float4 v = make_float4(1.f, 1.f, 1.f, 1.f);
  for (int blk = 0; blk < K; blk += 64) {
    if (GATHER) {  // the warp's 16 rows, lanes over their chunks
#pragma unroll 4
      for (int i = lane; i < 16 * CH; i += 32) {
        const int r = blk + warp * 16 + i / CH;
        const int row = r < K ? list[r] : -1;
        if (row >= 0) acc.y ^= __ldcg(kv + (size_t)row * CH + i % CH).y;
      }
    }
    if (RED) {
#pragma unroll 1
      for (int c = 0; c < D; c += 64) {
#pragma unroll
        for (int rr = 0; rr < 16; rr += 4) {
          const int r = blk + warp * 16 + rr + lane / 8;
          const int row = r < K ? list[r] : -1;
          if (row >= 0)
            for (int half = 0; half < 2; ++half)
              red_v4(dkv + (size_t)row * D + c + half * 32 + (lane % 8) * 4, v);
        }
      }
    }
  }
  uint4* o = dq + (size_t)blockIdx.x * 64 * CH;
  for (int i = threadIdx.x; i < 64 * CH; i += 128) o[i] = make_uint4(acc.x ^ i, acc.y, 0, 0);
  if (acc.x == 0x12345678u && acc.y == 0x9abcdefu) sink[0] = acc;
}

// The benchmark's lists on the GPU: T tokens at the end of S, each the 128-row window ending at
// it, then random rows of [0, S) (repeats allowed), K entries. Order: as made ("given"), each list
// ascending ("sorted"), or ascending with every other wave of `wave` tokens descending ("waves":
// what the library's row-order kernel does past the L2, where a wave is the tokens whose CTAs
// are resident at once).
enum class Order { given, sorted, waves };
static const char* order_name(Order o) {
  return o == Order::given ? "given" : o == Order::sorted ? "sorted" : "waves";
}
static int* device_lists(int T, int K, int S, Order order = Order::given, int wave = 1) {
  const int window = 128;
  std::vector<int> h((size_t)T * K);
  srand(1);
  for (int t = 0; t < T; ++t) {
    int pos = S - T + t;
    int* list = h.data() + (size_t)t * K;
    for (int j = 0; j < K; ++j) list[j] = j < window ? pos - window + 1 + j : rand() % S;
    if (order == Order::sorted || order == Order::waves) std::sort(list, list + K);
    if (order == Order::waves && (t / wave) % 2 == 1) std::reverse(list, list + K);
  }
  int* idx;
  cudaMalloc(&idx, h.size() * 4);
  cudaMemcpy(idx, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  return idx;
}

// The movement floor at a benchmark shape: T tokens of K entries at the end of S, dup CTAs per
// token (2 at H = 128), the lists in `order`. Three residencies: full occupancy (up to 16 CTAs
// per SM), 2 CTAs per SM (8 warps issuing, as the backward's two consumer warpgroups) and 1 CTA
// per SM (the backward's residency, so its waves of SMs / dup tokens); with order "waves" each
// residency gets lists whose waves are its own resident tokens.
template <int D>
void measure_floor(int T, int K, int S, int dup, Order order) {
  constexpr int CH = D * 2 / 16;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* dkv;
  uint4 *kv, *qdo, *dq, *sink;
  cudaMalloc(&dkv, (size_t)S * D * 4);
  cudaMemset(dkv, 0, (size_t)S * D * 4);
  cudaMalloc(&kv, (size_t)S * CH * 16);
  cudaMemset(kv, 0x3f, (size_t)S * CH * 16);
  cudaMalloc(&qdo, (size_t)T * 64 * (CH + 64) * 16);
  cudaMemset(qdo, 0x3f, (size_t)T * 64 * (CH + 64) * 16);
  cudaMalloc(&dq, (size_t)T * dup * 64 * CH * 16);
  cudaMalloc(&sink, 16);
  const int ctas = T * dup;
  const double g_gb = (double)ctas * K * D * 2 / 1e9, r_gb = (double)ctas * K * D * 4 / 1e9;
  for (int smem : {0, 100 * 1024, 200 * 1024}) {
    auto set = [&](auto kernel) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    };
    set(move_floor<D, true, true>);
    set(move_floor<D, true, false>);
    set(move_floor<D, false, true>);
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, move_floor<D, true, true>, 128, smem);
    const int wave = std::max(1, sms * per_sm / dup);
    int* idx = device_lists(T, K, S, order, wave);
    auto args = [&](auto kernel) {
      kernel<<<ctas, 128, smem>>>(kv, dkv, idx, K, dup, qdo, dq, sink);
    };
    for (int i = 0; i < 2; ++i) args(move_floor<D, true, true>);
    const float tg = median_ms([&] { args(move_floor<D, true, false>); }, 5);
    const float tr = median_ms([&] { args(move_floor<D, false, true>); }, 5);
    const float tb = median_ms([&] { args(move_floor<D, true, true>); }, 5);
    printf("floor T %d K %d D %d S %6d, %d CTAs per token, %2d CTAs per SM, lists %-6s: gathers "
           "%.1f GB %.3f ms | REDs %.1f GB %.3f ms | both %.3f ms (%.2f TB/s) | %s\n", T, K, D, S,
           dup, per_sm, order_name(order), g_gb, tg, r_gb, tr, tb, (g_gb + r_gb) / tb,
           cudaGetErrorString(cudaGetLastError()));
    cudaFree(idx);
  }
  for (void* p : {(void*)dkv, (void*)kv, (void*)qdo, (void*)dq, (void*)sink}) cudaFree(p);
}

template <int D>
void measure(int T, int K, int S, bool check) {
  int* idx = device_lists(T, K, S);
  float* dkv;
  cudaMalloc(&dkv, (size_t)S * D * 4);
  cudaMemset(dkv, 0, (size_t)S * D * 4);
  for (int dup : {1, 2}) {
    double gb = (double)T * dup * K * D * 4 / 1e9;
    float tr = median_ms([&] { scatter_red<D><<<T * dup, 128>>>(dkv, idx, K, dup); }, 5);
    float tf = median_ms([&] { scatter_red_frag<D><<<T * dup, 128>>>(dkv, idx, K, dup); }, 5);
    float tb = median_ms([&] { scatter_bulk<D><<<T * dup, 128>>>(dkv, idx, K, dup); }, 5);
    printf("T %d K %d D %d S %6d dup %d (%.2f GB): red.v4 4x128 B %.3f ms (%.0f GB/s) | "
           "red.v4 16x32 B %.3f ms (%.0f GB/s) | bulk 256 B %.3f ms (%.0f GB/s)\n", T, K, D, S,
           dup, gb, tr, gb / tr * 1e3, tf, gb / tf * 1e3, tb, gb / tb * 1e3);
  }
  if (check) {  // the two forms add the same values: one run each from zero
    std::vector<float> a((size_t)S * D), b((size_t)S * D);
    cudaMemset(dkv, 0, (size_t)S * D * 4);
    scatter_red<D><<<T, 128>>>(dkv, idx, K, 1);
    cudaMemcpy(a.data(), dkv, a.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemset(dkv, 0, (size_t)S * D * 4);
    scatter_bulk<D><<<T, 128>>>(dkv, idx, K, 1);
    cudaMemcpy(b.data(), dkv, b.size() * 4, cudaMemcpyDeviceToHost);
    size_t bad = 0;
    for (size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i];
    cudaMemset(dkv, 0, (size_t)S * D * 4);
    scatter_red_frag<D><<<T, 128>>>(dkv, idx, K, 1);
    cudaMemcpy(b.data(), dkv, b.size() * 4, cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i];
    printf("  the three forms agree on %zu of %zu values; %s\n", 2 * a.size() - bad,
           2 * a.size(), cudaGetErrorString(cudaGetLastError()));
  }
  cudaFree(idx);
  cudaFree(dkv);
}

// Arguments: T K D S (D 512 or 576), several groups of four; default: the 1024-token check
// at S 4K and 64K.
// `floor [--orders LIST] T K D S DUP ...`: the movement floor (groups of five).
int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  if (argc > 1 && std::string(argv[1]) == "floor") {
    std::vector<Order> orders = {Order::given};
    int a = 2;
    if (argc > 3 && std::string(argv[2]) == "--orders") {  // e.g. --orders given,sorted,waves
      orders.clear();
      const std::string list = std::string(",") + argv[3] + ",";
      for (Order o : {Order::given, Order::sorted, Order::waves})
        if (list.find(std::string(",") + order_name(o) + ",") != std::string::npos)
          orders.push_back(o);
      a = 4;
    }
    for (; a + 4 < argc; a += 5) {
      int T = atoi(argv[a]), K = atoi(argv[a + 1]), D = atoi(argv[a + 2]), S = atoi(argv[a + 3]);
      int dup = atoi(argv[a + 4]);
      for (Order o : orders) {
        if (D == 576) measure_floor<576>(T, K, S, dup, o);
        else measure_floor<512>(T, K, S, dup, o);
      }
    }
    return 0;
  }
  if (argc < 5) {
    measure<512>(1024, 1152, 4096, true);
    measure<512>(1024, 1152, 65536, true);
    return 0;
  }
  for (int a = 1; a + 3 < argc; a += 4) {
    int T = atoi(argv[a]), K = atoi(argv[a + 1]), D = atoi(argv[a + 2]), S = atoi(argv[a + 3]);
    if (D == 576) measure<576>(T, K, S, false);
    else measure<512>(T, K, S, false);
  }
  return 0;
}

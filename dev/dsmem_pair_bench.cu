// The exchange of the H = 128 column-split backward plan (docs/kernel_log.md, "H = 128 as a
// column-split CTA pair"), alone: clusters of two CTAs (one SM each, ~200 KB of shared memory,
// 256 threads), each sending BYTES per "block" into its partner's shared memory and reading
// what the partner sent, for ITERS blocks. Prints the time per block and the DSMEM bandwidth
// per SM, for
//   push:  st.async.shared::cluster with the receiver's mbarrier completing on the bytes, a
//          remote arrive on the sender's "empty" barrier once the receiver has read a buffer
//          (two receive buffers, so a block's send overlaps the previous block's reading);
//   sync:  plain stores through the partner's mapped address and one cluster barrier per
//          block (barrier.cluster.arrive.release / wait.acquire), single buffer.
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a dev/dsmem_pair_bench.cu -o build/dsmem && build/dsmem
#include <cooperative_groups.h>
#include <cstdint>
#include <cstdio>

#include "mbarrier.cuh"
#include "median_ms.cuh"

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kBytes = 48 * 1024;  // per block and direction: 2 x 16 KB fp32 partials + P, dS
constexpr int kVecs = kBytes / 16;
constexpr int kBufs = 2;

__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}

__device__ __forceinline__ void mbar_arrive_remote(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote_bar)
               : "memory");
}

__device__ __forceinline__ void st_async_v4(uint32_t remote, uint4 v, uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(remote), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(remote_bar)
      : "memory");
}

struct Smem {
  uint4 send[kVecs];
  uint4 recv[kBufs][kVecs];
  uint64_t full[kBufs];   // my receive buffer b holds the partner's data
  uint64_t empty[kBufs];  // the partner has read my data out of its buffer b
};

__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1)
    push_kernel(int iters, float* sink) {
  extern __shared__ __align__(128) unsigned char raw[];
  Smem& s = *reinterpret_cast<Smem*>(raw);
  cg::cluster_group cluster = cg::this_cluster();
  const uint32_t partner = cluster.block_rank() ^ 1;
  const int tid = threadIdx.x;
  for (int i = tid; i < kVecs; i += kThreads) s.send[i] = make_uint4(i, tid, 1, 2);
  if (tid == 0) {
    for (int b = 0; b < kBufs; ++b) {
      mbar_init(smem_u32(&s.full[b]), 1);
      mbar_init(smem_u32(&s.empty[b]), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster.sync();
  float acc = 0.f;
  for (int it = 0; it < iters; ++it) {
    const int b = it % kBufs;
    const uint32_t parity = (it / kBufs) & 1;
    if (tid == 0) mbar_expect_tx(smem_u32(&s.full[b]), kBytes);
    // the partner has read what I wrote into its buffer b two blocks ago
    if (it >= kBufs) mbar_wait(smem_u32(&s.empty[b]), parity ^ 1);
    const uint32_t remote_buf = map_rank(smem_u32(&s.recv[b][0]), partner);
    const uint32_t remote_full = map_rank(smem_u32(&s.full[b]), partner);
    for (int i = tid; i < kVecs; i += kThreads)
      st_async_v4(remote_buf + 16 * i, s.send[i], remote_full);
    // what the partner sent me
    mbar_wait(smem_u32(&s.full[b]), parity);
    for (int i = tid; i < kVecs; i += kThreads) acc += __int_as_float(s.recv[b][i].x);
    __syncthreads();  // every thread has read buffer b
    if (tid == 0) mbar_arrive_remote(map_rank(smem_u32(&s.empty[b]), partner));
  }
  cluster.sync();  // no CTA exits while its partner may still write into it
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1)
    sync_kernel(int iters, float* sink) {
  extern __shared__ __align__(128) unsigned char raw[];
  Smem& s = *reinterpret_cast<Smem*>(raw);
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x;
  for (int i = tid; i < kVecs; i += kThreads) s.send[i] = make_uint4(i, tid, 1, 2);
  uint4* remote = cluster.map_shared_rank(&s.recv[0][0], cluster.block_rank() ^ 1);
  cluster.sync();
  float acc = 0.f;
  for (int it = 0; it < iters; ++it) {
    for (int i = tid; i < kVecs; i += kThreads) remote[i] = s.send[i];
    cluster.sync();  // written and visible
    for (int i = tid; i < kVecs; i += kThreads) acc += __int_as_float(s.recv[0][i].x);
    cluster.sync();  // read: the partner may overwrite
  }
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int ctas = sms & ~1;
  const int iters = 2000;
  const size_t smem = sizeof(Smem);
  float* sink;
  cudaMalloc(&sink, ctas * sizeof(float));
  cudaFuncSetAttribute(push_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  cudaFuncSetAttribute(sync_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  struct Case {
    const char* name;
    void (*kernel)(int, float*);
  } cases[] = {{"push (st.async + mbarriers, 2 buffers)", push_kernel},
               {"sync (stores + cluster barrier, 1 buffer)", sync_kernel}};
  printf("%d CTAs in clusters of 2, %zu B of shared memory each, %d blocks of %d B each way\n",
         ctas, smem, iters, kBytes);
  for (const Case& c : cases) {
    float ms = median_ms([&] { c.kernel<<<ctas, kThreads, smem>>>(iters, sink); }, 5);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      printf("%s: %s\n", c.name, cudaGetErrorString(err));
      return 1;
    }
    const double per_block_us = ms * 1e3 / iters;
    const double gbs_per_sm = kBytes / (per_block_us * 1e-6) / 1e9;
    printf("%-44s %.3f us per block, %.0f GB/s per SM out (%.1f TB/s over %d SMs)\n", c.name,
           per_block_us, gbs_per_sm, gbs_per_sm * ctas / 1e3, ctas);
  }
  return 0;
}

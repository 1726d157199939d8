// How many thread-block clusters of each size the GPU holds at once for a kernel shaped like
// the forward's (384 threads, ~224 KB of dynamic shared memory, one CTA per SM): the question
// behind a decode split whose parts are combined inside one cluster (docs/kernel_log.md,
// seventeenth session). Prints cudaOccupancyMaxActiveClusters per cluster size and smem size.
//   nvcc -O3 -std=c++17 -arch=sm_90a dev/cluster_occupancy.cu -o build/cluster_occ && build/cluster_occ
#include <cstdio>
#include <cuda_runtime.h>

__global__ void dummy(int* p) {
  extern __shared__ int s[];
  if (p) p[threadIdx.x] = s[threadIdx.x];
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s: %d SMs, %zu B shared memory per block (opt-in)\n", prop.name,
         prop.multiProcessorCount, prop.sharedMemPerBlockOptin);
  cudaFuncSetAttribute(dummy, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       (int)prop.sharedMemPerBlockOptin);
  cudaFuncSetAttribute(dummy, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  const int smems[] = {224 * 1024, 200 * 1024, 112 * 1024, 96 * 1024};
  for (int smem : smems) {
    for (int cs = 1; cs <= 16; cs *= 2) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(cs * 64, 1, 1);
      cfg.blockDim = dim3(384, 1, 1);
      cfg.dynamicSmemBytes = smem;
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = cs;
      attr.val.clusterDim.y = 1;
      attr.val.clusterDim.z = 1;
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      int n = -1;
      cudaError_t e = cudaOccupancyMaxActiveClusters(&n, dummy, &cfg);
      printf("smem %3d KB cluster %2d: %s max active clusters %d (%d CTAs)\n", smem / 1024, cs,
             e == cudaSuccess ? "" : cudaGetErrorString(e), n, n * cs);
    }
  }
  return 0;
}

// Shared by the standalone microbenchmarks in dev/ (red_scatter_bench.cu, l2_floor_bench.cu):
// the median over `reps` runs of a kernel launch, each timed alone with CUDA events.
#pragma once
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>

template <class Launch>
float median_ms(Launch launch, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ts;
  for (int it = 0; it < reps; ++it) {
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    ts.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ts.begin(), ts.end());
  return ts[reps / 2];
}

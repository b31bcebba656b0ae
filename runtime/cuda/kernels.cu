// CUDA kernels of libft_cuda.so (see kernels.h). Plain CUDA: no LibTorch headers.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/kernels.h"

namespace ft::cuda {
namespace {

// One thread per element, grid-stride: memory-bound (28 bytes moved per element).
__global__ void adamw_kernel(float* __restrict__ p, const float* __restrict__ g,
                             float* __restrict__ m, float* __restrict__ v, int64_t n,
                             train::AdamWScalars s) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float pi = p[i], mi = m[i], vi = v[i];
    train::adamw_element(pi, g[i], mi, vi, s);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace

void adamw_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                const train::AdamWScalars& s, void* stream) {
  if (n == 0) return;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  constexpr int kThreads = 256;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 8LL * sms ? want : 8LL * sms);
  adamw_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(param, grad, exp_avg,
                                                                           exp_avg_sq, n, s);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("AdamW kernel launch failed: ") + cudaGetErrorString(e));
}

}  // namespace ft::cuda

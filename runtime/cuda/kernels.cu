// CUDA kernels of libft_cuda.so (see kernels.h). Plain CUDA: no LibTorch headers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

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

// ---- fused elementwise ops (model/fused_ops.h): fp32 arithmetic inside, rounded to the storage
// dtype where transformers' op sequence stores an intermediate tensor, as the CPU kernels do ----

__device__ inline float to_f(float v) { return v; }
__device__ inline float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_f(__half v) { return __half2float(v); }
template <typename T>
__device__ inline T from_f(float v);
template <>
__device__ inline float from_f<float>(float v) {
  return v;
}
template <>
__device__ inline __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ inline __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <typename T>
__device__ inline float round_to(float v) {
  return to_f(from_f<T>(v));
}

constexpr int kRowThreads = 256;

// Sum over the block in a fixed order (warp shuffles, then the warps' sums in order): the same
// bits on every run.
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kRowThreads / 32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  float s = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kRowThreads / 32; ++w) s += warp_sums[w];
  __shared__ float total;
  if (threadIdx.x == 0) total = s;
  __syncthreads();
  const float t = total;
  __syncthreads();  // warp_sums and total may be reused by the next call
  return t;
}

// One block per row: [sum = h + delta;] y = w * round(x * rstd).
template <typename T>
__global__ void rms_forward_kernel(const T* __restrict__ h, const T* __restrict__ delta,
                                   T* __restrict__ sum, const T* __restrict__ w, T* __restrict__ y,
                                   float* __restrict__ rstd, int64_t H, float eps) {
  const int64_t r = blockIdx.x;
  const T* x = h + r * H;
  float acc = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    float v = to_f(x[j]);
    if (delta) {
      const T s = from_f<T>(v + to_f(delta[r * H + j]));
      sum[r * H + j] = s;
      v = to_f(s);
    }
    acc += v * v;
  }
  const float rs = 1.0f / sqrtf(block_sum(acc) / static_cast<float>(H) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  const T* xs = delta ? sum + r * H : x;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x)
    y[r * H + j] = from_f<T>(to_f(w[j]) * round_to<T>(to_f(xs[j]) * rs));
}

// One block per row: dx = rstd * (dc - xhat * mean(dc * xhat)) [+ ds], dc = round(dy * w).
template <typename T>
__global__ void rms_backward_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                       const T* __restrict__ w, const float* __restrict__ rstd,
                                       const T* __restrict__ ds, T* __restrict__ dx, int64_t H) {
  const int64_t r = blockIdx.x;
  const float rs = rstd[r];
  float acc = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const float dc = round_to<T>(to_f(dy[r * H + j]) * to_f(w[j]));
    acc += dc * (to_f(x[r * H + j]) * rs);
  }
  const float k = block_sum(acc) / static_cast<float>(H);
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const float xhat = to_f(x[r * H + j]) * rs;
    const float dc = round_to<T>(to_f(dy[r * H + j]) * to_f(w[j]));
    const float g = round_to<T>(rs * (dc - xhat * k));
    dx[r * H + j] = from_f<T>(ds ? to_f(ds[r * H + j]) + g : g);
  }
}

// dw = sum over rows of dy * round(x * rstd), in two passes with a fixed order (the same bits
// every run): each block sums a band of `band` rows (64, more past 65535 bands) of 256 columns
// in row order into `partial`
// [bands, H]; then one thread per column adds the bands in order. One pass with a thread per
// column gave H / 256 blocks (8 at H 2048) walking every row: 1.9 ms of an 8192-row backward.
constexpr int64_t kDwRows = 64;

template <typename T>
__global__ void rms_backward_dw_bands(const T* __restrict__ dy, const T* __restrict__ x,
                                      const float* __restrict__ rstd, float* __restrict__ partial,
                                      int64_t rows, int64_t H, int64_t band) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= H) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * band;
  const int64_t r1 = r0 + band < rows ? r0 + band : rows;
  float acc = 0;
  for (int64_t r = r0; r < r1; ++r)
    acc += to_f(dy[r * H + j]) * round_to<T>(to_f(x[r * H + j]) * rstd[r]);
  partial[static_cast<int64_t>(blockIdx.y) * H + j] = acc;
}

template <typename T>
__global__ void rms_backward_dw_sum(const float* __restrict__ partial, T* __restrict__ dw,
                                    int64_t bands, int64_t H) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= H) return;
  float acc = 0;
  for (int64_t b = 0; b < bands; ++b) acc += partial[b * H + j];
  dw[j] = from_f<T>(acc);
}

template <typename T>
__global__ void swiglu_kernel(const T* __restrict__ g, const T* __restrict__ u,
                              const T* __restrict__ dy, T* __restrict__ y_or_dg, T* __restrict__ du,
                              int64_t n, bool backward) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float x = to_f(g[i]);
    const float one_plus = 1.0f + expf(-x);
    if (!backward) {
      y_or_dg[i] = from_f<T>(round_to<T>(x / one_plus) * to_f(u[i]));
      continue;
    }
    const float sig = 1.0f / one_plus, d = to_f(dy[i]);
    if (du) du[i] = from_f<T>(d * round_to<T>(x / one_plus));
    if (y_or_dg) {
      const float dsv = round_to<T>(d * to_f(u[i]));
      y_or_dg[i] = from_f<T>(dsv * sig * (1.0f + x * (1.0f - sig)));
    }
  }
}

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const T* __restrict__ cos,
                            const T* __restrict__ sin, T* __restrict__ out, int64_t rows,
                            int64_t heads, int64_t hd, bool backward) {
  const int64_t n = rows * heads * hd, half = hd / 2;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t j = i % hd, r = i / (heads * hd), base = i - j;
    const T* c = cos + r * hd;
    const T* s = sin + r * hd;
    const float a = round_to<T>(to_f(x[i]) * to_f(c[j]));
    float rot;
    if (!backward)
      rot =
          j < half ? -to_f(x[base + j + half]) * to_f(s[j]) : to_f(x[base + j - half]) * to_f(s[j]);
    else
      rot = j < half ? to_f(x[base + j + half]) * to_f(s[j + half])
                     : -(to_f(x[base + j - half]) * to_f(s[j - half]));
    out[i] = from_f<T>(a + round_to<T>(rot));
  }
}

// NF4 (model/nf4.h): each byte's two codes times their block's fp32 absmax, rounded once to T.
// The code table as model/nf4.cpp's nf4_code() (bitsandbytes' NF4 values).
__constant__ float kNf4Code[16] = {-1.0f,         -0.696192801f, -0.525073051f,  -0.394917488f,
                                   -0.284441382f, -0.18477343f,  -0.0910500363f, 0.0f,
                                   0.0795802996f, 0.160930201f,  0.246112302f,   0.337915242f,
                                   0.440709829f,  0.562617004f,  0.722956836f,   1.0f};

template <typename T>
__global__ void nf4_dequantize_kernel(const uint8_t* __restrict__ packed,
                                      const float* __restrict__ absmax, T* __restrict__ out,
                                      int64_t n, int64_t blocksize) {
  const int64_t pairs = (n + 1) / 2;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < pairs;
       j += stride) {
    const uint8_t b = packed[j];
    const int64_t i = 2 * j;
    out[i] = from_f<T>(kNf4Code[b >> 4] * absmax[i / blocksize]);
    if (i + 1 < n) out[i + 1] = from_f<T>(kNf4Code[b & 0x0F] * absmax[(i + 1) / blocksize]);
  }
}

int grid_for(int64_t n, int threads) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t want = (n + threads - 1) / threads;
  return static_cast<int>(want < 16LL * sms ? (want > 0 ? want : 1) : 16LL * sms);
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + " kernel launch failed: " + cudaGetErrorString(e));
}

// Calls f with a null pointer of the element type `dtype` names.
template <typename F>
void with_dtype(ElementType dtype, F&& f) {
  switch (dtype) {
    case ElementType::kFloat:
      return f(static_cast<float*>(nullptr));
    case ElementType::kBFloat16:
      return f(static_cast<__nv_bfloat16*>(nullptr));
    case ElementType::kHalf:
      return f(static_cast<__half*>(nullptr));
  }
  throw std::runtime_error("fused kernel: unsupported element type");
}

}  // namespace

void rms_norm_forward(ElementType dtype, const void* h, const void* delta, void* sum, const void* w,
                      void* y, float* rstd, int64_t rows, int64_t H, float eps, void* stream) {
  if (rows == 0) return;
  with_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_forward_kernel<T>
        <<<static_cast<unsigned>(rows), kRowThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const T*>(h), static_cast<const T*>(delta), static_cast<T*>(sum),
            static_cast<const T*>(w), static_cast<T*>(y), rstd, H, eps);
  });
  check_launch("RMSNorm forward");
}

void rms_norm_backward(ElementType dtype, const void* dy, const void* x, const void* w,
                       const float* rstd, const void* ds, void* dx, void* dw, int64_t rows,
                       int64_t H, void* stream) {
  if (rows == 0) return;
  with_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto st = static_cast<cudaStream_t>(stream);
    if (dx)
      rms_backward_dx_kernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, st>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd,
          static_cast<const T*>(ds), static_cast<T*>(dx), H);
    if (dw) {
      int64_t band = kDwRows;
      if ((rows + band - 1) / band > 65535) band = (rows + 65534) / 65535;
      const int64_t bands = (rows + band - 1) / band;
      float* partial = nullptr;  // stream-ordered: freed once the sum has run
      if (cudaMallocAsync(reinterpret_cast<void**>(&partial), bands * H * sizeof(float), st) !=
          cudaSuccess)
        throw std::runtime_error(
            "RMSNorm backward: no GPU memory for the weight gradient's "
            "partial sums");
      const unsigned cols = static_cast<unsigned>((H + 255) / 256);
      rms_backward_dw_bands<T><<<dim3(cols, static_cast<unsigned>(bands)), 256, 0, st>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), rstd, partial, rows, H, band);
      rms_backward_dw_sum<T><<<cols, 256, 0, st>>>(partial, static_cast<T*>(dw), bands, H);
      cudaFreeAsync(partial, st);
    }
  });
  check_launch("RMSNorm backward");
}

void swiglu(ElementType dtype, const void* gate, const void* up, const void* dy, void* y_or_dgate,
            void* dup, int64_t n, bool backward, void* stream) {
  if (n == 0) return;
  with_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_kernel<T><<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(dy),
        static_cast<T*>(y_or_dgate), static_cast<T*>(dup), n, backward);
  });
  check_launch("SwiGLU");
}

void rope(ElementType dtype, const void* x, const void* cos, const void* sin, void* out,
          int64_t rows, int64_t heads, int64_t head_dim, bool backward, void* stream) {
  const int64_t n = rows * heads * head_dim;
  if (n == 0) return;
  with_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_kernel<T><<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
        static_cast<T*>(out), rows, heads, head_dim, backward);
  });
  check_launch("rotary embedding");
}

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

void nf4_dequantize(ElementType dtype, const uint8_t* packed, const float* absmax, void* out,
                    int64_t n, int64_t blocksize, void* stream) {
  if (n == 0) return;
  const auto st = static_cast<cudaStream_t>(stream);
  with_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    nf4_dequantize_kernel<T><<<grid_for((n + 1) / 2, 256), 256, 0, st>>>(
        packed, absmax, static_cast<T*>(out), n, blocksize);
  });
  check_launch("NF4 dequantize");
}

}  // namespace ft::cuda

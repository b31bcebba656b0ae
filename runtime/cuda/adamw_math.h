// AdamW's update of one element, written once for the CPU loop (train/optimizer.cpp) and the CUDA
// kernel (cuda/kernels.cu): every operation is one IEEE-rounded multiply, add, divide or square
// root in a fixed order, never fused into an FMA, so an offloaded optimizer (on the host) gives
// the same bits as the same job's optimizer on the GPU. The formula is torch.optim.AdamW's
// (decoupled weight decay, bias-corrected moments). No ATen: nvcc compiles it without LibTorch.
#pragma once

#ifdef __CUDACC__
#define FT_HOST_DEVICE __host__ __device__
#else
#define FT_HOST_DEVICE
#endif

namespace ft::train {

// Per step and parameter group, computed on the host in fp64; each is rounded once to the
// masters' dtype where it is used.
struct AdamWScalars {
  double decay;  // 1 - lr * weight_decay
  double beta1, one_minus_beta1;
  double beta2, one_minus_beta2;
  double step_size;   // lr / (1 - beta1^step)
  double bias2_sqrt;  // sqrt(1 - beta2^step)
  double eps;
};

namespace adamw_detail {
#ifdef __CUDA_ARCH__
__device__ inline float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ inline float add(float a, float b) { return __fadd_rn(a, b); }
__device__ inline float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ inline float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline float root(float a) { return __fsqrt_rn(a); }
__device__ inline double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ inline double add(double a, double b) { return __dadd_rn(a, b); }
__device__ inline double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ inline double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ inline double root(double a) { return __dsqrt_rn(a); }
#else
// (The file that includes this is compiled with -ffp-contract=off.)
template <typename T>
inline T mul(T a, T b) {
  return a * b;
}
template <typename T>
inline T add(T a, T b) {
  return a + b;
}
template <typename T>
inline T sub(T a, T b) {
  return a - b;
}
template <typename T>
inline T div(T a, T b) {
  return a / b;
}
inline float root(float a) { return __builtin_sqrtf(a); }
inline double root(double a) { return __builtin_sqrt(a); }
#endif
}  // namespace adamw_detail

// p <- p * decay; m <- beta1 m + (1 - beta1) g; v <- beta2 v + (1 - beta2) g g;
// p <- p - step_size * (m / (sqrt(v) / bias2_sqrt + eps)).
template <typename T>
FT_HOST_DEVICE inline void adamw_element(T& p, T g, T& m, T& v, const AdamWScalars& s) {
  using namespace adamw_detail;
  const T pd = mul(p, static_cast<T>(s.decay));
  m = add(mul(m, static_cast<T>(s.beta1)), mul(g, static_cast<T>(s.one_minus_beta1)));
  v = add(mul(v, static_cast<T>(s.beta2)), mul(mul(g, g), static_cast<T>(s.one_minus_beta2)));
  const T denom = add(div(root(v), static_cast<T>(s.bias2_sqrt)), static_cast<T>(s.eps));
  p = sub(pd, mul(static_cast<T>(s.step_size), div(m, denom)));
}

}  // namespace ft::train

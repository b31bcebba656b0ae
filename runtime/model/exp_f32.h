// e^x in fp32 for vectorized CPU loops (model/fused_ops.cpp, model/cpu_attention.cpp): IEEE
// arithmetic only, so a vector lane rounds as the scalar code does when the file is compiled
// without FMA contraction (-ffp-contract=off; runtime/model/CMakeLists.txt).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace ft::model {

// e^x in fp32 from IEEE + - * / and exact operations only (min, max, conversions, shifts), no libm
// call and no branch, so GCC vectorizes the loops it is in and every lane rounds as the scalar
// code does: an element's result depends neither on where a thread's chunk begins nor on the
// CPU's vector width. The classic reduction x = n ln2 + r, |r| <= ln2/2 (about), with ln2 split
// in two so that n ln2 is exact; e^r by a degree-7 polynomial (Taylor's coefficients, the last
// ones tuned to the interval, as in Cephes' expf); 2^n in the exponent bits. Within 1 ulp of e^x
// over [-86.6, 88.7] (0.96 at worst, against fp64's exp, in a sweep of that range); +inf
// above 88.72 (as expf); 0 below about -87 (expf goes on through the subnormals; SwiGLU only ever
// adds the result to 1); NaN for NaN.
__attribute__((always_inline)) inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  // Above 88.72 the last multiply overflows to +inf; at -87.5 n is -126, and 2^(n-1) below is 0.
  const float xc = std::min(std::max(x, -87.5f), 89.0f);
  // n = x log2(e) rounded to the nearest integer (ties to even) by adding and taking away 1.5 x
  // 2^23: exact arithmetic that vectorizes (std::floor does not, under -ftrapping-math).
  constexpr float kRound = 12582912.0f;
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  const float r2 = r * r;
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  const float er = q * r2 + r + 1.0f;
  // 2^(n-1) (n in [-126, 128], exponent bits 0 to 254), doubled after the multiply, so that n =
  // 128 fits the exponent bits and n = -126 gives 0.
  const int32_t bits = (static_cast<int32_t>(n) + 126) << 23;
  float half_scale;
  std::memcpy(&half_scale, &bits, sizeof(float));
  return er * half_scale * 2.0f;
}

// Row loops over fp32 arrays with exp_f32, vectorized per CPU (model/fused_ops.cpp): the
// cross-entropy's and the host attention's softmax. Each sums in a fixed order.
// The largest element of x[0, n).
float row_max_f32(const float* x, int64_t n);
// sum of e^(x - m) over x[0, n).
float row_sum_exp_f32(const float* x, int64_t n, float m);
// x <- e^((x - m) - log_s) over x[0, n).
void row_softmax_f32(float* x, int64_t n, float m, float log_s);

}  // namespace ft::model

#include "parallel/host_add.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace ft::parallel {
namespace {

inline float widen_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) void
add_fp32(float* __restrict__ d, const float* __restrict__ s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = d[i] + s[i];
}

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) void
add_bf16(float* __restrict__ d, const uint16_t* __restrict__ s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = d[i] + widen_bf16(s[i]);
}

void add_fp16(float* __restrict__ d, const c10::Half* __restrict__ s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = d[i] + static_cast<float>(s[i]);
}

template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) double
sq_sum_block(const T* __restrict__ x, int64_t n) {
  double lanes[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) {
      const double v = static_cast<double>(x[j + l]);
      lanes[l] += v * v;
    }
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  double s = lanes[0];
  for (; j < n; ++j) s += static_cast<double>(x[j]) * static_cast<double>(x[j]);
  return s;
}

template <typename T>
double sq_norm_on_host(const T* x, int64_t n) {
  constexpr int64_t kBlock = int64_t{1} << 15;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(static_cast<size_t>(blocks));
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      partial[static_cast<size_t>(i)] =
          sq_sum_block(x + i * kBlock, std::min(kBlock, n - i * kBlock));
  });
  double s = 0;
  for (const double v : partial) s += v;
  return s;
}

}  // namespace

void add_into_host(const at::Tensor& dst, const at::Tensor& src) {
  const at::ScalarType st = src.scalar_type();
  if (!(dst.is_cpu() && src.is_cpu() && dst.scalar_type() == at::kFloat && dst.is_contiguous() &&
        src.is_contiguous() && (st == at::kFloat || st == at::kBFloat16 || st == at::kHalf))) {
    dst.add_(src);
    return;
  }
  FT_ASSERT(dst.numel() == src.numel(), "add_into_host: ", dst.numel(),
            " elements += ", src.numel());
  float* d = dst.data_ptr<float>();
  const void* s = src.const_data_ptr();
  at::parallel_for(0, dst.numel(), 1 << 16, [&](int64_t b, int64_t e) {
    if (st == at::kFloat)
      add_fp32(d + b, static_cast<const float*>(s) + b, e - b);
    else if (st == at::kBFloat16)
      add_bf16(d + b, static_cast<const uint16_t*>(s) + b, e - b);
    else
      add_fp16(d + b, static_cast<const c10::Half*>(s) + b, e - b);
  });
}

double host_sq_norm(const at::Tensor& t) {
  FT_CHECK(t.is_cpu() && t.is_contiguous() &&
               (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble),
           "host_sq_norm takes a contiguous fp32 or fp64 host tensor, got ", t.scalar_type(),
           " on ", t.device());
  if (t.scalar_type() == at::kFloat) return sq_norm_on_host(t.data_ptr<float>(), t.numel());
  return sq_norm_on_host(t.data_ptr<double>(), t.numel());
}

}  // namespace ft::parallel

#include "model/quantized_linear.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "cuda/loader.h"
#include "model/fused_ops.h"

namespace ft::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Each byte's two values (high nibble first) as fp32 codes: 256 pairs.
const std::array<std::array<float, 2>, 256>& byte_table() {
  static const auto table = [] {
    std::array<std::array<float, 2>, 256> t{};
    const auto& code = nf4_code();
    for (int b = 0; b < 256; ++b) t[b] = {code[b >> 4], code[b & 0x0F]};
    return t;
  }();
  return table;
}

// One block's values in fp32 (n even, from a byte boundary): each code times the absmax. The
// scalar loop, and an AVX2 one that looks the codes up with two 8-entry permutes (the same
// multiply, so the same bits) where the CPU has it.
void block_scalar(const uint8_t* packed, float m, float* out, int64_t n) {
  const auto& table = byte_table();
  for (int64_t i = 0; i + 1 < n; i += 2) {
    const auto& pair = table[packed[i / 2]];
    out[i] = pair[0] * m;
    out[i + 1] = pair[1] * m;
  }
}

#if defined(__x86_64__)
// Codes 0-7 from the first table, 8-15 from the second: bit 3 of the index, moved to the sign
// bit, picks.
__attribute__((target("avx2"))) inline __m256 lookup(__m256 lo_codes, __m256 hi_codes,
                                                     __m256i idx) {
  const __m256 a = _mm256_permutevar8x32_ps(lo_codes, idx);
  const __m256 b = _mm256_permutevar8x32_ps(hi_codes, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

__attribute__((target("avx2"))) void block_avx2(const uint8_t* packed, float m, float* out,
                                                int64_t n) {
  const auto& code = nf4_code();
  const __m256 lo_codes = _mm256_loadu_ps(code.data()), hi_codes = _mm256_loadu_ps(code.data() + 8);
  const __m256 scale = _mm256_set1_ps(m);
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // 8 bytes: 16 values
    const __m256i bytes =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + i / 2)));
    const __m256 first =
        _mm256_mul_ps(lookup(lo_codes, hi_codes, _mm256_srli_epi32(bytes, 4)), scale);
    const __m256 second =
        _mm256_mul_ps(lookup(lo_codes, hi_codes, _mm256_and_si256(bytes, nibble)), scale);
    // Byte j's values go to 2j and 2j + 1.
    const __m256 a = _mm256_unpacklo_ps(first, second), b = _mm256_unpackhi_ps(first, second);
    _mm256_storeu_ps(out + i, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(out + i + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
  block_scalar(packed + i / 2, m, out + i, n - i);
}
#endif

// The host kernel: blocks of values over the threads; each value code * absmax in fp32, rounded
// once to T (as dequantize_nf4's fp32 result then .to(dtype)).
template <typename T>
void dequantize_host(const uint8_t* packed, const float* absmax, T* out, const Nf4Shape& s) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
#endif
  const int64_t n = s.numel(), bs = s.blocksize;
  at::parallel_for(
      0, s.blocks(), std::max<int64_t>(1, (1 << 16) / bs), [&](int64_t b0, int64_t b1) {
        std::vector<float> buffer(std::is_same_v<T, float> ? 0 : bs);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t begin = b * bs, len = std::min(n, begin + bs) - begin;
          float* f =
              std::is_same_v<T, float> ? reinterpret_cast<float*>(out + begin) : buffer.data();
          // Blocks hold an even number of values, so a block starts on a byte; an odd last value
          // is the high nibble of the last byte.
          const int64_t even = len & ~int64_t{1};
#if defined(__x86_64__)
          if (avx2)
            block_avx2(packed + begin / 2, absmax[b], f, even);
          else
#endif
            block_scalar(packed + begin / 2, absmax[b], f, even);
          if (even < len) f[even] = byte_table()[packed[(begin + even) / 2]][0] * absmax[b];
          if constexpr (!std::is_same_v<T, float>)
            for (int64_t i = 0; i < len; ++i) out[begin + i] = static_cast<T>(f[i]);
        }
      });
}

struct Nf4LinearFn : public torch::autograd::Function<Nf4LinearFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& blob,
                            int64_t rows, int64_t cols, int64_t blocksize) {
    const Nf4Shape s{rows, cols, blocksize};
    ctx->save_for_backward({blob});
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["cols"] = cols;
    ctx->saved_data["blocksize"] = blocksize;
    return at::linear(x, dequantize_blob(blob, s, x.scalar_type()));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const at::Tensor blob = ctx->get_saved_variables()[0];
    const Nf4Shape s{ctx->saved_data["rows"].toInt(), ctx->saved_data["cols"].toInt(),
                     ctx->saved_data["blocksize"].toInt()};
    const at::Tensor& g = grad_out[0];
    at::Tensor gx;
    if (ctx->needs_input_grad(0)) gx = at::matmul(g, dequantize_blob(blob, s, g.scalar_type()));
    return {gx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor dequantize_blob(const at::Tensor& blob, const Nf4Shape& s, at::ScalarType dtype) {
  FT_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
           "NF4 dequantizes to fp32, bf16 or fp16, not ", dtype);
  const at::Tensor bytes = blob.contiguous().view({-1}).view(at::kByte);
  FT_CHECK(bytes.numel() == s.bytes(), "NF4 weight [", s.rows, ", ", s.cols, "] needs a blob of ",
           s.bytes(), " bytes, got ", bytes.numel());
  const at::Tensor absmax = bytes.narrow(0, s.absmax_offset(), 4 * s.blocks()).view(at::kFloat);
  at::Tensor out = at::empty({s.rows, s.cols}, bytes.options().dtype(dtype));
  if (bytes.is_cuda()) {
    cuda::api().nf4_dequantize(static_cast<int>(bytes.get_device()), cuda_element_type(out),
                               bytes.const_data_ptr<uint8_t>(), absmax.const_data_ptr<float>(),
                               out.data_ptr(), s.numel(), s.blocksize);
    return out;
  }
  FT_CHECK(bytes.is_cpu(), "NF4 weights dequantize on the CPU or a CUDA device, not ",
           bytes.device());
  const uint8_t* p = bytes.const_data_ptr<uint8_t>();
  const float* a = absmax.const_data_ptr<float>();
  switch (dtype) {
    case at::kFloat:
      dequantize_host(p, a, out.data_ptr<float>(), s);
      break;
    case at::kBFloat16:
      dequantize_host(p, a, out.data_ptr<at::BFloat16>(), s);
      break;
    default:
      dequantize_host(p, a, out.data_ptr<at::Half>(), s);
  }
  return out;
}

at::Tensor nf4_linear(const at::Tensor& x, const at::Tensor& blob, const Nf4Shape& s) {
  FT_CHECK(x.size(-1) == s.cols, "NF4 projection [", s.rows, ", ", s.cols, "] given input ",
           x.sizes());
  return Nf4LinearFn::apply(x, blob.detach(), s.rows, s.cols, s.blocksize);
}

}  // namespace ft::model

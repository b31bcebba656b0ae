#include "model/quantized_linear.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <cstdint>

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

// The host kernel: blocks of values over the threads; each value code * absmax in fp32, rounded
// once to T (as dequantize_nf4's fp32 result then .to(dtype)).
template <typename T>
void dequantize_host(const uint8_t* packed, const float* absmax, T* out, const Nf4Shape& s) {
  const auto& table = byte_table();
  const int64_t n = s.numel(), bs = s.blocksize;
  at::parallel_for(0, s.blocks(), std::max<int64_t>(1, (1 << 16) / bs),
                   [&](int64_t b0, int64_t b1) {
                     for (int64_t b = b0; b < b1; ++b) {
                       const float m = absmax[b];
                       const int64_t begin = b * bs, end = std::min(n, begin + bs);
                       // Blocks hold an even number of values: a block starts on a byte.
                       int64_t i = begin;
                       for (; i + 1 < end; i += 2) {
                         const auto& pair = table[packed[i / 2]];
                         out[i] = static_cast<T>(pair[0] * m);
                         out[i + 1] = static_cast<T>(pair[1] * m);
                       }
                       if (i < end) out[i] = static_cast<T>(table[packed[i / 2]][0] * m);
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

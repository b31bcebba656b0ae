#include "model/nf4.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/error.h"

namespace ft::model {

namespace {

constexpr int kLutSize = 65536;  // cells of the 8-bit quantizer's table over [-1, 1]

// The 8-bit quantizer's table: for each of 65,536 evenly spaced values in [-1, 1], the index of
// the first code whose midpoint with the next is not below it.
std::unique_ptr<uint8_t[]> build_lut(const float* code) {
  float mid[255];
  for (int i = 0; i < 255; ++i) mid[i] = 0.5f * (code[i] + code[i + 1]);
  auto lut = std::make_unique<uint8_t[]>(kLutSize);
  int at = 0;
  for (int i = 0; i < kLutSize; ++i) {
    const float v = -1.0f + (2.0f * static_cast<float>(i)) / static_cast<float>(kLutSize - 1);
    while (at < 255 && mid[at] < v) ++at;
    lut[i] = static_cast<uint8_t>(at);
  }
  return lut;
}

// A value in [-1, 1] (clamped) to its table cell, rounding to the nearest.
inline int lut_cell(float v) {
  v = std::min(1.0f, std::max(-1.0f, v));
  return static_cast<int>(
      static_cast<uint16_t>((v + 1.0f) * 0.5f * static_cast<float>(kLutSize - 1) + 0.5f));
}

// The largest |x| of x[begin, end) (0 for none).
float block_absmax(const float* x, int64_t begin, int64_t end) {
  float m = 0.0f;
  for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

void check_blocksize(int64_t blocksize) {
  FT_CHECK(blocksize >= 32 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0,
           "NF4 block size must be a power of two from 32 to 4096, got ", blocksize);
}

}  // namespace

const std::array<float, 16>& nf4_code() {
  // The NF4 data type (QLoRA, appendix E; bitsandbytes' get_4bit_type("nf4")): quantiles of a
  // normal distribution, normalized to [-1, 1], with an exact zero.
  static const std::array<float, 16> code = {
      -1.0f,          -0.696192801f, -0.525073051f, -0.394917488f, -0.284441382f, -0.18477343f,
      -0.0910500363f, 0.0f,          0.0795802996f, 0.160930201f,  0.246112302f,  0.337915242f,
      0.440709829f,   0.562617004f,  0.722956836f,  1.0f};
  return code;
}

at::Tensor dynamic_map() {
  // bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for each
  // exponent e = 0..6, the 2^e midpoints of an fp32 linspace(0.1, 1, 2^e + 1) times 10^(e-6),
  // with both signs; then 0 and 1; ascending. The same LibTorch operations as its Python, so the
  // same fp32 values.
  std::vector<float> data;
  for (int e = 0; e < 7; ++e) {
    const at::Tensor b = at::linspace(0.1, 1, (int64_t{1} << e) + 1, at::kFloat);
    const at::Tensor means = (b.narrow(0, 0, b.numel() - 1) + b.narrow(0, 1, b.numel() - 1)) / 2.0;
    const at::Tensor pos = e == 6 ? means * 1 : means * std::pow(10.0, e - 6);
    const at::Tensor neg = e == 6 ? means * -1 : means * -std::pow(10.0, e - 6);
    for (const at::Tensor& t : {pos, neg}) {
      const at::Tensor c = t.contiguous();
      data.insert(data.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  FT_ASSERT(data.size() == 256, "dynamic map of ", data.size(), " values");
  std::sort(data.begin(), data.end());
  return at::tensor(data, at::kFloat);
}

int64_t Nf4Weight::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

std::pair<at::Tensor, at::Tensor> quantize_blockwise_8bit(const at::Tensor& x,
                                                          const at::Tensor& code,
                                                          int64_t blocksize) {
  FT_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && code.numel() == 256 &&
               code.scalar_type() == at::kFloat && blocksize > 0,
           "8-bit blockwise quantization takes fp32 host values and a 256-value fp32 code");
  const at::Tensor xs = x.contiguous(), cs = code.contiguous();
  const int64_t n = xs.numel(), blocks = (n + blocksize - 1) / blocksize;
  const auto lut = build_lut(cs.data_ptr<float>());
  at::Tensor out = at::zeros({n}, at::kByte), absmax = at::empty({blocks}, at::kFloat);
  const float* in = xs.data_ptr<float>();
  uint8_t* q = out.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * blocksize, end = std::min(n, begin + blocksize);
    const float m = block_absmax(in, begin, end);
    am[b] = m;
    if (m == 0.0f) continue;  // every index 0
    const float inv = 1.0f / m;
    for (int64_t i = begin; i < end; ++i) q[i] = lut[lut_cell(in[i] * inv)];
  }
  return {out, absmax};
}

Nf4Weight quantize_nf4(const at::Tensor& w, bool double_quant, int64_t blocksize) {
  FT_CHECK(w.is_cpu() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 ||
                          w.scalar_type() == at::kHalf),
           "NF4 quantizes fp32, bf16 or fp16 host tensors, got ", w.scalar_type(), " on ",
           w.device());
  check_blocksize(blocksize);
  const at::Tensor x = w.reshape({-1}).to(at::kFloat).contiguous();
  const int64_t n = x.numel(), full = n / blocksize, blocks = (n + blocksize - 1) / blocksize;
  Nf4Weight q;
  q.shape = w.sizes().vec();
  q.blocksize = blocksize;
  q.packed = at::zeros({(n + 1) / 2}, at::kByte);
  at::Tensor absmax = at::empty({blocks}, at::kFloat);
  const auto& code = nf4_code();
  float mid[15];
  for (int k = 0; k < 15; ++k) mid[k] = (code[k] + code[k + 1]) / 2.0f;
  const float* in = x.data_ptr<float>();
  uint8_t* out = q.packed.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();
  // Blocks hold an even number of values, so each byte belongs to one block.
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * blocksize, end = std::min(n, begin + blocksize);
      const float m = block_absmax(in, begin, end);
      // As bitsandbytes: full blocks multiply by the reciprocal of their absmax (kept as it is),
      // the short last block divides by its absmax (kept clamped away from 0).
      const bool last = b >= full;
      const float kept = last ? std::max(m, 1e-38f) : m;
      am[b] = kept;
      const float inv = 1.0f / std::max(m, 1e-38f);
      for (int64_t i = begin; i < end; ++i) {
        float v = last ? in[i] / kept : in[i] * inv;
        v = std::min(1.0f, std::max(-1.0f, v));
        int idx = 0;
        for (int k = 0; k < 15; ++k) idx += mid[k] < v;
        uint8_t& byte = out[i / 2];
        byte = static_cast<uint8_t>(i % 2 == 0 ? (byte & 0x0F) | (idx << 4) : (byte & 0xF0) | idx);
      }
      // (An odd count pads the last byte's low nibble with the index of 0.)
      if (end == n && n % 2 == 1) out[n / 2] = static_cast<uint8_t>((out[n / 2] & 0xF0) | 7);
    }
  });
  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  // The absmax values less their mean, in 8 bits per block of 256 (bitsandbytes'
  // compress_statistics), with the same LibTorch mean and subtraction its Python uses.
  const at::Tensor offset = absmax.mean();
  q.offset = offset.item<float>();
  q.nested_code = dynamic_map();
  std::tie(q.absmax, q.nested_absmax) =
      quantize_blockwise_8bit(absmax - offset, q.nested_code, 256);
  return q;
}

at::Tensor nf4_absmax(const Nf4Weight& q) {
  if (!q.double_quant()) return q.absmax;
  const int64_t blocks = q.absmax.numel();
  at::Tensor out = at::empty({blocks}, at::kFloat);
  const uint8_t* idx = q.absmax.contiguous().data_ptr<uint8_t>();
  const at::Tensor code = q.nested_code.contiguous(), nested = q.nested_absmax.contiguous();
  const float* c = code.data_ptr<float>();
  const float* s = nested.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t b = 0; b < blocks; ++b) o[b] = c[idx[b]] * s[b / 256];
  out.add_(at::scalar_tensor(q.offset, at::kFloat));
  return out;
}

at::Tensor dequantize_nf4(const Nf4Weight& q, at::ScalarType dtype) {
  FT_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
           "NF4 dequantizes to fp32, bf16 or fp16, not ", dtype);
  check_blocksize(q.blocksize);
  const int64_t n = q.numel(), blocks = (n + q.blocksize - 1) / q.blocksize;
  FT_CHECK(q.packed.numel() == (n + 1) / 2 && q.absmax.numel() == blocks, "NF4 weight of ", n,
           " values in blocks of ", q.blocksize, " needs ", (n + 1) / 2, " packed bytes and ",
           blocks, " absmax values, got ", q.packed.numel(), " and ", q.absmax.numel());
  const at::Tensor absmax = nf4_absmax(q).contiguous(), packed = q.packed.contiguous();
  at::Tensor out = at::empty({n}, at::kFloat);
  const auto& code = nf4_code();
  const float* am = absmax.data_ptr<float>();
  const uint8_t* in = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t bs = q.blocksize;
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int nib = i % 2 == 0 ? in[i / 2] >> 4 : in[i / 2] & 0x0F;
      o[i] = code[nib] * am[i / bs];
    }
  });
  return out.to(dtype).view(q.shape);
}

int64_t Nf4Shape::elements(at::ScalarType dtype) const {
  const auto size = static_cast<int64_t>(c10::elementSize(dtype));
  FT_ASSERT(bytes() % size == 0, "NF4 blob of ", bytes(), " bytes in elements of ", size);
  return bytes() / size;
}

Nf4Shape nf4_shape(const Nf4Weight& q) {
  FT_CHECK(q.shape.size() == 2, "an NF4 blob holds a 2-D weight, not one of ", q.shape.size(),
           " dimensions");
  return {q.shape[0], q.shape[1], q.blocksize};
}

at::Tensor nf4_blob(const Nf4Weight& q) {
  const Nf4Shape s = nf4_shape(q);
  FT_CHECK(q.packed.numel() == s.packed_bytes() && q.absmax.numel() == s.blocks(), "NF4 weight [",
           s.rows, ", ", s.cols, "] in blocks of ", s.blocksize, " needs ", s.packed_bytes(),
           " packed bytes and ", s.blocks(), " absmax values, got ", q.packed.numel(), " and ",
           q.absmax.numel());
  at::Tensor blob = at::zeros({s.bytes()}, at::kByte);
  blob.narrow(0, 0, s.packed_bytes()).copy_(q.packed.reshape({-1}));
  blob.narrow(0, s.absmax_offset(), 4 * s.blocks())
      .view(at::kFloat)
      .copy_(nf4_absmax(q).to(at::kFloat));
  return blob;
}

}  // namespace ft::model

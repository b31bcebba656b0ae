#include "model/attention.h"

#include <limits>
#include <vector>

#include "core/error.h"
#include "model/cpu_attention.h"
#include "model/fused_ops.h"

namespace ft::model {

namespace {

c10::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

at::Tensor rotate_half(const at::Tensor& x) {
  int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// Gemma 2's eager attention: repeat_kv, scores, cap, mask, fp32 softmax, values.
at::Tensor capped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask, bool causal, double scale, double softcap) {
  const int64_t rep = q.size(1) / k.size(1);
  const at::Tensor kk = rep > 1 ? k.repeat_interleave(rep, 1) : k;
  const at::Tensor vv = rep > 1 ? v.repeat_interleave(rep, 1) : v;
  at::Tensor s = at::matmul(q, kk.transpose(2, 3)) * scale;
  s = at::tanh(s / softcap) * softcap;
  at::Tensor m = mask;
  if (!m.defined() && causal) {
    const int64_t tq = q.size(2), tk = k.size(2);
    m = at::ones({tq, tk}, q.options().dtype(at::kBool)).tril(tk - tq);
  }
  if (m.defined()) {
    s = m.scalar_type() == at::kBool
            ? s.masked_fill(m.logical_not(), -std::numeric_limits<double>::infinity())
            : s + m;
  }
  const at::Tensor p = at::softmax(s, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(p, vv);
}

}  // namespace

at::Tensor attention_bias(const at::Tensor& mask, at::ScalarType dtype) {
  return at::where(mask, at::scalar_tensor(0.0, at::TensorOptions().dtype(dtype)),
                   at::scalar_tensor(-std::numeric_limits<double>::infinity(),
                                     at::TensorOptions().dtype(dtype)));
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& mask, bool causal, double scale, double softcap,
                  bool host_kernel) {
  if (softcap > 0) return capped_attention(q, k, v, mask, causal, scale, softcap);
  // fp32 on the host: ft's kernel (the fused attention node's; the same bits on both paths).
  if (host_kernel && cpu_attention_supported(q, k, v, mask))
    return cpu_attention(q, k, v, mask, causal && !mask.defined(), scale);
  return at::scaled_dot_product_attention(q, k, v, optional(mask), /*dropout_p=*/0.0,
                                          /*is_causal=*/causal && !mask.defined(), scale,
                                          /*enable_gqa=*/q.size(1) != k.size(1));
}

at::Tensor attend_windowed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& segment_ids, int64_t window, double scale,
                           double softcap, bool host_kernel) {
  FT_ASSERT(window >= 1, "attend_windowed: window ", window);
  const int64_t T = q.size(2);
  const auto longs = at::TensorOptions().dtype(at::kLong).device(q.device());
  std::vector<at::Tensor> out;
  for (int64_t s = 0; s < T; s += window) {
    const int64_t e = std::min(T, s + window), k0 = std::max<int64_t>(0, s - window + 1);
    const at::Tensor rows = at::arange(s, e, longs).unsqueeze(1);
    const at::Tensor cols = at::arange(k0, e, longs).unsqueeze(0);
    at::Tensor m = cols.le(rows).logical_and(rows.sub(cols).lt(window));  // [Tq, Tk]
    if (segment_ids.defined()) {
      const at::Tensor same = segment_ids.slice(1, s, e).unsqueeze(2).eq(
          segment_ids.slice(1, k0, e).unsqueeze(1));  // [B, Tq, Tk]
      m = m.unsqueeze(0).logical_and(same).unsqueeze(1);
    } else {
      m = m.view({1, 1, e - s, e - k0});
    }
    out.push_back(attend(q.slice(2, s, e), k.slice(2, k0, e), v.slice(2, k0, e), m,
                         /*causal=*/false, scale, softcap, host_kernel));
  }
  return out.size() == 1 ? out[0] : at::cat(out, 2);
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool fused) {
  const int64_t rd = cos.size(-1), hd = x.size(-1);
  const at::Tensor xr = rd == hd ? x : x.narrow(-1, 0, rd);
  at::Tensor r;
  if (fused && fuses_on_device(x)) {
    r = fused_rope(xr, cos, sin);
  } else {
    const at::Tensor cos4 = cos.unsqueeze(2), sin4 = sin.unsqueeze(2);  // [B, T, 1, rd]
    r = xr * cos4 + rotate_half(xr) * sin4;
  }
  return rd == hd ? r : at::cat({r, x.narrow(-1, rd, hd - rd)}, -1);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, NormStyle style) {
  // On a GPU, LibTorch's fused kernel for Llama's style (one pass forward, one backward; fp32
  // inside, rounded once at the end rather than before the weight).
  if (style == NormStyle::kScale && x.is_cuda()) return at::rms_norm(x, {x.size(-1)}, weight, eps);
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  switch (style) {
    case NormStyle::kScale:
      return weight * h.to(x.scalar_type());
    case NormStyle::kScaleFp32:
      return (weight * h).to(x.scalar_type());
    case NormStyle::kOffset:
      return (h * (1.0 + weight.to(at::kFloat))).to(x.scalar_type());
  }
  FT_ASSERT(false, "unknown NormStyle");
  return h;
}

}  // namespace ft::model

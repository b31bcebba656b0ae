#include "train/optimizer.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "cuda/loader.h"
#include "cuda/adamw_math.h"

namespace ft::train {

bool AdamW::no_decay(const std::string& name) {
  auto ends_with = [&](const char* s) {
    std::string suf = s;
    return name.size() >= suf.size() &&
           name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  return name.find("norm") != std::string::npos || ends_with(".bias");
}

namespace {

// The host's loop: the same element function as the CUDA kernel, vectorized where the CPU allows
// (IEEE vector multiply, add, divide and square root round as the scalar ones do), over threads.
// kScale: each gradient is multiplied by `scale` first (rounded to T, as at::mul_ by a double
// does for a T tensor); kZero: each gradient is zeroed once read; kOut: the new value is also
// written, rounded, to `out` (kNone: not at all).
enum Out { kNone, kBf16, kFp16 };

// fp32 -> bf16 bits, rounded to nearest even as c10::BFloat16 rounds (a NaN becomes 0x7FC0). In
// plain integer operations, so the loop stays vectorized.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

template <typename T, bool kScale, bool kZero, Out kOut>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) void
adamw_range(T* __restrict__ p, T* __restrict__ g, T* __restrict__ m, T* __restrict__ v, int64_t n,
            const AdamWScalars s, const T scale, uint16_t* __restrict__ out) {
  for (int64_t i = 0; i < n; ++i) {
    T pi = p[i], mi = m[i], vi = v[i], gi = g[i];
    if constexpr (kScale) gi = gi * scale;
    if constexpr (kZero) g[i] = T(0);
    adamw_element(pi, gi, mi, vi, s);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (kOut == kBf16) out[i] = bf16_bits(static_cast<float>(pi));
    if constexpr (kOut == kFp16) out[i] = c10::Half(static_cast<float>(pi)).x;
  }
}

template <typename T, Out kOut>
void adamw_chunk(T* p, T* g, T* m, T* v, int64_t n, const AdamWScalars& s, T scale, bool scaled,
                 bool zero, uint16_t* out) {
  if (scaled && zero)
    adamw_range<T, true, true, kOut>(p, g, m, v, n, s, scale, out);
  else if (scaled)
    adamw_range<T, true, false, kOut>(p, g, m, v, n, s, scale, out);
  else if (zero)
    adamw_range<T, false, true, kOut>(p, g, m, v, n, s, scale, out);
  else
    adamw_range<T, false, false, kOut>(p, g, m, v, n, s, scale, out);
}

template <typename T>
void step_on_host(at::Tensor& p, at::Tensor& grad, at::Tensor& m, at::Tensor& v,
                  const AdamWScalars& s, double grad_scale, bool zero_grads,
                  const at::Tensor& copy_out) {
  T* pp = p.data_ptr<T>();
  T* gp = grad.data_ptr<T>();
  T* mp = m.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  const T scale = static_cast<T>(grad_scale);
  const bool scaled = grad_scale != 1.0;
  const Out kind = !copy_out.defined()                       ? kNone
                   : copy_out.scalar_type() == at::kBFloat16 ? kBf16
                                                             : kFp16;
  uint16_t* op = kind == kNone ? nullptr : static_cast<uint16_t*>(copy_out.data_ptr());
  at::parallel_for(0, p.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    T *pb = pp + begin, *gb = gp + begin, *mb = mp + begin, *vb = vp + begin;
    uint16_t* ob = op ? op + begin : nullptr;
    const int64_t n = end - begin;
    if (kind == kBf16)
      adamw_chunk<T, kBf16>(pb, gb, mb, vb, n, s, scale, scaled, zero_grads, ob);
    else if (kind == kFp16)
      adamw_chunk<T, kFp16>(pb, gb, mb, vb, n, s, scale, scaled, zero_grads, ob);
    else
      adamw_chunk<T, kNone>(pb, gb, mb, vb, n, s, scale, scaled, zero_grads, ob);
  });
}

void check_copy_out(const at::Tensor& p, const at::Tensor& copy_out) {
  FT_CHECK(p.is_cpu() && p.scalar_type() == at::kFloat && copy_out.is_cpu() &&
               copy_out.is_contiguous() && copy_out.numel() == p.numel() &&
               (copy_out.scalar_type() == at::kBFloat16 || copy_out.scalar_type() == at::kHalf),
           "AdamW: a copy-out needs an fp32 host parameter and a contiguous bf16 or fp16 host "
           "tensor of as many elements");
}

std::vector<AdamW::Param> by_name(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  std::vector<AdamW::Param> out;
  for (const auto& [name, t] : params) out.push_back({t, !AdamW::no_decay(name)});
  return out;
}
}  // namespace

AdamW::AdamW(const std::vector<std::pair<std::string, at::Tensor>>& params, AdamWOptions options)
    : AdamW(by_name(params), options) {}

AdamW::AdamW(const std::vector<Param>& params, AdamWOptions options) : options_(options) {
  groups_.push_back({options.weight_decay, {}, {}, {}, {}, {}, {}});
  groups_.push_back({0.0, {}, {}, {}, {}, {}, {}});
  for (const auto& [p, decay, copy_out] : params) {
    Group& g = groups_[decay ? 0 : 1];
    where_.emplace_back(decay ? 0 : 1, g.params.size());
    if (copy_out.defined()) check_copy_out(p, copy_out);
    g.params.push_back(p);
    g.copy_out.push_back(copy_out);
    g.exp_avg.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    g.exp_avg_sq.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    g.steps.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
  }
}

void AdamW::step(double lr, double grad_scale, bool zero_grads, bool write_copies) {
  begin(lr, grad_scale, zero_grads, write_copies);
  for (size_t i = 0; i < where_.size(); ++i) update(i);
}

void AdamW::begin(double lr, double grad_scale, bool zero_grads, bool write_copies) {
  ++steps_;
  const double step = static_cast<double>(steps_);
  for (auto& g : groups_) {
    AdamWScalars& s = g.scalars;
    s.decay = 1.0 - lr * g.weight_decay;
    s.beta1 = options_.beta1;
    s.one_minus_beta1 = 1.0 - options_.beta1;
    s.beta2 = options_.beta2;
    s.one_minus_beta2 = 1.0 - options_.beta2;
    s.step_size = lr / (1.0 - std::pow(options_.beta1, step));
    s.bias2_sqrt = std::sqrt(1.0 - std::pow(options_.beta2, step));
    s.eps = options_.eps;
  }
  grad_scale_ = grad_scale;
  zero_grads_ = zero_grads;
  write_copies_ = write_copies;
}

void AdamW::update(size_t index, const at::Tensor& copy_out) {
  at::NoGradGuard no_grad;
  FT_ASSERT(index < where_.size(), "AdamW::update of parameter ", index, " of ", where_.size());
  auto [gi, i] = where_[index];
  Group& g = groups_[gi];
  const AdamWScalars& s = g.scalars;
  at::Tensor& p = g.params[i];
  at::Tensor grad = p.grad();
  FT_CHECK(grad.defined() && p.is_contiguous() && grad.is_contiguous() &&
               grad.scalar_type() == p.scalar_type() && grad.device() == p.device(),
           "AdamW: a parameter without a contiguous gradient of its own dtype and device");
  g.steps[i].add_(1);
  if (p.is_cuda()) {
    FT_CHECK(p.scalar_type() == at::kFloat, "AdamW on a GPU updates fp32 masters, got ",
             p.scalar_type());
    if (grad_scale_ != 1.0) grad.mul_(grad_scale_);
    cuda::api().adamw_fp32(p.get_device(), p.data_ptr<float>(), grad.data_ptr<float>(),
                           g.exp_avg[i].data_ptr<float>(), g.exp_avg_sq[i].data_ptr<float>(),
                           p.numel(), s);
    if (zero_grads_) grad.zero_();
  } else if (p.scalar_type() == at::kFloat) {
    at::Tensor out = copy_out.defined() ? copy_out : write_copies_ ? g.copy_out[i] : at::Tensor();
    if (copy_out.defined()) check_copy_out(p, copy_out);
    step_on_host<float>(p, grad, g.exp_avg[i], g.exp_avg_sq[i], s, grad_scale_, zero_grads_, out);
  } else {
    FT_CHECK(p.scalar_type() == at::kDouble, "AdamW updates fp32 or fp64 masters, got ",
             p.scalar_type());
    FT_CHECK(!copy_out.defined(), "AdamW: a copy-out needs fp32 masters");
    step_on_host<double>(p, grad, g.exp_avg[i], g.exp_avg_sq[i], s, grad_scale_, zero_grads_,
                         at::Tensor());
  }
}

void AdamW::set_steps(int64_t steps) {
  steps_ = steps;
  for (auto& g : groups_)
    for (auto& t : g.steps) t.fill_(static_cast<double>(steps));
}

int64_t AdamW::state_bytes() const {
  int64_t b = 0;
  for (const auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i)
      b += g.exp_avg[i].nbytes() + g.exp_avg_sq[i].nbytes() + g.steps[i].nbytes();
  return b;
}

}  // namespace ft::train

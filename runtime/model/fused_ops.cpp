#include "model/fused_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "cuda/loader.h"
#include "model/exp_f32.h"

namespace ft::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Arithmetic inside a kernel: fp32 for fp32, bf16 and fp16 (as ATen's opmath), fp64 for fp64.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

// v rounded to T and back: where the unfused path stores an intermediate tensor in T.
template <typename T>
inline Acc<T> round_to(Acc<T> v) {
  return static_cast<Acc<T>>(static_cast<T>(v));
}

// Elements per parallel chunk: below this a kernel runs on the calling thread. 4096, not ATen's
// 32768: a layer's [64 tokens, 256] RMSNorm and RoPE then use both threads of a 2-core machine
// (1.5% of the overhead-bound model's step; docs/performance-log.md). Every kernel's bits are the
// same for any split (tested at 1 and 2 threads).
constexpr int64_t kGrain = 1 << 12;

// e^x in a kernel's arithmetic type: exp_f32 for fp32 (fp32, bf16 and fp16 tensors), libm's for
// fp64.
inline float exp_acc(float x) { return exp_f32(x); }
inline double exp_acc(double x) { return std::exp(x); }

// SwiGLU's fp32 loops, written so that GCC vectorizes them (no branch inside, exp_f32 inlined),
// with a copy per vector width the CPU may have. Same formulas as the templated loops below.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) void
swiglu_forward_f32(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
                   int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    y[i] = x / (1.0f + exp_f32(-x)) * u[i];
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) void
swiglu_backward_f32(const float* __restrict__ g, const float* __restrict__ u,
                    const float* __restrict__ dy, float* __restrict__ dg, float* __restrict__ du,
                    int64_t n) {
  if (dg && du) {
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i], one_plus = 1.0f + exp_f32(-x), sig = 1.0f / one_plus, d = dy[i];
      du[i] = d * (x / one_plus);
      dg[i] = (d * u[i]) * sig * (1.0f + x * (1.0f - sig));
    }
  } else if (dg) {
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i], one_plus = 1.0f + exp_f32(-x), sig = 1.0f / one_plus;
      dg[i] = (dy[i] * u[i]) * sig * (1.0f + x * (1.0f - sig));
    }
  } else if (du) {
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i];
      du[i] = dy[i] * (x / (1.0f + exp_f32(-x)));
    }
  }
}

}  // namespace

// ---- Cross-entropy over fp32 logit rows (model/fused_loss.cpp's chunks) ----------------------

// The largest element of a row, in 16 lanes (a fixed order that GCC vectorizes). A NaN may be
// passed over here; it still reaches the loss through the sum of exponentials.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) float
row_max_f32(const float* __restrict__ x, int64_t n) {
  float lanes[16];
  for (float& l : lanes) l = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = std::max(lanes[l], x[j + l]);
  float m = lanes[0];
  for (int l = 1; l < 16; ++l) m = std::max(m, lanes[l]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// sum of e^(x - m) over a row, in 16 lanes summed pairwise (a fixed order).
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) float
row_sum_exp_f32(const float* __restrict__ x, int64_t n, float m) {
  float lanes[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += exp_f32(x[j + l] - m);
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  float s = lanes[0];
  for (; j < n; ++j) s += exp_f32(x[j] - m);
  return s;
}

// x <- e^((x - m) - log_s) over a row: the softmax as the exponential of log_softmax (ATen's
// cross-entropy backward): x - m is exact near the maximum, where the mass is, and log_s is small;
// e^(x - lse) with lse = m + log_s rounded to fp32 would lose up to an ulp of the logits' size.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) void
row_softmax_f32(float* __restrict__ x, int64_t n, float m, float log_s) {
  for (int64_t j = 0; j < n; ++j) x[j] = exp_f32((x[j] - m) - log_s);
}

namespace {

// The element type the fused CUDA kernels (cuda/kernels.h, through libft_cuda.so) take.
cuda::ElementType element_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return cuda::ElementType::kFloat;
    case at::kBFloat16:
      return cuda::ElementType::kBFloat16;
    case at::kHalf:
      return cuda::ElementType::kHalf;
    default:
      FT_CHECK(false, "the fused CUDA kernels take fp32, bf16 or fp16 tensors, got ",
               t.scalar_type());
  }
  return cuda::ElementType::kFloat;
}

// The vectorized fp32 loops where T is float (true: done); other types take the templated loop.
template <typename T>
bool swiglu_forward_vec(const T*, const T*, T*, int64_t) {
  return false;
}
inline bool swiglu_forward_vec(const float* g, const float* u, float* y, int64_t n) {
  swiglu_forward_f32(g, u, y, n);
  return true;
}
template <typename T>
bool swiglu_backward_vec(const T*, const T*, const T*, T*, T*, int64_t) {
  return false;
}
inline bool swiglu_backward_vec(const float* g, const float* u, const float* dy, float* dg,
                                float* du, int64_t n) {
  swiglu_backward_f32(g, u, dy, dg, du, n);
  return true;
}

// ---- RMSNorm ------------------------------------------------------------------------------------

// Rows are cut into at most kMaxBlocks blocks of equal length that depends on the row count only;
// the weight's gradient is summed per block, then over the blocks in order, so its bits do not
// depend on the number of threads.
constexpr int64_t kMaxBlocks = 64;
constexpr int64_t kMinRowsPerBlock = 16;

struct Blocks {
  int64_t count = 0, rows_per_block = 0;
};
Blocks blocks_of(int64_t rows) {
  const int64_t want = std::min(kMaxBlocks, (rows + kMinRowsPerBlock - 1) / kMinRowsPerBlock);
  Blocks b;
  b.count = std::max<int64_t>(want, 1);
  b.rows_per_block = (rows + b.count - 1) / b.count;
  b.count = rows == 0 ? 0 : (rows + b.rows_per_block - 1) / b.rows_per_block;
  return b;
}

// sum of a[j] * b[j] over a row in Acc, in 8 interleaved partial sums (a fixed order that the
// compiler vectorizes).
template <typename T, typename U>
inline Acc<T> row_dot(const T* a, const U* b, int64_t n) {
  using A = Acc<T>;
  A lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += static_cast<A>(a[j + l]) * static_cast<A>(b[j + l]);
  A s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
        ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; j < n; ++j) s += static_cast<A>(a[j]) * static_cast<A>(b[j]);
  return s;
}

// y = w * round(x * rstd) per row (transformers: the normalised value is cast to the input's dtype
// before the weight multiplies it); optionally x = h + delta first, stored to `sum`.
template <typename T>
void rms_forward_rows(const T* h, const T* delta, T* sum, const T* w, T* y, Acc<T>* rstd,
                      int64_t begin, int64_t end, int64_t H, double eps) {
  using A = Acc<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* x = h + r * H;
    if (delta) {
      T* s = sum + r * H;
      const T* d = delta + r * H;
      for (int64_t j = 0; j < H; ++j)
        s[j] = static_cast<T>(static_cast<A>(x[j]) + static_cast<A>(d[j]));
      x = s;
    }
    const A var = row_dot(x, x, H) / static_cast<A>(H);
    const A rs = A(1) / std::sqrt(var + static_cast<A>(eps));
    rstd[r] = rs;
    T* yr = y + r * H;
    for (int64_t j = 0; j < H; ++j)
      yr[j] = static_cast<T>(static_cast<A>(w[j]) * round_to<T>(static_cast<A>(x[j]) * rs));
  }
}

// One block of rows: dx (plus `ds`, the gradient arriving at the residual sum, when given) and
// this block's share of dw.
template <typename T>
void rms_backward_rows(const T* dy, const T* x, const T* w, const Acc<T>* rstd, const T* ds, T* dx,
                       Acc<T>* dw_part, int64_t begin, int64_t end, int64_t H) {
  using A = Acc<T>;
  std::vector<A> dc(static_cast<size_t>(H));
  for (int64_t r = begin; r < end; ++r) {
    const T* dyr = dy + r * H;
    const T* xr = x + r * H;
    const A rs = rstd[r];
    A lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j < H; ++j) {
      // The unfused graph: y = w * c, c = round(x * rs); dc = round(dy * w); dw += dy * c.
      const A xhat = static_cast<A>(xr[j]) * rs;
      dc[j] = round_to<T>(static_cast<A>(dyr[j]) * static_cast<A>(w[j]));
      if (dw_part) dw_part[j] += static_cast<A>(dyr[j]) * round_to<T>(xhat);
      lanes[j & 7] += dc[j] * xhat;
    }
    const A dot = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                  ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    const A k = dot / static_cast<A>(H);
    if (!dx) continue;
    T* dxr = dx + r * H;
    const T* dsr = ds ? ds + r * H : nullptr;
    for (j = 0; j < H; ++j) {
      const A g = round_to<T>(rs * (dc[j] - static_cast<A>(xr[j]) * rs * k));
      dxr[j] = static_cast<T>(dsr ? static_cast<A>(dsr[j]) + g : g);
    }
  }
}

struct RmsOut {
  at::Tensor sum, y, rstd;
};

RmsOut rms_forward(const at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, double eps) {
  const int64_t H = h.size(-1);
  const int64_t rows = H == 0 ? 0 : h.numel() / H;
  RmsOut o;
  o.y = at::empty_like(h, at::MemoryFormat::Contiguous);
  if (delta.defined()) o.sum = at::empty_like(h, at::MemoryFormat::Contiguous);
  const at::ScalarType acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  o.rstd = at::empty({rows}, h.options().dtype(acc));
  if (h.is_cuda()) {
    cuda::api().rms_norm_forward(h.get_device(), element_type(h), h.const_data_ptr(),
                                 delta.defined() ? delta.const_data_ptr() : nullptr,
                                 delta.defined() ? o.sum.data_ptr() : nullptr, w.const_data_ptr(),
                                 o.y.data_ptr(), o.rstd.data_ptr<float>(), rows, H,
                                 static_cast<float>(eps));
    return o;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "fused_rms_norm", [&] {
    using T = scalar_t;
    const T* hp = h.const_data_ptr<T>();
    const T* dp = delta.defined() ? delta.const_data_ptr<T>() : nullptr;
    T* sp = delta.defined() ? o.sum.data_ptr<T>() : nullptr;
    const T* wp = w.const_data_ptr<T>();
    T* yp = o.y.data_ptr<T>();
    Acc<T>* rp = o.rstd.data_ptr<Acc<T>>();
    at::parallel_for(
        0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(H, 1)),
        [&](int64_t b, int64_t e) { rms_forward_rows<T>(hp, dp, sp, wp, yp, rp, b, e, H, eps); });
  });
  return o;
}

// dx (with ds added when defined) and dw (undefined unless want_dw).
std::pair<at::Tensor, at::Tensor> rms_backward(const at::Tensor& dy_in, const at::Tensor& x,
                                               const at::Tensor& w, const at::Tensor& rstd,
                                               const at::Tensor& ds_in, bool want_dx,
                                               bool want_dw) {
  const at::Tensor dy = dy_in.contiguous();
  const at::Tensor ds = ds_in.defined() ? ds_in.contiguous() : at::Tensor();
  const int64_t H = x.size(-1);
  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  const Blocks blocks = blocks_of(rows);
  at::Tensor dx = want_dx ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor parts, dw;
  if (x.is_cuda()) {
    if (want_dw) dw = at::empty({H}, w.options());
    cuda::api().rms_norm_backward(
        x.get_device(), element_type(x), dy.const_data_ptr(), x.const_data_ptr(),
        w.const_data_ptr(), rstd.const_data_ptr<float>(),
        ds.defined() ? ds.const_data_ptr() : nullptr, want_dx ? dx.data_ptr() : nullptr,
        want_dw ? dw.data_ptr() : nullptr, rows, H);
    return {dx, dw};
  }
  if (want_dw) parts = at::zeros({blocks.count, H}, rstd.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "fused_rms_norm_backward", [&] {
        using T = scalar_t;
        using A = Acc<T>;
        const T* dyp = dy.const_data_ptr<T>();
        const T* xp = x.const_data_ptr<T>();
        const T* wp = w.const_data_ptr<T>();
        const A* rp = rstd.const_data_ptr<A>();
        const T* dsp = ds.defined() ? ds.const_data_ptr<T>() : nullptr;
        T* dxp = want_dx ? dx.data_ptr<T>() : nullptr;
        A* pp = want_dw ? parts.data_ptr<A>() : nullptr;
        at::parallel_for(0, blocks.count, 1, [&](int64_t b, int64_t e) {
          for (int64_t blk = b; blk < e; ++blk) {
            const int64_t r0 = blk * blocks.rows_per_block;
            const int64_t r1 = std::min(rows, r0 + blocks.rows_per_block);
            rms_backward_rows<T>(dyp, xp, wp, rp, dsp, dxp, pp ? pp + blk * H : nullptr, r0, r1, H);
          }
        });
        if (want_dw) {
          dw = at::empty({H}, w.options());
          T* dwp = dw.data_ptr<T>();
          at::parallel_for(0, H, std::max<int64_t>(1, kGrain / std::max<int64_t>(blocks.count, 1)),
                           [&](int64_t b, int64_t e) {
                             for (int64_t j = b; j < e; ++j) {
                               A s = 0;
                               for (int64_t blk = 0; blk < blocks.count; ++blk)
                                 s += pp[blk * H + j];
                               dwp[j] = static_cast<T>(s);
                             }
                           });
        }
      });
  return {dx, dw};
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  FT_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1) &&
               w.scalar_type() == x.scalar_type() && x.device() == w.device() &&
               (x.is_cpu() || x.is_cuda()),
           "fused_rms_norm: input ", x.sizes(), " ", x.scalar_type(), " and weight ", w.sizes(),
           " ", w.scalar_type(),
           " must be CPU or CUDA tensors of one dtype and device with weight "
           "[hidden]");
}

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    RmsOut o = rms_forward(xc, at::Tensor(), wc, eps);
    ctx->save_for_backward({xc, wc, o.rstd});
    return o.y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [dx, dw] = rms_backward(grads[0], s[0], s[1], s[2], at::Tensor(), ctx->needs_input_grad(0),
                                 ctx->needs_input_grad(1));
    return {dx, dw, at::Tensor()};
  }
};

struct AddRmsNormFn : public torch::autograd::Function<AddRmsNormFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& delta,
                               const at::Tensor& w, double eps) {
    const at::Tensor wc = w.contiguous();
    RmsOut o = rms_forward(h.contiguous(), delta.contiguous(), wc, eps);
    ctx->save_for_backward({o.sum, wc, o.rstd});
    return {o.sum, o.y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const bool want_dx = ctx->needs_input_grad(0) || ctx->needs_input_grad(1);
    at::Tensor dy = grads[1];
    at::Tensor dsum, dw;
    if (dy.defined()) {
      std::tie(dsum, dw) =
          rms_backward(dy, s[0], s[1], s[2], grads[0], want_dx, ctx->needs_input_grad(2));
    } else {
      dsum = grads[0];  // the norm's output unused: only the residual's gradient
    }
    return {ctx->needs_input_grad(0) ? dsum : at::Tensor(),
            ctx->needs_input_grad(1) ? dsum : at::Tensor(), dw, at::Tensor()};
  }
};

}  // namespace

cuda::ElementType cuda_element_type(const at::Tensor& t) { return element_type(t); }

std::pair<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight,
                                                   double eps) {
  check_norm_args(x, weight);
  RmsOut o = rms_forward(x.contiguous(), at::Tensor(), weight.contiguous(), eps);
  return {o.y, o.rstd};
}

std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                    const at::Tensor& weight,
                                                    const at::Tensor& rstd, bool want_dx,
                                                    bool want_dw) {
  return rms_backward(dy, x, weight.contiguous(), rstd, at::Tensor(), want_dx, want_dw);
}

namespace {

// ---- SwiGLU -------------------------------------------------------------------------------------

// y = silu(g) * u over n elements (each element on its own: the same bits wherever a range
// begins).
template <typename T>
void swiglu_range(const T* gp, const T* upp, T* yp, int64_t n) {
  using A = Acc<T>;
  if (swiglu_forward_vec(gp, upp, yp, n)) return;
  for (int64_t i = 0; i < n; ++i) {
    const A x = static_cast<A>(gp[i]);
    const A silu = round_to<T>(x / (A(1) + exp_acc(-x)));
    yp[i] = static_cast<T>(silu * static_cast<A>(upp[i]));
  }
}

// dg and du (either may be null) of swiglu_range for dy over n elements.
template <typename T>
void swiglu_backward_range(const T* gp, const T* upp, const T* dyp, T* dgp, T* dup, int64_t n) {
  using A = Acc<T>;
  if (swiglu_backward_vec(gp, upp, dyp, dgp, dup, n)) return;
  for (int64_t i = 0; i < n; ++i) {
    const A x = static_cast<A>(gp[i]);
    const A one_plus = A(1) + exp_acc(-x);
    const A sig = A(1) / one_plus;
    const A d = static_cast<A>(dyp[i]);
    // The unfused graph: y = s * up, s = silu(x) = x / (1 + e^-x): ds = round(dy * up),
    // dup = dy * s, dx = ds * sig * (1 + x * (1 - sig)) (ATen's silu_backward).
    if (dup) dup[i] = static_cast<T>(d * round_to<T>(x / one_plus));
    if (dgp) {
      const A ds = round_to<T>(d * static_cast<A>(upp[i]));
      dgp[i] = static_cast<T>(ds * sig * (A(1) + x * (A(1) - sig)));
    }
  }
}

void swiglu_cpu(const at::Tensor& g, const at::Tensor& u, at::Tensor& y) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "fused_swiglu", [&] {
    using T = scalar_t;
    const T* gp = g.const_data_ptr<T>();
    const T* upp = u.const_data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, g.numel(), kGrain,
                     [&](int64_t b, int64_t e) { swiglu_range(gp + b, upp + b, yp + b, e - b); });
  });
}

}  // namespace

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor y = at::empty_like(g, at::MemoryFormat::Contiguous);
  if (g.is_cuda()) {
    cuda::api().swiglu(g.get_device(), element_type(g), g.const_data_ptr(), u.const_data_ptr(),
                       nullptr, y.data_ptr(), nullptr, g.numel(), /*backward=*/false);
  } else {
    swiglu_cpu(g, u, y);
  }
  return y;
}

std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& gate, const at::Tensor& up,
                                                  const at::Tensor& dy_in, bool want_g,
                                                  bool want_u) {
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  const at::Tensor dy = dy_in.contiguous();
  at::Tensor dg = want_g ? at::empty_like(g) : at::Tensor();
  at::Tensor du = want_u ? at::empty_like(u) : at::Tensor();
  if (g.is_cuda()) {
    cuda::api().swiglu(g.get_device(), element_type(g), g.const_data_ptr(), u.const_data_ptr(),
                       dy.const_data_ptr(), want_g ? dg.data_ptr() : nullptr,
                       want_u ? du.data_ptr() : nullptr, g.numel(), /*backward=*/true);
    return {dg, du};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, g.scalar_type(), "fused_swiglu_backward", [&] {
        using T = scalar_t;
        const T* gp = g.const_data_ptr<T>();
        const T* upp = u.const_data_ptr<T>();
        const T* dyp = dy.const_data_ptr<T>();
        T* dgp = want_g ? dg.data_ptr<T>() : nullptr;
        T* dup = want_u ? du.data_ptr<T>() : nullptr;
        at::parallel_for(0, g.numel(), kGrain, [&](int64_t b, int64_t e) {
          swiglu_backward_range(gp + b, upp + b, dyp + b, dgp ? dgp + b : nullptr,
                                dup ? dup + b : nullptr, e - b);
        });
      });
  return {dg, du};
}

// silu(gate) * up on the halves of each row of y [rows, 2I] (gate first), row by row: each
// element as swiglu_range computes it, so fused_swiglu's bits.
at::Tensor swiglu_packed_forward(const at::Tensor& y) {
  const int64_t I = y.size(-1) / 2, rows = y.numel() / std::max<int64_t>(2 * I, 1);
  std::vector<int64_t> shape = y.sizes().vec();
  shape.back() = I;
  at::Tensor m = at::empty(shape, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "swiglu_packed", [&] {
    using T = scalar_t;
    const T* yp = y.const_data_ptr<T>();
    T* mp = m.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(I, 1)),
                     [&](int64_t b, int64_t e) {
                       for (int64_t r = b; r < e; ++r)
                         swiglu_range(yp + r * 2 * I, yp + r * 2 * I + I, mp + r * I, I);
                     });
  });
  return m;
}

at::Tensor swiglu_packed_backward(const at::Tensor& y, const at::Tensor& dm_in) {
  const at::Tensor dm = dm_in.contiguous();
  const int64_t I = y.size(-1) / 2, rows = y.numel() / std::max<int64_t>(2 * I, 1);
  at::Tensor dy = at::empty_like(y);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, y.scalar_type(), "swiglu_packed_bw", [&] {
        using T = scalar_t;
        const T* yp = y.const_data_ptr<T>();
        const T* dmp = dm.const_data_ptr<T>();
        T* dyp = dy.data_ptr<T>();
        at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(I, 1)),
                         [&](int64_t b, int64_t e) {
                           for (int64_t r = b; r < e; ++r)
                             swiglu_backward_range(yp + r * 2 * I, yp + r * 2 * I + I, dmp + r * I,
                                                   dyp + r * 2 * I, dyp + r * 2 * I + I, I);
                         });
      });
  return dy;
}

namespace {

struct SwiGluFn : public torch::autograd::Function<SwiGluFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const at::Tensor g = gate.contiguous(), u = up.contiguous();
    ctx->save_for_backward({g, u});
    return swiglu_forward(g, u);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [dg, du] =
        swiglu_backward(s[0], s[1], grads[0], ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    return {dg, du};
  }
};

// swiglu_packed_forward with autograd: y's gradient as one [..., 2I] tensor.
struct SwiGluPackedFn : public torch::autograd::Function<SwiGluPackedFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& packed) {
    const at::Tensor y = packed.contiguous();
    ctx->save_for_backward({y});
    return swiglu_packed_forward(y);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {swiglu_packed_backward(ctx->get_saved_variables()[0], grads[0])};
  }
};

// ---- Rotary embedding ---------------------------------------------------------------------------

// out = x * c + rotate_half(x) * s per head, rotate_half(x) = [-x2, x1]; each product rounded to T
// as the unfused path stores it. With `backward`, the transposed map: dx = dy * c + rotate_half^T
// (dy * s), rotate_half^T(z) = [z2, -z1].
template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
               int64_t hd, bool backward) {
  using A = Acc<T>;
  const int64_t half = hd / 2;
  at::parallel_for(
      0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(heads * hd, 1)),
      [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const T* c = cos + r * hd;
          const T* s = sin + r * hd;
          for (int64_t h = 0; h < heads; ++h) {
            const T* xr = x + (r * heads + h) * hd;
            T* o = out + (r * heads + h) * hd;
            for (int64_t j = 0; j < hd; ++j) {
              const A a = round_to<T>(static_cast<A>(xr[j]) * static_cast<A>(c[j]));
              A rot;
              if (!backward)
                rot = j < half ? -static_cast<A>(xr[j + half]) * static_cast<A>(s[j])
                               : static_cast<A>(xr[j - half]) * static_cast<A>(s[j]);
              else
                rot = j < half ? static_cast<A>(xr[j + half]) * static_cast<A>(s[j + half])
                               : -(static_cast<A>(xr[j - half]) * static_cast<A>(s[j - half]));
              o[j] = static_cast<T>(a + round_to<T>(rot));
            }
          }
        }
      });
}

}  // namespace

at::Tensor rope_apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                      bool backward) {
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  const int64_t rows = xc.size(0) * xc.size(1), heads = xc.size(2), hd = xc.size(3);
  if (xc.is_cuda()) {
    cuda::api().rope(xc.get_device(), element_type(xc), xc.const_data_ptr(), cos.const_data_ptr(),
                     sin.const_data_ptr(), out.data_ptr(), rows, heads, hd, backward);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "fused_rope", [&] {
    rope_rows<scalar_t>(xc.const_data_ptr<scalar_t>(), cos.const_data_ptr<scalar_t>(),
                        sin.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, heads, hd,
                        backward);
  });
  return out;
}

namespace {

struct RopeFn : public torch::autograd::Function<RopeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    const at::Tensor c = cos.contiguous(), s = sin.contiguous();
    ctx->save_for_backward({c, s});
    return rope_apply(x, c, s, /*backward=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    return {rope_apply(grads[0], s[0], s[1], /*backward=*/true), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  return RmsNormFn::apply(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& h, const at::Tensor& delta,
                                                     const at::Tensor& weight, double eps) {
  check_norm_args(h, weight);
  FT_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type() &&
               delta.device() == h.device(),
           "fused_add_rms_norm: residual ", h.sizes(), " ", h.scalar_type(), " and update ",
           delta.sizes(), " ", delta.scalar_type(), " differ");
  auto out = AddRmsNormFn::apply(h, delta, weight, eps);
  return {out[0], out[1]};
}

at::Tensor fused_swiglu(const at::Tensor& gate, const at::Tensor& up) {
  FT_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() &&
               gate.device() == up.device() && (gate.is_cpu() || gate.is_cuda()),
           "fused_swiglu: gate ", gate.sizes(), " ", gate.scalar_type(), " and up ", up.sizes(),
           " ", up.scalar_type(), " must be CPU or CUDA tensors of one shape, dtype and device");
  return SwiGluFn::apply(gate, up);
}

at::Tensor fused_swiglu_packed(const at::Tensor& y) {
  FT_CHECK(y.is_cpu() && y.dim() >= 1 && y.size(-1) % 2 == 0, "fused_swiglu_packed: y ", y.sizes(),
           " on ", y.device(),
           " must be a CPU tensor whose last dimension holds gate and up (even)");
  return SwiGluPackedFn::apply(y);
}

at::Tensor fused_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  FT_CHECK(x.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes() &&
               cos.size(0) == x.size(0) && cos.size(1) == x.size(1) && cos.size(2) == x.size(3) &&
               x.size(3) % 2 == 0 && cos.scalar_type() == x.scalar_type() &&
               sin.scalar_type() == x.scalar_type() && x.device() == cos.device() &&
               sin.device() == x.device() && (x.is_cpu() || x.is_cuda()),
           "fused_rope: x ", x.sizes(), " ", x.scalar_type(), ", cos ", cos.sizes(), " ",
           cos.scalar_type(),
           ": want x [B, T, heads, even head_dim], cos/sin [B, T, head_dim] of x's dtype");
  return RopeFn::apply(x, cos, sin);
}

double cross_entropy_rows(at::Tensor& logits, const at::Tensor& targets, bool to_gradient) {
  FT_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
               logits.is_cpu() && targets.dim() == 1 && targets.scalar_type() == at::kLong &&
               targets.size(0) == logits.size(0),
           "cross_entropy_rows takes contiguous fp32 CPU logits [n, V] and int64 targets [n], got ",
           logits.sizes(), " ", logits.scalar_type(), " and ", targets.sizes(), " ",
           targets.scalar_type());
  const int64_t n = logits.size(0), V = logits.size(1);
  const at::Tensor t = targets.contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  float* xp = logits.data_ptr<float>();
  std::vector<double> row_loss(static_cast<size_t>(n), 0.0);
  at::parallel_for(0, n, std::max<int64_t>(1, kGrain / std::max<int64_t>(V, 1)),
                   [&](int64_t b, int64_t e) {
                     for (int64_t r = b; r < e; ++r) {
                       float* x = xp + r * V;
                       const int64_t target = tp[r];
                       if (target == kIgnoreIndex) {
                         if (to_gradient) std::fill(x, x + V, 0.0f);
                         continue;
                       }
                       FT_CHECK(target >= 0 && target < V, "label ", target,
                                " is outside the vocabulary of ", V, " tokens");
                       const float m = row_max_f32(x, V);
                       const float s = row_sum_exp_f32(x, V, m);
                       const double log_s = std::log(static_cast<double>(s));
                       row_loss[static_cast<size_t>(r)] =
                           (static_cast<double>(m) - static_cast<double>(x[target])) + log_s;
                       if (to_gradient) {
                         row_softmax_f32(x, V, m, static_cast<float>(log_s));
                         x[target] -= 1.0f;
                       }
                     }
                   });
  double sum = 0;  // in row order: the same bits for any thread count
  for (const double v : row_loss) sum += v;
  return sum;
}

bool fuses_on_device(const at::Tensor& x) { return x.is_cpu() || x.is_cuda(); }

at::Tensor gated_product(const at::Tensor& gate, const at::Tensor& up, bool gelu_tanh, bool fused) {
  if (gelu_tanh) return at::gelu(gate, "tanh") * up;
  return fused && fuses_on_device(gate) ? fused_swiglu(gate.contiguous(), up.contiguous())
                                        : at::silu(gate) * up;
}

at::Tensor gated_product_packed(const at::Tensor& y, bool gelu_tanh, bool fused) {
  if (fused && !gelu_tanh && y.is_cpu()) return fused_swiglu_packed(y);
  const int64_t n = y.size(-1) / 2;
  return gated_product(y.narrow(-1, 0, n), y.narrow(-1, n, n), gelu_tanh, fused);
}

}  // namespace ft::model

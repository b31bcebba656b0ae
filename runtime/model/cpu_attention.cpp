#include "model/cpu_attention.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "model/attention.h"
#include "model/exp_f32.h"
#include "model/host_blas.h"

namespace ft::model {

namespace {

// Queries per block: the rows of each product (of each head's in backward, which stacks two heads:
// backward_heads). 64 keeps a block's scores and their gradient (2 x 64 x Tk floats) in the L2
// cache up to Tk = 2048, and wastes little of the diagonal blocks' work under the causal mask; 32,
// 128 and 256 were no faster at T = 512 and 2048 (bench/cpu_attention).
constexpr int64_t kQueryBlock = 64;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- Row loops (vectorized per CPU, a fixed order of every sum) ------------------------------

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) void
row_add_f32(float* __restrict__ x, const float* __restrict__ b, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] += b[j];
}

// p <- e^((s - m) - log_s) (the forward's probabilities, bit for bit), ds <- p (dp - di).
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) void
row_softmax_grad_f32(float* __restrict__ p, float* __restrict__ ds, int64_t n, float m, float log_s,
                     float di) {
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp_f32((p[j] - m) - log_s);
    p[j] = e;
    ds[j] = e * (ds[j] - di);
  }
}

// sum of a[j] b[j] in 16 lanes summed pairwise.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("tree-vectorize"))) float
row_dot_f32(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float lanes[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += a[j + l] * b[j + l];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  float s = lanes[0];
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

void fill_zero(float* x, int64_t n) {
  if (n > 0) std::memset(x, 0, static_cast<size_t>(n) * sizeof(float));
}

// ---- Geometry -----------------------------------------------------------------------------------

// A [B, T, heads, hd] fp32 tensor with a contiguous head dimension: row (b, t, h).
struct Rows {
  float* base = nullptr;
  int64_t sb = 0, st = 0, sh = 0;
  float* at(int64_t b, int64_t t, int64_t h) const { return base + b * sb + t * st + h * sh; }
};

Rows rows_of(const at::Tensor& t) {
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}

// The additive bias [B or 1, 1, Tq, Tk]: query i's row of batch b (nullptr when none).
struct Bias {
  const float* base = nullptr;
  int64_t sb = 0, sq = 0;
  const float* row(int64_t b, int64_t i) const { return base ? base + b * sb + i * sq : nullptr; }
};

Bias bias_of(const at::Tensor& bias) {
  if (!bias.defined()) return {};
  return {bias.data_ptr<float>(), bias.size(0) == 1 ? 0 : bias.stride(0), bias.stride(2)};
}

struct Geometry {
  int64_t B = 0, Tq = 0, Tk = 0, H = 0, KV = 0, D = 0;
  bool causal = false;
  float scale = 1.0f;
  int64_t blocks() const { return (Tq + kQueryBlock - 1) / kQueryBlock; }
  // Keys [0, limit(i)) are the ones query i sees.
  int64_t limit(int64_t i) const {
    return causal ? std::clamp<int64_t>(i + 1 + Tk - Tq, 0, Tk) : Tk;
  }
};

Geometry geometry_of(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  Geometry g;
  g.B = q.size(0);
  g.Tq = q.size(1);
  g.H = q.size(2);
  g.D = q.size(3);
  g.Tk = k.size(1);
  g.KV = k.size(2);
  g.causal = causal;
  g.scale = static_cast<float>(scale);
  return g;
}

// t with a contiguous head dimension, and strides within sgemm_'s int.
at::Tensor with_rows(const at::Tensor& t) {
  const bool fits = t.stride(0) <= INT32_MAX && t.stride(1) <= INT32_MAX;
  return t.stride(3) == 1 && fits ? t : t.contiguous();
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  FT_ASSERT(host_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc),
            "cpu_attention: LibTorch exports no sgemm_");
}

// The block of queries [i0, i1) of head h: scores against keys [0, kend) into s ([i1 - i0, kend]),
// scaled, the bias added on each row's visible keys.
void block_scores(const Geometry& g, const Rows& q, const Rows& k, const Bias& bias, int64_t b,
                  int64_t h, int64_t i0, int64_t i1, int64_t kend, float* s) {
  const int64_t kv = h / (g.H / g.KV);
  gemm(false, true, i1 - i0, kend, g.D, g.scale, q.at(b, i0, h), q.st, k.at(b, 0, kv), k.st, 0.0f,
       s, kend);
  if (!bias.base) return;
  for (int64_t i = i0; i < i1; ++i) row_add_f32(s + (i - i0) * kend, bias.row(b, i), g.limit(i));
}

// ---- Forward ------------------------------------------------------------------------------------

// One block of queries of head h: softmax rows in s, the output rows, stats [Tq, 2] of (b, h).
void forward_block(const Geometry& g, const Rows& q, const Rows& k, const Rows& v, const Rows& o,
                   const Bias& bias, float* stats, int64_t b, int64_t h, int64_t i0, float* s) {
  const int64_t i1 = std::min(i0 + kQueryBlock, g.Tq), kend = g.limit(i1 - 1);
  if (kend == 0) {
    for (int64_t i = i0; i < i1; ++i) {
      fill_zero(o.at(b, i, h), g.D);
      stats[2 * i] = kNegInf;
      stats[2 * i + 1] = 0.0f;
    }
    return;
  }
  block_scores(g, q, k, bias, b, h, i0, i1, kend, s);
  for (int64_t i = i0; i < i1; ++i) {
    float* row = s + (i - i0) * kend;
    const int64_t n = g.limit(i);
    const float m = n > 0 ? row_max_f32(row, n) : kNegInf;
    float log_s = 0.0f;
    if (m == kNegInf) {  // no key seen (or all masked): zeros
      fill_zero(row, kend);
    } else {
      log_s = std::log(row_sum_exp_f32(row, n, m));
      row_softmax_f32(row, n, m, log_s);
      fill_zero(row + n, kend - n);
    }
    stats[2 * i] = m;
    stats[2 * i + 1] = log_s;
  }
  const int64_t kv = h / (g.H / g.KV);
  gemm(false, false, i1 - i0, g.D, kend, 1.0f, s, kend, v.at(b, 0, kv), v.st, 0.0f, o.at(b, i0, h),
       o.st);
}

// ---- Backward -----------------------------------------------------------------------------------

struct Grads {
  Rows dq, dk, dv;
};

// Query heads whose blocks go through backward's products together: two heads of one key-value
// head, their rows stacked (products of 2 x 64 rows, and dV's and dK's sums over 128 rows rather
// than two of 64: fuller products on this size), one where a key-value head has an odd number.
int64_t backward_heads(const Geometry& g) {
  return (g.H / std::max<int64_t>(g.KV, 1)) % 2 == 0 ? 2 : 1;
}

// A backward task's buffers: the stacked scores and their gradient [hg x kQueryBlock, Tk], and
// the stacked rows of q, dout and dq [hg x kQueryBlock, D].
struct Scratch {
  std::vector<float> s, ds, q, dout, dq;
  Scratch(const Geometry& g, int64_t hg) {
    const auto rows = static_cast<size_t>(hg * kQueryBlock);
    s.resize(rows * static_cast<size_t>(g.Tk));
    ds.resize(s.size());
    q.resize(rows * static_cast<size_t>(g.D));
    dout.resize(q.size());
    dq.resize(q.size());
  }
};

// One block of queries of heads [h0, h0 + hg) (one key-value head's): dq's rows; dk's and dv's
// rows [0, kend) added into. Stacked row r * bq + (i - i0) is query i of head h0 + r.
void backward_block(const Geometry& g, const Rows& q, const Rows& k, const Rows& v, const Rows& o,
                    const Rows& dout, const Bias& bias, const float* stats, const Grads& d,
                    int64_t b, int64_t h0, int64_t hg, int64_t i0, Scratch& w) {
  const int64_t i1 = std::min(i0 + kQueryBlock, g.Tq), kend = g.limit(i1 - 1), bq = i1 - i0;
  const int64_t kv = h0 / (g.H / g.KV), M = hg * bq, D = g.D;
  const size_t row_bytes = static_cast<size_t>(D) * sizeof(float);
  if (kend == 0) {
    for (int64_t r = 0; r < hg; ++r)
      for (int64_t i = i0; i < i1; ++i) fill_zero(d.dq.at(b, i, h0 + r), D);
    return;
  }
  for (int64_t r = 0; r < hg; ++r)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = r * bq + (i - i0);
      std::memcpy(w.q.data() + row * D, q.at(b, i, h0 + r), row_bytes);
      std::memcpy(w.dout.data() + row * D, dout.at(b, i, h0 + r), row_bytes);
    }
  float *s = w.s.data(), *ds = w.ds.data();
  // S = scale Q K^T (+ bias), dP = dO V^T
  gemm(false, true, M, kend, D, g.scale, w.q.data(), D, k.at(b, 0, kv), k.st, 0.0f, s, kend);
  if (bias.base)
    for (int64_t r = 0; r < hg; ++r)
      for (int64_t i = i0; i < i1; ++i)
        row_add_f32(s + (r * bq + i - i0) * kend, bias.row(b, i), g.limit(i));
  gemm(false, true, M, kend, D, 1.0f, w.dout.data(), D, v.at(b, 0, kv), v.st, 0.0f, ds, kend);
  for (int64_t r = 0; r < hg; ++r) {
    const float* st = stats + (h0 + r) * g.Tq * 2;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = r * bq + (i - i0);
      float *p = s + row * kend, *dp = ds + row * kend;
      const int64_t n = g.limit(i);
      const float m = st[2 * i];
      if (m == kNegInf) {
        fill_zero(p, kend);
        fill_zero(dp, kend);
        continue;
      }
      const float di = row_dot_f32(w.dout.data() + row * D, o.at(b, i, h0 + r), D);
      row_softmax_grad_f32(p, dp, n, m, st[2 * i + 1], di);
      fill_zero(p + n, kend - n);
      fill_zero(dp + n, kend - n);
    }
  }
  // dV += P^T dO, dQ = scale dS K, dK += scale dS^T Q
  gemm(true, false, kend, D, M, 1.0f, s, kend, w.dout.data(), D, 1.0f, d.dv.at(b, 0, kv), d.dv.st);
  gemm(false, false, M, D, kend, g.scale, ds, kend, k.at(b, 0, kv), k.st, 0.0f, w.dq.data(), D);
  gemm(true, false, kend, D, M, g.scale, ds, kend, w.q.data(), D, 1.0f, d.dk.at(b, 0, kv), d.dk.st);
  for (int64_t r = 0; r < hg; ++r)
    for (int64_t i = i0; i < i1; ++i)
      std::memcpy(d.dq.at(b, i, h0 + r), w.dq.data() + (r * bq + i - i0) * D, row_bytes);
}

// The bias in its additive fp32 form (a bool mask through attention_bias).
at::Tensor additive(const at::Tensor& bias) {
  if (!bias.defined() || bias.scalar_type() != at::kBool) return bias;
  return attention_bias(bias, at::kFloat);
}

struct CpuAttentionFn : public torch::autograd::Function<CpuAttentionFn> {
  // q [B, Tq, H, hd], k, v [B, Tk, KV, hd]; the bias through a pointer (an undefined tensor is
  // no input of a custom function).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor* bias,
                            bool causal, double scale) {
    CpuAttention r = cpu_attention_forward(q, k, v, *bias, causal, scale);
    ctx->save_for_backward({q, k, v, r.out, r.stats});
    if (bias->defined()) ctx->saved_data["bias"] = *bias;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return r.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    const auto b = ctx->saved_data.find("bias");
    const at::Tensor bias = b == ctx->saved_data.end() ? at::Tensor() : b->second.toTensor();
    auto [dq, dk, dv] = cpu_attention_backward(grad_out[0], s[0], s[1], s[2], s[3], s[4], bias,
                                               ctx->saved_data["causal"].toBool(),
                                               ctx->saved_data["scale"].toDouble());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool cpu_attention_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& bias) {
  for (const at::Tensor* t : {&q, &k, &v})
    if (!t->is_cpu() || t->scalar_type() != at::kFloat || t->dim() != 4) return false;
  if (k.sizes() != v.sizes() || q.size(0) != k.size(0) || q.size(3) != k.size(3) ||
      k.size(1) == 0 || q.size(1) % k.size(1) != 0)
    return false;
  if (bias.defined() &&
      (!bias.is_cpu() || (bias.scalar_type() != at::kFloat && bias.scalar_type() != at::kBool) ||
       bias.dim() != 4 || (bias.size(0) != 1 && bias.size(0) != q.size(0)) || bias.size(1) != 1 ||
       bias.size(2) != q.size(2) || bias.size(3) != k.size(2)))
    return false;
  return host_sgemm_available();
}

CpuAttention cpu_attention_forward(const at::Tensor& q_in, const at::Tensor& k_in,
                                   const at::Tensor& v_in, const at::Tensor& bias_in, bool causal,
                                   double scale) {
  const at::Tensor q = with_rows(q_in), k = with_rows(k_in), v = with_rows(v_in);
  const at::Tensor bias_t = additive(bias_in);
  const Geometry g = geometry_of(q, k, causal, scale);
  CpuAttention r;
  r.out = at::empty({g.B, g.Tq, g.H, g.D}, q.options());
  r.stats = at::empty({g.B, g.H, g.Tq, 2}, q.options());
  const Rows rq = rows_of(q), rk = rows_of(k), rv = rows_of(v), ro = rows_of(r.out);
  const Bias bias = bias_of(bias_t.defined() ? bias_t.contiguous() : bias_t);
  float* stats = r.stats.data_ptr<float>();
  const int64_t nblk = g.blocks(), tasks = g.B * g.H * nblk;
  if (tasks == 0 || g.D == 0) return r;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(static_cast<size_t>(kQueryBlock * g.Tk));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t blk = t % nblk, h = (t / nblk) % g.H, b = t / (nblk * g.H);
      forward_block(g, rq, rk, rv, ro, bias, stats + (b * g.H + h) * g.Tq * 2, b, h,
                    blk * kQueryBlock, s.data());
    }
  });
  return r;
}

std::array<at::Tensor, 3> cpu_attention_backward(const at::Tensor& grad_out, const at::Tensor& q_in,
                                                 const at::Tensor& k_in, const at::Tensor& v_in,
                                                 const at::Tensor& out, const at::Tensor& stats,
                                                 const at::Tensor& bias_in, bool causal,
                                                 double scale) {
  const at::Tensor q = with_rows(q_in), k = with_rows(k_in), v = with_rows(v_in);
  const at::Tensor dout = with_rows(grad_out), o = with_rows(out), st = stats.contiguous();
  const at::Tensor bias_t = additive(bias_in);
  const Bias bias = bias_of(bias_t.defined() ? bias_t.contiguous() : bias_t);
  const Geometry g = geometry_of(q, k, causal, scale);
  at::Tensor dq = at::empty({g.B, g.Tq, g.H, g.D}, q.options());
  at::Tensor dk = at::zeros({g.B, g.Tk, g.KV, g.D}, q.options());
  at::Tensor dv = at::zeros({g.B, g.Tk, g.KV, g.D}, q.options());
  const Rows rq = rows_of(q), rk = rows_of(k), rv = rows_of(v), ro = rows_of(o),
             rdo = rows_of(dout);
  const Grads d{rows_of(dq), rows_of(dk), rows_of(dv)};
  const float* s0 = st.data_ptr<float>();
  const int64_t nblk = g.blocks(), rep = g.H / std::max<int64_t>(g.KV, 1), tasks = g.B * g.KV;
  if (tasks == 0 || g.Tq == 0 || g.D == 0) return {dq.zero_(), dk, dv};
  const int64_t hg = backward_heads(g);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch w(g, hg);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t kv = t % g.KV, b = t / g.KV;
      for (int64_t h0 = kv * rep; h0 < (kv + 1) * rep; h0 += hg)
        for (int64_t blk = 0; blk < nblk; ++blk)
          backward_block(g, rq, rk, rv, ro, rdo, bias, s0 + b * g.H * g.Tq * 2, d, b, h0, hg,
                         blk * kQueryBlock, w);
    }
  });
  return {dq, dk, dv};
}

at::Tensor cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& bias, bool causal, double scale) {
  const at::Tensor b = bias.defined() ? additive(bias).detach() : bias;
  return CpuAttentionFn::apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), &b, causal,
                               scale)
      .transpose(1, 2);
}

}  // namespace ft::model

#include "model/sink_nodes.h"

#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "model/cpu_attention.h"
#include "model/fused_ops.h"
#include "model/host_blas.h"

namespace ft::model {

namespace {

// Whether product() below writes into a zero-filled result: fp32 on the CPU, where the matrix
// products are MKL's sgemm.
bool zeroed_product(const at::Tensor& a) { return a.is_cpu() && a.scalar_type() == at::kFloat; }

// a @ b for 2-D operands. In fp32 on the CPU the product is added (beta 1) into a zero-filled
// result: MKL's sgemm with beta 0 first scales its output by zero in a pass of its own
// (mkl_blas_def_sgemm_mscale, 3% of the overhead-bound model's samples), slower than a memset, and
// the bits are the same (each element is 0 + the same sum; model_test checks them against
// autograd's products). 3-8% less per product of 64 tokens at d=256 (docs/performance-log.md). The
// product goes straight to sgemm_ (host_blas.h: the same call at::addmm_ makes, without the
// dispatcher), at::addmm_ where it cannot.
at::Tensor product(const at::Tensor& a, const at::Tensor& b) {
  if (!zeroed_product(a)) return a.mm(b);
  at::Tensor y = host_zeros(a.size(0), b.size(1), a.options());
  if (!host_addmm(y, a, b)) y.addmm_(a, b);
  return y;
}

// into += a @ b: a weight's gradient into its sink.
void add_product(const at::Tensor& into, const at::Tensor& a, const at::Tensor& b) {
  if (!host_addmm(into, a, b)) into.addmm_(a, b);
}

// y = x W^T whose backward adds W's gradient into the strategy's accumulator (UnitHooks::grad_sink)
// by one addmm: no product of its own, no AccumulateGrad, no hook adding it afterwards (one
// weight-sized buffer and one pass over it fewer per weight and micro-batch). The forward and the
// input's gradient have at::linear's bits (through product() in fp32 on the CPU).
struct SinkLinearFn : public torch::autograd::Function<SinkLinearFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const at::Tensor& into, UnitHooks* hooks,
                            int64_t id) {
    ctx->save_for_backward({x, w});
    save_grad_sink(ctx, hooks, {into, id});
    if (!zeroed_product(x)) return at::linear(x, w);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w.size(0);
    return product(x.reshape({-1, x.size(-1)}), w.t()).view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor g2 = grad_out[0].reshape({-1, grad_out[0].size(-1)});
    at::Tensor gx;
    if (ctx->needs_input_grad(0)) gx = product(g2, w).view(x.sizes());
    const SavedGradSink sink = saved_grad_sink(ctx);
    add_product(sink.into, g2.t(), x.reshape({-1, x.size(-1)}));
    sink.done();
    return {gx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The saved_data keys of a sink in slot `slot` (0-3): into, hooks, id. Built once, not per call.
enum SinkField { kSinkInto = 0, kSinkHooks = 1, kSinkId = 2 };
const std::string& sink_key(SinkField field, int slot) {
  static const auto* keys = [] {
    auto* k = new std::array<std::array<std::string, 4>, 3>;
    const char* names[3] = {"sink_into", "sink_hooks", "sink_id"};
    for (int f = 0; f < 3; ++f)
      for (int s = 0; s < 4; ++s)
        (*k)[f][s] = s == 0 ? std::string(names[f]) : names[f] + std::to_string(s);
    return k;
  }();
  FT_ASSERT(slot >= 0 && slot < 4, "gradient sink slot ", slot, " out of 0-3");
  return (*keys)[field][slot];
}

// The weight gradient of slot `slot`'s sink, grad^T x, added into it and reported.
void sink_product(torch::autograd::AutogradContext* ctx, int slot, const at::Tensor& grad,
                  const at::Tensor& x) {
  const SavedGradSink sink = saved_grad_sink(ctx, slot);
  add_product(sink.into, grad.t(), x);
  sink.done();
}

// Nodes of several ops for a layer whose linear weights all sink their gradients (replicated fp32
// groups on the CPU, no bias, no LoRA): the products and fused kernels of the separate nodes, in
// the same order and on the same operands, so the same bits (model_test compares every gradient
// with the separate nodes' bit for bit), without a dozen nodes' bookkeeping per layer, their
// views, and the weights' AccumulateGrad nodes
// (the weights come in detached; their gradients go to the sinks). The input's gradient is summed
// in the order autograd's engine sums it (it runs the node created last first).

// down(act(gate(x)) * up(x)), act silu (SwiGLU, by the fused kernel) or, with `gelu`, tanh-GELU
// (GeGLU: at::gelu and at::gelu_backward, the unfused path's ops). Backward: down, the activation
// and product, up, gate; x's gradient up's + gate's.
struct SinkMlpFn : public torch::autograd::Function<SinkMlpFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                            bool gelu, UnitHooks* hooks,
                            const std::array<UnitHooks::GradSink, 3>* sinks) {
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    const at::Tensor gate = product(x2, wg.t()), up = product(x2, wu.t());
    // GeGLU keeps gelu(gate) for up's gradient, as the unfused product's node does.
    const at::Tensor act = gelu ? at::gelu(gate, "tanh") : at::Tensor();
    const at::Tensor m = gelu ? act * up : swiglu_forward(gate, up);
    ctx->save_for_backward({x2, gate, up, m, wg, wu, wd, act});
    for (int i = 0; i < 3; ++i) save_grad_sink(ctx, hooks, (*sinks)[static_cast<size_t>(i)], i);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = wd.size(0);
    return product(m, wd.t()).view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &x2 = s[0], &gate = s[1], &up = s[2], &m = s[3];
    const at::Tensor &wg = s[4], &wu = s[5], &wd = s[6], &act = s[7];
    const at::Tensor g2 = grad_out[0].reshape({-1, grad_out[0].size(-1)});
    const at::Tensor gm = product(g2, wd);
    sink_product(ctx, 2, g2, m);
    // (autograd's MulBackward0 and GeluBackward0 for GeGLU: gm * up, gm * gelu(gate))
    const auto [dgate, dup] = act.defined()
                                  ? std::pair{at::gelu_backward(gm * up, gate, "tanh"), gm * act}
                                  : swiglu_backward(gate, up, gm, true, true);
    at::Tensor gx = product(dup, wu);
    sink_product(ctx, 1, dup, x2);
    gx.add_(product(dgate, wg));
    sink_product(ctx, 0, dgate, x2);
    torch::autograd::variable_list grads(7);
    grads[0] = gx.view(grad_out[0].sizes());
    return grads;
  }
};

// o(attention(rope(q(x)), rope(k(x)), v(x))): ft's host attention (model/cpu_attention.h), as
// attend() runs it for these inputs (grouped-query heads included); causal, or under a packed
// batch's mask in the 0 / -inf form hidden_states makes of it on the CPU.
// With q/k norm weights (Qwen3, Gemma 3: RMSNorm per head before the rotation; Gemma's 1 + w
// already added by the caller) their kernels run between the product and the rotation, and the
// weights' gradients go back through autograd as the fused norm's would.
// Backward: o, attention, then v, k, q; x's gradient (v's + k's) + q's.
struct SinkAttentionFn : public torch::autograd::Function<SinkAttentionFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& wq, const at::Tensor& wk, const at::Tensor& wv,
                            const at::Tensor& wo, const at::Tensor& cos, const at::Tensor& sin,
                            const c10::optional<at::Tensor>& q_norm,
                            const c10::optional<at::Tensor>& k_norm, const at::Tensor* bias,
                            int64_t head_dim, double scale, double eps, UnitHooks* hooks,
                            const std::array<UnitHooks::GradSink, 4>* sinks) {
    const int64_t B = x.size(0), T = x.size(1);
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    // (Optional inputs: an undefined tensor is no input of a custom function.)
    const at::Tensor wqn = q_norm.value_or(at::Tensor()), wkn = k_norm.value_or(at::Tensor());
    auto heads = [&](const at::Tensor& w) { return product(x2, w.t()).view({B, T, -1, head_dim}); };
    // The heads normed by `wn` when given (their rstd into `rstd`), then rotated.
    auto normed_rotated = [&](const at::Tensor& h, const at::Tensor& wn, at::Tensor& rstd) {
      if (!wn.defined()) return rope_apply(h, cos, sin, /*backward=*/false);
      at::Tensor y;
      std::tie(y, rstd) = rms_norm_forward(h, wn, eps);
      return rope_apply(y, cos, sin, /*backward=*/false);
    };
    const at::Tensor q_pre = heads(wq), k_pre = heads(wk);
    at::Tensor q_rstd, k_rstd;
    const at::Tensor q = normed_rotated(q_pre, wqn, q_rstd);
    const at::Tensor k = normed_rotated(k_pre, wkn, k_rstd);
    const at::Tensor v = heads(wv);
    const bool causal = !bias->defined() && T > 1;
    auto [out, lse] = cpu_attention_forward(q, k, v, *bias, causal, scale);
    const at::Tensor a2 = out.view({B * T, -1});
    // The norms' inputs only where there are norms (else they would be held for nothing).
    const bool qn = wqn.defined(), kn = wkn.defined();
    ctx->save_for_backward({x2, q, k, v, out, lse, a2, wq, wk, wv, wo, cos, sin,
                            qn ? q_pre : at::Tensor(), q_rstd, wqn, kn ? k_pre : at::Tensor(),
                            k_rstd, wkn});
    if (bias->defined()) ctx->saved_data["bias"] = *bias;
    for (int i = 0; i < 4; ++i) save_grad_sink(ctx, hooks, (*sinks)[static_cast<size_t>(i)], i);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return product(a2, wo.t()).view({B, T, wo.size(0)});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &x2 = s[0], &q = s[1], &k = s[2], &v = s[3], &out = s[4], &lse = s[5],
                     &a2 = s[6];
    const at::Tensor &wq = s[7], &wk = s[8], &wv = s[9], &wo = s[10], &cos = s[11], &sin = s[12];
    const auto b = ctx->saved_data.find("bias");
    const at::Tensor bias = b == ctx->saved_data.end() ? at::Tensor() : b->second.toTensor();
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor g2 = grad_out[0].reshape({-1, grad_out[0].size(-1)});
    const at::Tensor ga = product(g2, wo);
    sink_product(ctx, 3, g2, a2);
    auto [gq, gk, gv] =
        cpu_attention_backward(ga.view(q.sizes()), q, k, v, out, lse, bias, causal, scale);
    const int64_t rows = x2.size(0);
    torch::autograd::variable_list grads(15);
    // A head gradient back through the rotation and the norm (its weight's gradient into
    // grads[slot]): [rows, heads * head_dim].
    auto unrotated = [&](const at::Tensor& g, int first, int slot) {
      at::Tensor d = rope_apply(g, cos, sin, /*backward=*/true);
      const at::Tensor &pre = s[static_cast<size_t>(first)],
                       &wn = s[static_cast<size_t>(first + 2)];
      if (wn.defined())
        std::tie(d, grads[static_cast<size_t>(slot)]) =
            rms_norm_backward(d, pre, wn, s[static_cast<size_t>(first + 1)], true,
                              ctx->needs_input_grad(static_cast<size_t>(slot)));
      return d.view({rows, -1});
    };
    const at::Tensor gv2 = gv.view({rows, -1});
    at::Tensor gx = product(gv2, wv);
    sink_product(ctx, 2, gv2, x2);
    const at::Tensor gk2 = unrotated(gk, 16, 8);
    gx.add_(product(gk2, wk));
    sink_product(ctx, 1, gk2, x2);
    const at::Tensor gq2 = unrotated(gq, 13, 7);
    gx.add_(product(gq2, wq));
    sink_product(ctx, 0, gq2, x2);
    grads[0] = gx.view(grad_out[0].sizes());
    return grads;
  }
};

}  // namespace

at::Tensor sink_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& into,
                       UnitHooks* hooks, int64_t id) {
  return SinkLinearFn::apply(x, w, into, hooks, id);
}

at::Tensor sink_mlp(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
                    const at::Tensor& wd, bool gelu, UnitHooks* hooks,
                    const std::array<UnitHooks::GradSink, 3>& sinks) {
  return SinkMlpFn::apply(x, wg, wu, wd, gelu, hooks, &sinks);
}

at::Tensor sink_attention(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wk,
                          const at::Tensor& wv, const at::Tensor& wo, const at::Tensor& cos,
                          const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                          const c10::optional<at::Tensor>& k_norm, const at::Tensor& bias,
                          int64_t head_dim, double scale, double eps, UnitHooks* hooks,
                          const std::array<UnitHooks::GradSink, 4>& sinks) {
  return SinkAttentionFn::apply(x, wq, wk, wv, wo, cos, sin, q_norm, k_norm, &bias, head_dim, scale,
                                eps, hooks, &sinks);
}

// A pointer and an id in the context's saved_data (IValues): the hooks as an integer. Slot n > 0
// keeps a node's n-th sink under keys of its own.

void save_grad_sink(torch::autograd::AutogradContext* ctx, UnitHooks* hooks,
                    const UnitHooks::GradSink& sink, int slot) {
  if (!sink.into.defined()) return;
  ctx->saved_data[sink_key(kSinkInto, slot)] = sink.into;
  ctx->saved_data[sink_key(kSinkHooks, slot)] =
      static_cast<int64_t>(reinterpret_cast<intptr_t>(hooks));
  ctx->saved_data[sink_key(kSinkId, slot)] = sink.id;
}

SavedGradSink saved_grad_sink(torch::autograd::AutogradContext* ctx, int slot) {
  const auto it = ctx->saved_data.find(sink_key(kSinkInto, slot));
  if (it == ctx->saved_data.end()) return {};
  return {it->second.toTensor(),
          reinterpret_cast<UnitHooks*>(
              static_cast<intptr_t>(ctx->saved_data[sink_key(kSinkHooks, slot)].toInt())),
          ctx->saved_data[sink_key(kSinkId, slot)].toInt()};
}

}  // namespace ft::model

// Autograd nodes whose weights' gradients go straight into the strategy's accumulators (gradient
// sinks, model/unit_hooks.h): a linear layer, and a whole MLP or attention block on the CPU in fp32
// where every weight sinks its gradient, with the products and kernels of the separate nodes in
// the same order, so the same bits. Pure functions of their inputs; not thread-safe (one training
// thread, as the model).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>

#include "model/unit_hooks.h"

namespace ft::model {

// x W^T whose backward adds W's gradient into `into` ([out, in]) by one addmm and reports `id`
// sunk; the forward and x's gradient have at::linear's bits.
at::Tensor sink_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& into,
                       UnitHooks* hooks, int64_t id);

// down(act(gate(x)) * up(x)) as one node: act silu (SwiGLU, the fused kernel) or, with `gelu`,
// tanh-GELU; the weights come in detached, their gradients go to `sinks` (gate, up, down).
at::Tensor sink_mlp(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
                    const at::Tensor& wd, bool gelu, UnitHooks* hooks,
                    const std::array<UnitHooks::GradSink, 3>& sinks);

// o(attention(rope(q(x)), rope(k(x)), v(x))) as one node, through ft's host attention
// (model/cpu_attention.h), causal or under `bias` (a packed batch's 0 / -inf mask; undefined:
// none), with the per-head q/k norms when given (their weights attached, through autograd); the
// projections' weights detached, their gradients to `sinks` (q, k, v, o).
at::Tensor sink_attention(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wk,
                          const at::Tensor& wv, const at::Tensor& wo, const at::Tensor& cos,
                          const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                          const c10::optional<at::Tensor>& k_norm, const at::Tensor& bias,
                          int64_t head_dim, double scale, double eps, UnitHooks* hooks,
                          const std::array<UnitHooks::GradSink, 4>& sinks);

}  // namespace ft::model

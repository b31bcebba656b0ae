// The decoder's attention and norm pieces that vary by family (model/family.h), as plain ATen
// functions with autograd: scaled-dot-product attention with an optional soft cap on the scores,
// sliding-window attention computed chunk by chunk of queries (never a T x T mask), the rotary
// embedding over the first rotary_dim of each head, and RMSNorm in its three styles. Each follows
// transformers' op sequence (the function named at each). Stateless; thread-safe.
#pragma once

#include <ATen/ATen.h>

#include "model/family.h"

namespace ft::model {

// softmax(q k^T * scale + mask) v. q [B, H, Tq, hd]; k, v [B, KV, Tk, hd] (KV divides H). mask:
// undefined (causal when `causal`, else none), or bool / additive [B|1, 1, Tq, Tk]. softcap > 0:
// scores -> tanh(s / softcap) * softcap before the mask, by an explicit softmax in fp32 (as
// transformers' eager_attention_forward of Gemma 2; SDPA has no cap). Returns [B, H, Tq, hd].
// `host_kernel` (train.fused_attention): fp32 on the host by model/cpu_attention.h's kernel;
// otherwise, and elsewhere, at::scaled_dot_product_attention.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& mask, bool causal, double scale, double softcap,
                  bool host_kernel);

// A boolean attention mask as at::scaled_dot_product_attention passes it on: 0 where attended
// (true), -inf elsewhere, in `dtype`.
at::Tensor attention_bias(const at::Tensor& mask, at::ScalarType dtype);

// attend() where query i sees key j iff i - W < j <= i (transformers' sliding_window_overlay on
// the causal mask) and, with segment_ids [B, T], only keys of its own segment. Queries go in
// chunks of W, each against the W - 1 keys before it and its own: O(T W) memory and work.
at::Tensor attend_windowed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& segment_ids, int64_t window, double scale,
                           double softcap, bool host_kernel);

// x * cos + rotate_half(x) * sin on the first cos.size(-1) features of each head, the rest
// passed through (transformers' apply_rotary_pos_emb, partial as Phi-3's). x [B, T, H, hd]; cos,
// sin [B, T, rotary_dim] of x's dtype. `fused`: the CPU kernel of model/fused_ops.h.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool fused);

// RMSNorm over the last dimension in the family's style (NormStyle), unfused: transformers'
// LlamaRMSNorm, Olmo2RMSNorm or Gemma3RMSNorm op for op.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, NormStyle style);

}  // namespace ft::model

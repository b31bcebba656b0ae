// Scaled-dot-product attention on the host in fp32, forward and backward, by blocks of queries.
// A block's scores against the keys it may see (under the causal mask: up to its last query, so
// the masked triangle is skipped but for the block's own diagonal part) are one sgemm_
// (model/host_blas.h), the softmax is a row loop of model/exp_f32.h, the values' product one more
// sgemm_. The backward recomputes a block's probabilities from each row's saved maximum and log of
// its sum (no T x T tensor is held) and makes the four products of the gradients. What
// at::_scaled_dot_product_flash_attention_for_cpu computes, with products of whole blocks against
// every key they see rather than its 32-64 query tiles against key tiles (faster at training
// shapes: docs/performance-log.md).
// Threads: the forward over (batch, head, block), the backward over (batch, key-value head), so
// that one thread owns the keys' and values' gradients it adds into. Every sum is in a fixed order
// and each product is made by one thread, so the bits do not depend on the number of threads.
// Stateless; thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <array>

namespace ft::model {

// Whether cpu_attention takes these (its layout: q [B, H, Tq, hd], k, v [B, KV, Tk, hd]): fp32
// CPU tensors, KV dividing H, a bias (when defined) fp32 or bool [B or 1, 1, Tq, Tk], and
// LibTorch exporting sgemm_.
bool cpu_attention_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& bias);

struct CpuAttention {
  at::Tensor out;    // [B, Tq, H, hd], contiguous
  at::Tensor stats;  // [B, H, Tq, 2] fp32: each row's largest score and the log of its sum of
                     // exponentials (for the backward)
};

// softmax(q k^T * scale + bias) v, query i seeing key j iff j <= i + Tk - Tq when `causal`.
// q [B, Tq, H, hd]; k, v [B, Tk, KV, hd]; any strides (copied where the head dimension is not
// contiguous). A query that sees no key gets zeros.
CpuAttention cpu_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& bias, bool causal, double scale);

// The gradients {dq [B, Tq, H, hd], dk, dv [B, Tk, KV, hd]}, contiguous, of cpu_attention_forward
// for grad_out [B, Tq, H, hd] and its saved out and stats.
std::array<at::Tensor, 3> cpu_attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                 const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& out, const at::Tensor& stats,
                                                 const at::Tensor& bias, bool causal, double scale);

// The same with autograd, in at::scaled_dot_product_attention's layout: q [B, H, Tq, hd], k, v
// [B, KV, Tk, hd]; returns [B, H, Tq, hd]. The bias, additive or bool (true: attended), comes in
// without a gradient.
at::Tensor cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& bias, bool causal, double scale);

}  // namespace ft::model

// Fused kernels behind the model's elementwise ops, each a custom autograd function with its own
// forward and backward: RMSNorm (optionally with the residual add before it), SwiGLU and the
// rotary embedding. One pass over the data instead of the unfused path's 4-8 ops, their
// temporaries and autograd nodes; each saves less for backward (SwiGLU keeps its two inputs, not
// three tensors). In every dtype they round where transformers' op sequence rounds (bf16: the
// normalised value before the weight, each product of SwiGLU and RoPE), with fp32 (fp64 for fp64)
// inside, so fp32 results equal the unfused path within rounding of the row sums. CPU kernels:
// threads through at::parallel_for, a fixed order of every sum (the same bits from one process
// to the next and for any thread count); SwiGLU's fp32 loops are vectorized (a copy per vector
// width: AVX-512, AVX2, SSE2) with an exp of their own built from IEEE arithmetic, so a vector
// lane and the scalar tail give the same bits. CUDA tensors (fp32, bf16, fp16) go to the same
// kernels in libft_cuda.so (cuda/kernels.h): compiled everywhere, checked against the unfused ops
// by the gpu test (an H200, 2026-11-27); the model uses them on both.
// Not thread-safe beyond what autograd guarantees.
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "cuda/element_type.h"

namespace ft::model {

// The element type the CUDA kernels (cuda/kernels.h) take for t's dtype: fp32, bf16 or fp16
// (another dtype: ft::Error).
cuda::ElementType cuda_element_type(const at::Tensor& t);

// Whether the fused kernels take tensors on `x`'s device: the CPU's and CUDA's (checked against
// the unfused ops on an H200 by the gpu test's check_fused_kernels, issue 34).
bool fuses_on_device(const at::Tensor& x);

// Which fused kernels the model uses (train.fused_rms_norm, train.fused_swiglu, train.fused_rope,
// train.fused_attention: model/cpu_attention.h's host kernel for fp32 attention on the CPU).
struct FusedOps {
  bool rms_norm = true;
  bool swiglu = true;
  bool rope = true;
  bool attention = true;
};

// weight * x / sqrt(mean(x^2) + eps) over the last dimension. x [..., H], weight [H], same dtype.
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The residual add and the norm after it: returns {h + delta, rms_norm(h + delta)}.
std::pair<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& h, const at::Tensor& delta,
                                                     const at::Tensor& weight, double eps);

// silu(gate) * up, elementwise; gate and up of one shape and dtype.
at::Tensor fused_swiglu(const at::Tensor& gate, const at::Tensor& up);
// A gated MLP's product: gelu_tanh(gate) * up (GeGLU), else silu(gate) * up, through
// fused_swiglu on the CPU when `fused` (the dense MLP's and each expert's).
at::Tensor gated_product(const at::Tensor& gate, const at::Tensor& up, bool gelu_tanh, bool fused);

// fused_swiglu of the two halves of y [..., 2I] (gate, then up: a fused gate_up product's output)
// without splitting it: the same bits, and y's gradient comes back as one [..., 2I] tensor (the
// halves' views would each give a zero-filled [..., 2I] gradient for autograd to add). CPU.
at::Tensor fused_swiglu_packed(const at::Tensor& y);
// gated_product of y's halves: fused_swiglu_packed where fused_swiglu would run on the CPU.
at::Tensor gated_product_packed(const at::Tensor& y, bool gelu_tanh, bool fused);

// The rotary embedding x * cos + rotate_half(x) * sin. x [B, T, heads, head_dim] (any strides),
// cos and sin [B, T, head_dim] of x's dtype, no gradient. Returns a contiguous [B, T, heads, hd].
at::Tensor fused_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The SwiGLU, rotary and RMSNorm kernels without autograd, for a node that runs several of the
// model's ops in one forward and one backward of its own (model/decoder.cpp): the same bits as
// fused_swiglu, fused_rope, fused_rms_norm and their backwards. swiglu_backward returns
// {d gate, d up} (undefined where not wanted); rope_apply with `backward` maps a gradient of its
// output to one of its input; both return contiguous tensors.
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& gate, const at::Tensor& up,
                                                  const at::Tensor& dy, bool want_gate,
                                                  bool want_up);
at::Tensor rope_apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                      bool backward);
// fused_swiglu_packed's kernels (CPU): y [..., 2I] contiguous -> [..., I], and y's gradient
// [..., 2I] from the output's.
at::Tensor swiglu_packed_forward(const at::Tensor& y);
at::Tensor swiglu_packed_backward(const at::Tensor& y, const at::Tensor& dm);
// RMSNorm likewise (fused_rms_norm's kernels): rms_norm_forward returns {y, rstd}, rstd [rows]
// in fp32 (fp64 for fp64); rms_norm_backward {dx, dw} from the forward's input, weight and rstd
// (undefined where not wanted). x contiguous, weight [x.size(-1)] of x's dtype.
std::pair<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight,
                                                   double eps);
std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                    const at::Tensor& weight,
                                                    const at::Tensor& rstd, bool want_dx,
                                                    bool want_dw);

// Cross-entropy of fp32 logit rows, for the LM head's chunks (model/fused_loss.h): one pass for
// each row's maximum, one for its sum of exponentials, and, with to_gradient, one that turns the
// row in place into d(sum of the rows' losses)/d(logits) = softmax - one-hot(target); rows whose
// target is -100 count nothing and become 0. logits [n, V] contiguous fp32 on the CPU, targets
// int64 [n]. Returns the summed loss of the counted rows (each lse - logit[target], in fp64,
// summed in row order: the same bits for any thread count). Replaces logsumexp, gather, the
// softmax's sub and exp, the one-hot scatter and the mask's multiply: 7 passes over the chunk and
// two temporaries as large as it.
constexpr int64_t kIgnoreIndex = -100;
double cross_entropy_rows(at::Tensor& logits, const at::Tensor& targets, bool to_gradient);

}  // namespace ft::model

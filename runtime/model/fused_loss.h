// The LM head and the next-token cross-entropy fused, chunk by chunk of tokens, so that the full
// logits (tokens x vocabulary: 2 GiB in fp32 for 4096 tokens of a 128k vocabulary, and several
// copies of it in the unfused path's upcast, softmax and gradient) are never materialised. The
// forward computes, per chunk, the logits, their log-sum-exp and the loss, and (when a gradient
// is wanted) the gradient of the summed loss with respect to the hidden states and the head's
// weight, accumulated in fp32; the backward scales them by the incoming gradient. Equal to
// causal_lm_loss_sum(at::linear(hidden, weight), labels) within rounding (summation order).
// Not thread-safe (autograd).
#pragma once

#include <ATen/ATen.h>

#include "core/host_alloc.h"
#include "model/decoder.h"

namespace ft::model {

// Logits elements per chunk unless asked otherwise (128 MiB of fp32): the trainer's, the planner's.
inline constexpr int64_t kLossChunkElements = int64_t{1} << 25;
// On a GPU, 1 GiB of fp32 (2093 tokens at a 128k vocabulary): 128 MiB made 261-token chunks whose
// launches, small products and head-gradient additions took 45 ms of a 1B model's 211 ms step on
// an H200 (docs/performance-log.md).
inline constexpr int64_t kLossChunkElementsGpu = int64_t{1} << 28;
inline int64_t loss_chunk_elements(bool gpu) {
  return gpu ? kLossChunkElementsGpu : kLossChunkElements;
}

// hidden [B, T, H] (the final norm's output), weight [V, H] (the LM head), labels [B, T] (shifted
// here, as causal_lm_loss_sum does). `chunk_elements`: logits elements per chunk (tokens per chunk
// = chunk_elements / V, at least 1). `blocks` (CPU only, optional): where the logits chunk and the
// gradients' buffers come from, so that a training loop reuses the same host blocks every step
// instead of mapping and faulting in fresh ones (core/host_alloc.h). `hooks` (optional): asked for
// the head weight's gradient sink (UnitHooks::grad_sink); with one, the backward adds the scaled
// gradient into it in one pass instead of handing it to autograd. The sum: fp32 (fp64 for fp64
// inputs), summed in fp64 on the CPU and rounded once; fp64 for fp32 CPU inputs without gradients
// (evaluation), where the rounding would only lose digits.
// `map`: the family's transform of the head's product (DecoderModel::logit_map), applied to each
// chunk's logits in fp32 and chained into their gradient.
LossSum chunked_lm_loss_sum(const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& labels, bool count_tokens = true,
                            int64_t chunk_elements = kLossChunkElements,
                            core::HostBlockCache* blocks = nullptr, UnitHooks* hooks = nullptr,
                            LogitMap map = {});

}  // namespace ft::model

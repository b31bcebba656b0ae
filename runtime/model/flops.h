// The model FLOPs of training a decoder of any of ft's families, per token: what MFU (model FLOPs
// utilisation) divides by the device's peak. PaLM's convention (Chowdhury et al. 2022, appendix B):
// every matrix multiply of the forward pass is 2 FLOPs per weight per token; the backward pass is
// twice the forward (the input's gradient and the weight's); attention's two products (Q K^T and
// the scores times V) count 2 x heads x head_dim x context each, over the whole context (causal
// masking is not halved), or over the window of a sliding-window layer where it is shorter;
// recomputation by activation checkpointing is not model work and is not counted; embedding
// lookups, norms, rotary embeddings and softmax are not counted. With LoRA the frozen weights get
// no weight gradient: their backward is one product (the input's gradient), each adapter's three.
// Pure; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace ft::model {

struct FlopCount {
  int64_t matmul_weights = 0;   // weights multiplied per token: every layer's projections + head
  int64_t adapter_weights = 0;  // LoRA's A and B weights multiplied per token (0 without LoRA)
  double forward = 0;           // FLOPs of the forward pass, per token
  double backward = 0;          // FLOPs of the backward pass, per token
  double attention = 0;         // of forward + backward: attention's products
  double per_token() const { return forward + backward; }
};

// Per token of a sequence of `context` tokens. `lora_targets` empty: full fine-tuning; else the
// LoRA target modules (q_proj ... down_proj; Phi-3's qkv_proj, gate_up_proj) with rank `lora_r`.
FlopCount training_flops(const ModelConfig& c, int64_t context,
                         const std::vector<std::string>& lora_targets = {}, int64_t lora_r = 0);

}  // namespace ft::model

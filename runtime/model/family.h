// The model families ft trains, one row of a table each: which variant of every decoder piece the
// family's layers use, the config.json keys it reads beyond the common ones and their defaults (as
// the family's transformers configuration class has them), and its checkpoint's tensor names.
// One decoder (model/decoder.h) assembles itself from a row; there is no model class per family.
// The math of each variant, with the transformers function that defines it: docs/training.md
// ("Model families"). Families ft knows but does not train (other mixture-of-experts layouts,
// hybrid linear attention, multimodal wrappers) are refused by name with the reason. Immutable;
// thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace ft::model {

// How an RMSNorm applies its weight w to the normalised fp32 value n of x:
//   kScale:     w * n.to(x.dtype)          (LlamaRMSNorm; also Qwen2/3, Mistral, Phi-3, Granite)
//   kScaleFp32: (w * n).to(x.dtype)        (Olmo2RMSNorm)
//   kOffset:    (n * (1 + w.float())).to(x.dtype); weights start at 0 (Gemma2RMSNorm,
//   Gemma3RMSNorm)
enum class NormStyle { kScale, kScaleFp32, kOffset };

// Where a layer's norms sit (h: the residual stream):
//   kPre:      h += attn(in_norm(h)); h += mlp(post_attention_norm(h))                (Llama)
//   kSandwich: h += post_attention_norm(attn(in_norm(h)));
//              h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))           (Gemma 2/3)
//   kPost:     h += post_attention_norm(attn(h)); h += post_feedforward_norm(mlp(h))   (OLMo 2)
enum class NormPlacement { kPre, kSandwich, kPost };

// RMSNorm of the queries and keys before the rotary embedding: none; per head over head_dim
// (q_norm/k_norm weights [head_dim]: Qwen3, Gemma 3); over the whole projection ([heads*head_dim]:
// OLMo 2).
enum class QkNorm { kNone, kPerHead, kWhole };

// The MLP's gate activation: silu (SwiGLU) or gelu with the tanh approximation (GeGLU, Gemma).
enum class Activation { kSilu, kGeluTanh };

// Which layers attend through a sliding window when config.json has no `layer_types`:
//   kNone: none; kAll: every layer when `sliding_window` is set (Mistral, Phi-3, Ministral);
//   kFromMaxWindowLayers: layers >= max_window_layers when use_sliding_window (Qwen2/3);
//   kAlternate: even layers (Gemma 2); kPattern: all but every sliding_window_pattern-th (Gemma 3).
enum class WindowRule { kNone, kAll, kFromMaxWindowLayers, kAlternate, kPattern };

// Mixture-of-experts layers (model/moe.h) and how the family's checkpoints name them. In memory
// every family holds a MoE layer as transformers 5 does: router `mlp.gate.weight` [E, hidden],
// experts fused `mlp.experts.gate_up_proj` [E, 2 inter, hidden] (rows gate, then up) and
// `mlp.experts.down_proj` [E, hidden, inter]. On disk:
//   kNone:    dense MLPs only;
//   kMixtral: `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.J.{w1,w3,w2}.weight`
//             (gate, up, down); every layer MoE; top-k weights always renormalised;
//   kQwen:    `mlp.gate.weight`, `mlp.experts.J.{gate,up,down}_proj.weight`; MoE layers chosen by
//             decoder_sparse_step and mlp_only_layers; renormalised per norm_topk_prob.
enum class MoeStyle { kNone, kMixtral, kQwen };

struct Family {
  const char* model_type = "";    // config.json "model_type"
  const char* architecture = "";  // config.json "architectures" of the causal-LM class
  NormStyle norm = NormStyle::kScale;
  NormPlacement placement = NormPlacement::kPre;
  QkNorm qk_norm = QkNorm::kNone;
  bool qkv_bias = false;           // q, k, v always carry biases, o none (Qwen2)
  bool fused_projections = false;  // qkv_proj (rows q, k, v) and gate_up_proj (gate, up): Phi-3
  bool sqrt_embed_scale = false;   // embeddings x sqrt(hidden), rounded to the dtype (Gemma)
  bool multipliers = false;  // Granite's embedding/residual/attention multipliers, logits_scaling
  bool soft_caps = false;    // reads attn_logit_softcapping and final_logit_softcapping
  // Whether the attention cap applies: Gemma 3's attention keeps the key but never applies it
  // (Gemma3Attention), so ft refuses a value there rather than apply or drop it silently.
  bool attention_soft_cap = false;
  bool rope_in_fp32 = false;  // q and k rotated in fp32, then cast back (Olmo2's rotary)
  double default_attn_softcap = 0, default_final_softcap = 0;  // 0: none
  bool query_pre_attn_scalar = false;  // attention scale query_pre_attn_scalar^-0.5 (Gemma)
  bool local_rope = false;             // sliding layers have a rotary theta of their own (Gemma 3)
  bool partial_rotary = false;         // reads partial_rotary_factor (Phi-3/4)
  bool attention_bias_key = true;      // reads attention_bias
  bool mlp_bias_key = false;           // reads mlp_bias
  WindowRule windows = WindowRule::kNone;
  MoeStyle moe = MoeStyle::kNone;
  int64_t default_window = 0;          // sliding_window when config.json lacks it (0: none)
  int64_t default_window_pattern = 0;  // kPattern: sliding_window_pattern's default
  const char* activation_key = "hidden_act";
  Activation default_activation = Activation::kSilu;
  int64_t default_head_dim = 0;  // head_dim when config.json lacks it (0: hidden / heads)
  bool default_tie = false;
  double default_rms_norm_eps = 1e-6;
  double default_rope_theta = 10000.0;
  double default_local_rope_theta = 10000.0;  // local_rope
  int64_t default_max_position_embeddings = 2048;
};

// The row of `model_type`, or nullptr.
const Family* find_family(const std::string& model_type);
// Why ft refuses a model_type it knows but does not train ("" when it does not know it).
std::string refused_family_reason(const std::string& model_type);
// "llama, mistral, qwen2, ..." for messages.
std::string supported_model_types();

}  // namespace ft::model

// The architecture of a decoder-only model of one of ft's families (model/family.h: Llama, Mistral,
// Qwen2/3, Gemma 2/3, Phi-3/4, OLMo 2, Granite), read from a Hugging Face config.json or built
// from a preset's shape: the family's row resolved against the file into plain numbers per
// piece (which norm, which window on which layer, which scales, which layers hold experts). Plain
// data; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/family.h"

namespace ft::model {

struct RopeConfig {
  std::string type = "default";  // default | linear | llama3 | longrope
  double theta = 10000.0;
  double factor = 1.0;                              // linear, llama3
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3, longrope
  // longrope: one factor per rotated pair; the long set when a sequence's largest position + 1
  // exceeds original_max_position_embeddings (transformers' dynamic_rope_update), else the short.
  std::vector<double> short_factor, long_factor;
  double attention_factor = 1.0;  // longrope: cos and sin are multiplied by it
};

// A mixture-of-experts model's expert layers (model/moe.h); num_experts 0: a dense model.
struct MoeConfig {
  int64_t num_experts = 0;          // E (num_local_experts, num_experts)
  int64_t experts_per_token = 0;    // k (num_experts_per_tok)
  int64_t expert_intermediate = 0;  // each expert's SwiGLU width (moe_intermediate_size)
  bool norm_topk_prob = true;       // the k weights renormalised to sum 1 (always in Mixtral)
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;  // transformers adds the aux loss only with this set
  std::vector<uint8_t> layers;        // per layer: 1 MoE, 0 dense MLP (empty: dense model)
  // Expert parallelism (strategy.expert_parallel; not in config.json): this rank holds experts
  // [ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size) of every MoE layer.
  int64_t ep_size = 1, ep_rank = 0;
  bool enabled() const { return num_experts > 0; }
  int64_t local_experts() const { return num_experts / ep_size; }
  int64_t first_local_expert() const { return ep_rank * local_experts(); }
};

// QLoRA (issue 33): the decoder layers' projections held frozen in NF4 (model/nf4.h); never the
// embeddings, norms, routers, experts or the head (as transformers 5 + bitsandbytes quantize:
// in a mixture-of-experts model the attention's projections and dense MLP layers only).
struct BaseQuant {
  bool nf4 = false;
  bool double_quant = false;  // the absmax values quantized too (their values then carry that)
  int64_t blocksize = 64;
  // The checkpoint holds them quantized as transformers + bitsandbytes save (config.json's
  // quantization_config); else they are quantized as they are read.
  bool in_files = false;
};

struct ModelConfig {
  std::string model_type = "llama";  // a model/family.h row
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t head_dim = 128;  // hidden_size / heads unless config.json says otherwise
  int64_t max_position_embeddings = 4096;
  double rms_norm_eps = 1e-5;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q, k, v projections (attention_bias; always in Qwen2)
  bool o_bias = false;    // o projection (attention_bias)
  bool mlp_bias = false;
  Activation activation = Activation::kSilu;
  RopeConfig rope;        // every layer but Gemma 3's sliding ones
  RopeConfig local_rope;  // sliding layers when has_local_rope (Gemma 3)
  bool has_local_rope = false;
  double partial_rotary_factor = 1.0;     // the first head_dim x this of each head rotates
  std::vector<int64_t> layer_windows;     // per layer: 0 full causal; W: query i sees i-W < j <= i
  double attn_softcap = 0;                // scores -> tanh(s / c) * c before the mask; 0 none
  double final_softcap = 0;               // the same on the logits
  double attention_scale = 0;             // softmax scale; 0: 1 / sqrt(head_dim)
  double embedding_scale = 1;             // embeddings x this (Gemma: sqrt(hidden); Granite)
  bool embedding_scale_in_dtype = false;  // Gemma rounds the scale to the model dtype first
  double residual_multiplier = 1;         // Granite: each block's output x this before the add
  double logits_divisor = 1;              // Granite: logits / logits_scaling
  MoeConfig moe;
  BaseQuant quant;  // lora.quantize_base, or a bitsandbytes NF4 checkpoint's quantization_config
  int64_t bos_token_id = 1;
  int64_t eos_token_id = 2;
  // The embedding row that gets no gradient (nn.Embedding's padding_idx, which transformers sets
  // to pad_token_id in every family); -1: none.
  int64_t pad_token_id = -1;
  // The config.json this was read from (empty for a preset's shape): an export writes it back, so
  // keys ft does not use (generation settings, quantization hints, auto_map) survive.
  std::string source_json;

  const Family& family() const;         // the row of model_type
  int64_t rotary_dim() const;           // head_dim x partial_rotary_factor (even)
  double softmax_scale() const;         // attention_scale or 1 / sqrt(head_dim)
  int64_t window(int64_t layer) const;  // layer_windows[layer], 0 when none listed
  bool is_moe_layer(int64_t layer) const;
  int64_t num_moe_layers() const;
  // The same model with `n` layers (a probe's): the window pattern repeats.
  ModelConfig with_layers(int64_t n) const;

  // Parameter count of the full model (embeddings and head included, tied counted once).
  int64_t num_parameters() const;
  // Throws ConfigError when the shape is inconsistent (heads not dividing, GQA groups...).
  void validate(const std::string& where) const;
};

// Reads config.json; throws FormatError naming the file and key for missing or wrong-typed keys,
// for model types ft does not train (naming those it does) and for features of a family ft does
// not implement (refused, never silently ignored or approximated).
ModelConfig load_model_config(const std::string& path);

// The config.json ft writes next to exported weights: source_json when there is one, else one
// built from the fields (round-trips through load_model_config and loads in transformers).
std::string model_config_json(const ModelConfig& c);

}  // namespace ft::model

#include "model/family.h"

#include <array>
#include <utility>

namespace ft::model {

namespace {

// Defaults from transformers 5.24's configuration classes (LlamaConfig, MistralConfig, ...), for
// configs written by older versions that leave keys out.
Family row(const char* model_type, const char* architecture) {
  Family f;
  f.model_type = model_type;
  f.architecture = architecture;
  return f;
}

Family llama() {
  Family f = row("llama", "LlamaForCausalLM");
  f.mlp_bias_key = true;
  return f;
}

Family mistral() {
  Family f = row("mistral", "MistralForCausalLM");
  f.attention_bias_key = false;
  f.windows = WindowRule::kAll;
  f.default_window = 4096;
  f.default_max_position_embeddings = 131072;
  return f;
}

Family ministral() {
  Family f = mistral();
  f.model_type = "ministral";
  f.architecture = "MinistralForCausalLM";
  return f;
}

Family qwen2() {
  Family f = row("qwen2", "Qwen2ForCausalLM");
  f.qkv_bias = true;
  f.attention_bias_key = false;
  f.windows = WindowRule::kFromMaxWindowLayers;
  f.default_window = 4096;
  f.default_max_position_embeddings = 32768;
  return f;
}

Family qwen3() {
  Family f = qwen2();
  f.model_type = "qwen3";
  f.architecture = "Qwen3ForCausalLM";
  f.qkv_bias = false;
  f.attention_bias_key = true;
  f.qk_norm = QkNorm::kPerHead;
  f.default_head_dim = 128;
  return f;
}

// Mixtral: Mistral's attention (sliding_window null by default) with a MoE block in every layer.
Family mixtral() {
  Family f = mistral();
  f.model_type = "mixtral";
  f.architecture = "MixtralForCausalLM";
  f.default_window = 0;
  f.moe = MoeStyle::kMixtral;
  return f;
}

Family qwen3_moe() {
  Family f = qwen3();
  f.model_type = "qwen3_moe";
  f.architecture = "Qwen3MoeForCausalLM";
  f.moe = MoeStyle::kQwen;
  f.default_head_dim = 0;  // Qwen3MoeConfig has no head_dim default: hidden / heads
  return f;
}

Family gemma2() {
  Family f = row("gemma2", "Gemma2ForCausalLM");
  f.norm = NormStyle::kOffset;
  f.placement = NormPlacement::kSandwich;
  f.sqrt_embed_scale = true;
  f.soft_caps = true;
  f.attention_soft_cap = true;
  f.default_attn_softcap = 50.0;
  f.default_final_softcap = 30.0;
  f.query_pre_attn_scalar = true;
  f.windows = WindowRule::kAlternate;
  f.default_window = 4096;
  f.activation_key = "hidden_activation";
  f.default_activation = Activation::kGeluTanh;
  f.default_head_dim = 256;
  f.default_tie = true;
  f.default_max_position_embeddings = 8192;
  return f;
}

Family gemma3() {
  Family f = gemma2();
  f.model_type = "gemma3_text";
  f.architecture = "Gemma3ForCausalLM";
  f.qk_norm = QkNorm::kPerHead;
  f.attention_soft_cap = false;
  f.default_attn_softcap = 0;
  f.default_final_softcap = 0;
  f.local_rope = true;
  f.windows = WindowRule::kPattern;
  f.default_window_pattern = 6;
  f.default_rope_theta = 1000000.0;
  f.default_local_rope_theta = 10000.0;
  f.default_max_position_embeddings = 131072;
  return f;
}

Family phi3() {
  Family f = row("phi3", "Phi3ForCausalLM");
  f.fused_projections = true;
  f.partial_rotary = true;
  f.attention_bias_key = false;
  f.windows = WindowRule::kAll;
  f.default_rms_norm_eps = 1e-5;
  f.default_max_position_embeddings = 4096;
  return f;
}

Family olmo2() {
  Family f = row("olmo2", "Olmo2ForCausalLM");
  f.norm = NormStyle::kScaleFp32;
  f.rope_in_fp32 = true;
  f.placement = NormPlacement::kPost;
  f.qk_norm = QkNorm::kWhole;
  f.default_rms_norm_eps = 1e-5;
  return f;
}

Family granite() {
  Family f = row("granite", "GraniteForCausalLM");
  f.multipliers = true;
  f.mlp_bias_key = true;
  return f;
}

const std::array<Family, 12>& families() {
  static const std::array<Family, 12> rows = {llama(), mistral(), ministral(), qwen2(),
                                              qwen3(), gemma2(),  gemma3(),    phi3(),
                                              olmo2(), granite(), mixtral(),   qwen3_moe()};
  return rows;
}

}  // namespace

const Family* find_family(const std::string& model_type) {
  for (const Family& f : families())
    if (model_type == f.model_type) return &f;
  return nullptr;
}

std::string refused_family_reason(const std::string& model_type) {
  constexpr const char* kMoe =
      "a mixture-of-experts model whose expert layout ft does not implement (ft's MoE families: "
      "mixtral, qwen3_moe)";
  constexpr const char* kLatent =
      "a model with multi-head latent attention and grouped sigmoid routing (the DeepSeek-V3 "
      "layout), which ft does not implement yet";
  constexpr const char* kLinear =
      "a hybrid model with linear-attention layers ft does not implement";
  constexpr const char* kStateSpace =
      "a hybrid model with state-space layers ft does not implement";
  constexpr const char* kDense =
      "a dense family of 2025-26 whose differences from Llama (its attention and norm variants) "
      "ft does not implement yet";
  constexpr const char* kVision = "a vision-language model ft does not implement";
  static const std::pair<const char*, const char*> kRefused[] = {
      {"qwen2_moe", kMoe},
      {"olmoe", kMoe},
      {"granitemoe", kMoe},
      {"granitemoeshared", kMoe},
      {"phimoe", kMoe},
      {"deepseek_v2", kMoe},
      {"deepseek_v3", kLatent},
      {"glm4_moe_lite", kLatent},
      {"mistral4", kLatent},
      {"glm4_moe",
       "GLM-4.5's mixture-of-experts layout (sigmoid grouped routing, shared experts, dense first "
       "layers), which ft does not implement yet"},
      {"gpt_oss",
       "gpt-oss, whose attention sinks, alternating sliding windows and clamped SwiGLU experts ft "
       "does not implement yet"},
      {"llama4",
       "Llama 4, whose chunked attention, NoPE layers and top-1 routed experts ft does not "
       "implement yet"},
      {"gemma4", "Gemma 4, a family ft does not implement yet"},
      {"qwen3_next", kLinear},
      {"qwen3_5", kLinear},
      {"qwen3_5_moe", "a hybrid mixture-of-experts model ft does not implement"},
      {"granitemoehybrid", kStateSpace},
      {"falcon_h1", kStateSpace},
      {"olmo3", "OLMo 3, whose sliding-window layers on OLMo 2's layout ft does not implement yet"},
      {"smollm3", "SmolLM3, whose layers without rotary embeddings ft does not implement yet"},
      {"exaone4", kDense},
      {"seed_oss", kDense},
      {"hunyuan_v1_dense", kDense},
      {"ernie4_5", kDense},
      {"gemma3",
       "the multimodal Gemma 3 (Gemma3ForConditionalGeneration); ft trains the text-only "
       "gemma3_text checkpoints (Gemma 3 1B, or a text model extracted from 4B-27B)"},
      {"gemma3n", "a Gemma 3n model, whose per-layer embeddings and AltUp ft does not implement"},
      {"qwen2_vl", kVision},
      {"qwen2_5_vl", kVision},
      {"qwen3_vl", kVision},
  };
  for (const auto& [type, why] : kRefused)
    if (model_type == type) return why;
  return "";
}

std::string supported_model_types() {
  std::string out;
  for (const Family& f : families()) out += (out.empty() ? "" : ", ") + std::string(f.model_type);
  return out;
}

}  // namespace ft::model

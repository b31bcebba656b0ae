#include "model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/json.h"

namespace ft::model {

using nlohmann::json;

const Family& ModelConfig::family() const {
  const Family* f = find_family(model_type);
  FT_CHECK(f, "model_type '", model_type, "' is not a family ft trains (", supported_model_types(),
           ")");
  return *f;
}

int64_t ModelConfig::rotary_dim() const {
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
}

double ModelConfig::softmax_scale() const {
  return attention_scale > 0 ? attention_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

int64_t ModelConfig::window(int64_t layer) const {
  return layer < static_cast<int64_t>(layer_windows.size())
             ? layer_windows[static_cast<size_t>(layer)]
             : 0;
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  return layer >= 0 && layer < static_cast<int64_t>(moe.layers.size()) &&
         moe.layers[static_cast<size_t>(layer)] != 0;
}

int64_t ModelConfig::num_moe_layers() const {
  int64_t n = 0;
  for (const uint8_t m : moe.layers) n += m != 0;
  return n;
}

ModelConfig ModelConfig::with_layers(int64_t n) const {
  ModelConfig c = *this;
  c.num_hidden_layers = n;
  if (!moe.layers.empty()) {
    c.moe.layers.resize(static_cast<size_t>(n));
    for (size_t i = 0; i < c.moe.layers.size(); ++i)
      c.moe.layers[i] = moe.layers[i % moe.layers.size()];
  }
  if (!layer_windows.empty()) {
    c.layer_windows.resize(static_cast<size_t>(n));
    for (size_t i = 0; i < c.layer_windows.size(); ++i)
      c.layer_windows[i] = layer_windows[i % layer_windows.size()];
  }
  return c;
}

int64_t ModelConfig::num_parameters() const {
  const Family& f = family();
  const int64_t q = num_attention_heads * head_dim, kv = num_key_value_heads * head_dim;
  int64_t per_layer = hidden_size * q + 2 * hidden_size * kv + q * hidden_size +
                      3 * hidden_size * intermediate_size;
  // Each MoE layer replaces its dense MLP by a router and E experts of their own width.
  const int64_t moe_mlp =
      moe.num_experts * (hidden_size + 3 * hidden_size * moe.expert_intermediate);
  const int64_t moe_layers = num_moe_layers();
  per_layer += (f.placement == NormPlacement::kSandwich ? 4 : 2) * hidden_size;
  if (f.qk_norm == QkNorm::kPerHead) per_layer += 2 * head_dim;
  if (f.qk_norm == QkNorm::kWhole) per_layer += q + kv;
  if (qkv_bias) per_layer += q + 2 * kv;
  if (o_bias) per_layer += hidden_size;
  if (mlp_bias) per_layer += 2 * intermediate_size + hidden_size;
  int64_t emb = vocab_size * hidden_size;
  return emb * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * per_layer + hidden_size +
         moe_layers * (moe_mlp - 3 * hidden_size * intermediate_size);
}

namespace {

void validate_rope(const RopeConfig& rope, int64_t rotary_dim, const std::string& where) {
  FT_CHECK(rope.theta > 0, where, ": rope_theta must be > 0");
  FT_CHECK(rope.type == "default" || rope.type == "linear" || rope.type == "llama3" ||
               rope.type == "longrope",
           where, ": rope type '", rope.type,
           "' is not supported (default, linear, llama3, longrope)");
  FT_CHECK(rope.factor > 0, where, ": rope factor must be > 0");
  if (rope.type == "llama3") {
    FT_CHECK(rope.high_freq_factor > rope.low_freq_factor, where,
             ": rope high_freq_factor must exceed low_freq_factor");
  }
  if (rope.type == "longrope") {
    const size_t pairs = static_cast<size_t>(rotary_dim / 2);
    FT_CHECK(rope.short_factor.size() == pairs && rope.long_factor.size() == pairs, where,
             ": longrope short_factor and long_factor need ", pairs,
             " entries each (rotary dimension / 2), got ", rope.short_factor.size(), " and ",
             rope.long_factor.size());
    FT_CHECK(rope.original_max_position_embeddings > 0, where,
             ": longrope original_max_position_embeddings must be >= 1");
  }
}

void validate_moe(const ModelConfig& c, const std::string& where) {
  const MoeConfig& m = c.moe;
  const bool family_moe =
      find_family(c.model_type) && find_family(c.model_type)->moe != MoeStyle::kNone;
  FT_CHECK(m.enabled() == family_moe, where, ": ", c.model_type,
           family_moe ? " is a mixture-of-experts family: num_experts must be >= 1"
                      : " has no expert layers: num_experts must be 0");
  if (!m.enabled()) return;
  FT_CHECK(m.experts_per_token >= 1 && m.experts_per_token <= m.num_experts, where,
           ": num_experts_per_tok (", m.experts_per_token, ") must be between 1 and num_experts (",
           m.num_experts, ")");
  FT_CHECK(m.expert_intermediate >= 1, where, ": the experts' intermediate size must be >= 1, got ",
           m.expert_intermediate);
  FT_CHECK(static_cast<int64_t>(m.layers.size()) == c.num_hidden_layers, where, ": ",
           m.layers.size(), " MoE layer flags for ", c.num_hidden_layers, " layers");
  FT_CHECK(m.router_aux_loss_coef >= 0, where, ": router_aux_loss_coef must be >= 0");
}

}  // namespace

void ModelConfig::validate(const std::string& where) const {
  auto pos = [&](const char* key, int64_t v) {
    FT_CHECK(v > 0, where, ": ", key, " must be >= 1, got ", v);
  };
  FT_CHECK(find_family(model_type), where, ": model_type '", model_type,
           "' is not a family ft trains (", supported_model_types(), ")");
  pos("vocab_size", vocab_size);
  pos("hidden_size", hidden_size);
  pos("intermediate_size", intermediate_size);
  pos("num_hidden_layers", num_hidden_layers);
  pos("num_attention_heads", num_attention_heads);
  pos("num_key_value_heads", num_key_value_heads);
  pos("head_dim", head_dim);
  FT_CHECK(num_attention_heads % num_key_value_heads == 0, where, ": num_attention_heads (",
           num_attention_heads, ") must be a multiple of num_key_value_heads (",
           num_key_value_heads, ")");
  FT_CHECK(head_dim % 2 == 0, where, ": head_dim must be even for rotary embeddings, got ",
           head_dim);
  FT_CHECK(partial_rotary_factor > 0 && partial_rotary_factor <= 1 && rotary_dim() >= 2 &&
               rotary_dim() % 2 == 0,
           where, ": partial_rotary_factor ", partial_rotary_factor,
           " must leave an even rotary dimension of at least 2 (head_dim ", head_dim, ")");
  FT_CHECK(rms_norm_eps > 0, where, ": rms_norm_eps must be > 0");
  validate_rope(rope, rotary_dim(), where);
  if (has_local_rope) validate_rope(local_rope, rotary_dim(), where);
  FT_CHECK(layer_windows.empty() || static_cast<int64_t>(layer_windows.size()) == num_hidden_layers,
           where, ": ", layer_windows.size(), " layer windows for ", num_hidden_layers, " layers");
  for (int64_t w : layer_windows) FT_CHECK(w >= 0, where, ": sliding_window must be >= 1");
  FT_CHECK(attn_softcap >= 0 && final_softcap >= 0, where, ": soft caps must be >= 0");
  validate_moe(*this, where);
  FT_CHECK(!quant.nf4 || (quant.blocksize >= 32 && quant.blocksize <= 4096 &&
                          (quant.blocksize & (quant.blocksize - 1)) == 0),
           where, ": NF4 block size must be a power of two from 32 to 4096, got ", quant.blocksize);
  FT_CHECK(
      attention_scale >= 0 && embedding_scale > 0 && residual_multiplier > 0 && logits_divisor > 0,
      where, ": attention scale and multipliers must be > 0");
}

namespace {

template <typename T>
T get_or(const json& j, const char* key, T fallback, const std::string& file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    throw FormatError(fmt::format("{}: key \"{}\" has the wrong type ({})", file, key, it->dump()));
  }
}

template <typename T>
T require(const json& j, const char* key, const std::string& file) {
  FT_CHECK_T(FormatError, j.contains(key) && !j[key].is_null(), file, ": required key \"", key,
             "\" is missing");
  return get_or<T>(j, key, T{}, file);
}

// One rotary setting (a rope_parameters or rope_scaling object). `top`: the whole file, where
// Phi-3 keeps original_max_position_embeddings.
void read_rope(const json& r, const json& top, RopeConfig& rope, const std::string& file,
               const std::string& where) {
  std::string type = r.contains("rope_type") ? get_or<std::string>(r, "rope_type", "default", file)
                                             : get_or<std::string>(r, "type", "default", file);
  FT_CHECK_T(FormatError,
             type == "default" || type == "linear" || type == "llama3" || type == "longrope", file,
             ": \"", where, "\" type '", type,
             "' is not supported by ft (supported: default, linear, llama3, longrope); refusing "
             "rather than computing different positions");
  rope.type = type;
  rope.theta = get_or<double>(r, "rope_theta", rope.theta, file);
  const bool has_factor = r.contains("factor") && !r["factor"].is_null();
  rope.factor = get_or<double>(r, "factor", rope.factor, file);
  rope.low_freq_factor = get_or<double>(r, "low_freq_factor", rope.low_freq_factor, file);
  rope.high_freq_factor = get_or<double>(r, "high_freq_factor", rope.high_freq_factor, file);
  rope.original_max_position_embeddings =
      get_or<int64_t>(r, "original_max_position_embeddings",
                      get_or<int64_t>(top, "original_max_position_embeddings",
                                      rope.original_max_position_embeddings, file),
                      file);
  if (type != "longrope") return;
  rope.short_factor = require<std::vector<double>>(r, "short_factor", file);
  rope.long_factor = require<std::vector<double>>(r, "long_factor", file);
  // transformers' _compute_longrope_parameters: without a factor, the ratio of the context
  // lengths; without an attention_factor, sqrt(1 + ln(factor) / ln(original)).
  const double orig = static_cast<double>(rope.original_max_position_embeddings);
  const double factor =
      has_factor
          ? rope.factor
          : static_cast<double>(require<int64_t>(top, "max_position_embeddings", file)) / orig;
  const double fallback = factor <= 1.0 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(orig));
  rope.attention_factor = get_or<double>(r, "attention_factor", fallback, file);
}

// Rotary settings: transformers >= 5 writes "rope_parameters" (per layer type for Gemma 3);
// older files "rope_theta" + "rope_scaling" (with "type" or "rope_type") and Gemma 3's
// "rope_local_base_freq".
void read_rotary(const json& j, const Family& f, ModelConfig& c, const std::string& path) {
  c.rope.theta = get_or<double>(j, "rope_theta", f.default_rope_theta, path);
  c.local_rope.theta = get_or<double>(j, "rope_local_base_freq", f.default_local_rope_theta, path);
  c.has_local_rope = f.local_rope;
  const auto params = j.find("rope_parameters");
  const bool per_type =
      params != j.end() && params->is_object() &&
      (params->contains("full_attention") || params->contains("sliding_attention"));
  if (per_type) {
    FT_CHECK_T(FormatError, f.local_rope, path,
               ": \"rope_parameters\" per layer type is not supported for model_type \"",
               c.model_type, "\" (only gemma3_text has it in ft)");
    if (params->contains("full_attention"))
      read_rope((*params)["full_attention"], j, c.rope, path, "rope_parameters.full_attention");
    if (params->contains("sliding_attention"))
      read_rope((*params)["sliding_attention"], j, c.local_rope, path,
                "rope_parameters.sliding_attention");
  } else if (params != j.end() && params->is_object()) {
    read_rope(*params, j, c.rope, path, "rope_parameters");
    c.partial_rotary_factor =
        get_or<double>(*params, "partial_rotary_factor", c.partial_rotary_factor, path);
  }
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object())
    read_rope(j["rope_scaling"], j, c.rope, path, "rope_scaling");
  c.partial_rotary_factor =
      get_or<double>(j, "partial_rotary_factor", c.partial_rotary_factor, path);
  FT_CHECK_T(FormatError, f.partial_rotary || c.partial_rotary_factor == 1.0, path,
             ": partial_rotary_factor ", c.partial_rotary_factor,
             " is not supported for model_type \"", c.model_type, "\"");
  FT_CHECK_T(FormatError, c.rope.type != "longrope" || f.partial_rotary, path,
             ": longrope is not supported for model_type \"", c.model_type, "\" (phi3 has it)");
}

// Which layers attend through a window, and how wide: layer_types when the file has it, else the
// family's rule (model/family.h: WindowRule).
void read_windows(const json& j, const Family& f, ModelConfig& c, const std::string& path) {
  if (f.windows == WindowRule::kNone) return;
  int64_t window = f.default_window;
  if (j.contains("sliding_window")) window = get_or<int64_t>(j, "sliding_window", 0, path);
  if (f.windows == WindowRule::kFromMaxWindowLayers &&
      !get_or<bool>(j, "use_sliding_window", false, path))
    window = 0;
  FT_CHECK_T(FormatError, window >= 0, path, ": sliding_window must be >= 1 or null, got ", window);
  const int64_t n = c.num_hidden_layers;
  std::vector<bool> sliding(static_cast<size_t>(n), false);
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const auto types = get_or<std::vector<std::string>>(j, "layer_types", {}, path);
    FT_CHECK_T(FormatError, static_cast<int64_t>(types.size()) == n, path, ": layer_types has ",
               types.size(), " entries for ", n, " layers (num_hidden_layers)");
    for (size_t i = 0; i < types.size(); ++i) {
      FT_CHECK_T(FormatError, types[i] == "full_attention" || types[i] == "sliding_attention", path,
                 ": layer_types[", i, "] is \"", types[i],
                 "\", a layer kind ft does not implement (full_attention, sliding_attention)");
      sliding[i] = types[i] == "sliding_attention";
    }
  } else {
    const int64_t max_window_layers = get_or<int64_t>(j, "max_window_layers", 28, path);
    const int64_t pattern =
        get_or<int64_t>(j, "sliding_window_pattern", f.default_window_pattern, path);
    for (int64_t i = 0; i < n; ++i) {
      switch (f.windows) {
        case WindowRule::kAll:
          sliding[i] = true;
          break;
        case WindowRule::kFromMaxWindowLayers:
          sliding[i] = i >= max_window_layers;
          break;
        case WindowRule::kAlternate:
          sliding[i] = (i + 1) % 2 != 0;
          break;
        case WindowRule::kPattern:
          sliding[i] = pattern > 0 && (i + 1) % pattern != 0;
          break;
        case WindowRule::kNone:
          break;
      }
    }
  }
  c.layer_windows.assign(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < n; ++i)
    if (sliding[static_cast<size_t>(i)]) c.layer_windows[static_cast<size_t>(i)] = window;
  if (window == 0) c.layer_windows.clear();
}

Activation read_activation(const json& j, const Family& f, const std::string& path) {
  const auto it = j.find(f.activation_key);
  if (it == j.end() || it->is_null()) return f.default_activation;
  const std::string act = get_or<std::string>(j, f.activation_key, "", path);
  if (act == "silu") return Activation::kSilu;
  if (act == "gelu_pytorch_tanh") return Activation::kGeluTanh;
  throw FormatError(fmt::format("{}: {} \"{}\" is not supported (silu, gelu_pytorch_tanh)", path,
                                f.activation_key, act));
}

// Dropout ft does not apply in training is refused rather than dropped.
// A checkpoint saved quantized (config.json's quantization_config): bitsandbytes' 4-bit NF4 with
// every decoder projection quantized is read as QLoRA's base (BaseQuant::in_files); any other
// method holds packed weights ft cannot read and is refused here, naming it, rather than at the
// first weight whose shape does not fit.
void read_quantization(const json& j, ModelConfig& c, const std::string& path) {
  if (!j.contains("quantization_config") || j.at("quantization_config").is_null()) return;
  const json& q = j.at("quantization_config");
  std::string method = "unknown", detail;
  if (q.is_object()) {
    method = get_or<std::string>(q, "quant_method", "unknown", path);
    if (method == "bitsandbytes") {
      const bool four = get_or<bool>(q, "load_in_4bit", false, path);
      const std::string type = get_or<std::string>(q, "bnb_4bit_quant_type", "fp4", path);
      detail = four ? " 4-bit " + type : std::string(" 8-bit");
      if (four && type == "nf4") {
        const json none = json::array();
        const json& skip =
            q.contains("llm_int8_skip_modules") && !q.at("llm_int8_skip_modules").is_null()
                ? q.at("llm_int8_skip_modules")
                : none;
        for (const auto& m : skip)
          FT_CHECK_T(FormatError, m.is_string() && m.get<std::string>() == "lm_head", path,
                     ": quantization_config.llm_int8_skip_modules ", excerpt(skip.dump(), 80),
                     " leaves decoder projections unquantized; ft reads NF4 checkpoints whose "
                     "every decoder projection is quantized (the default): give --model the "
                     "model this one was quantized from and set lora.quantize_base=nf4");
        c.quant.nf4 = true;
        c.quant.in_files = true;
        c.quant.double_quant = get_or<bool>(q, "bnb_4bit_use_double_quant", false, path);
        return;
      }
    }
  }
  throw FormatError(fmt::format(
      "{}: quantization_config: the weights are saved quantized ({}{}); ft reads unquantized "
      "(fp32, bf16, fp16) weights and bitsandbytes 4-bit NF4 checkpoints only: give --model the "
      "model this one was quantized from (lora.quantize_base=nf4 quantizes it for QLoRA)",
      path, method, detail));
}

void refuse_dropout(const json& j, const std::string& path) {
  for (const char* key : {"attention_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout"}) {
    const double p = get_or<double>(j, key, 0.0, path);
    FT_CHECK_T(FormatError, p == 0.0, path, ": ", key, " ", p,
               " is not supported (ft's model applies no dropout; LoRA has lora.dropout)");
  }
}

// Gemma's scales and caps, Granite's multipliers.
void read_scales(const json& j, const Family& f, ModelConfig& c, const std::string& path) {
  if (f.sqrt_embed_scale) {
    c.embedding_scale = std::sqrt(static_cast<double>(c.hidden_size));
    c.embedding_scale_in_dtype = true;
  }
  if (f.query_pre_attn_scalar)
    c.attention_scale = 1.0 / std::sqrt(get_or<double>(j, "query_pre_attn_scalar", 256.0, path));
  if (f.soft_caps) {
    auto cap = [&](const char* key, double fallback) {
      return j.contains(key) ? get_or<double>(j, key, 0.0, path) : fallback;
    };
    c.attn_softcap = cap("attn_logit_softcapping", f.default_attn_softcap);
    FT_CHECK_T(FormatError, f.attention_soft_cap || c.attn_softcap == 0, path,
               ": attn_logit_softcapping ", c.attn_softcap, " is set, but ", c.model_type,
               " models do not apply it (transformers' attention ignores it); set it to null");
    c.final_softcap = cap("final_logit_softcapping", f.default_final_softcap);
  }
  if (f.multipliers) {
    c.embedding_scale = get_or<double>(j, "embedding_multiplier", 1.0, path);
    c.residual_multiplier = get_or<double>(j, "residual_multiplier", 1.0, path);
    c.attention_scale = get_or<double>(j, "attention_multiplier", 1.0, path);
    c.logits_divisor = get_or<double>(j, "logits_scaling", 1.0, path);
  }
  FT_CHECK_T(FormatError, !get_or<bool>(j, "use_bidirectional_attention", false, path), path,
             ": use_bidirectional_attention is set: an encoder (embedding) model, not a causal LM "
             "ft fine-tunes");
}

// The expert layers: Mixtral's keys (every layer MoE, experts as wide as intermediate_size) or
// Qwen3-MoE's (moe_intermediate_size; layer i is MoE iff not in mlp_only_layers and
// (i + 1) % decoder_sparse_step == 0, as Qwen3MoeDecoderLayer decides). Defaults: transformers
// 5.24's MixtralConfig and Qwen3MoeConfig.
void read_moe(const json& j, const Family& f, ModelConfig& c, const std::string& path) {
  if (f.moe == MoeStyle::kNone) return;
  MoeConfig& m = c.moe;
  const bool mixtral = f.moe == MoeStyle::kMixtral;
  // The two names are aliases in both configs (transformers 5.24 writes num_local_experts for
  // Qwen3-MoE too; the hub's Qwen3-MoE files say num_experts).
  m.num_experts = get_or<int64_t>(j, "num_local_experts",
                                  get_or<int64_t>(j, "num_experts", mixtral ? 8 : 128, path), path);
  m.experts_per_token = get_or<int64_t>(j, "num_experts_per_tok", mixtral ? 2 : 8, path);
  m.expert_intermediate =
      mixtral ? c.intermediate_size : get_or<int64_t>(j, "moe_intermediate_size", 768, path);
  m.norm_topk_prob = mixtral || get_or<bool>(j, "norm_topk_prob", false, path);
  m.router_aux_loss_coef = get_or<double>(j, "router_aux_loss_coef", 0.001, path);
  m.output_router_logits = get_or<bool>(j, "output_router_logits", false, path);
  const double jitter = get_or<double>(j, "router_jitter_noise", 0.0, path);
  FT_CHECK_T(FormatError, jitter == 0.0, path, ": router_jitter_noise ", jitter,
             " is not supported (ft's router adds no noise); set it to 0");
  FT_CHECK_T(FormatError, m.num_experts >= 1, path, ": the number of experts must be >= 1");
  m.layers.assign(static_cast<size_t>(c.num_hidden_layers), 1);
  if (mixtral) return;
  const int64_t step = get_or<int64_t>(j, "decoder_sparse_step", 1, path);
  FT_CHECK_T(FormatError, step >= 1, path, ": decoder_sparse_step must be >= 1, got ", step);
  const auto dense = get_or<std::vector<int64_t>>(j, "mlp_only_layers", {}, path);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    m.layers[static_cast<size_t>(i)] =
        (i + 1) % step == 0 && std::find(dense.begin(), dense.end(), i) == dense.end();
}

const Family& family_of(const std::string& model_type, const std::string& path) {
  if (const Family* f = find_family(model_type)) return *f;
  const std::string why = refused_family_reason(model_type);
  FT_CHECK_T(FormatError, !why.empty(), path, ": model_type \"", model_type,
             "\" is not a model family ft trains (", supported_model_types(), ")");
  throw FormatError(fmt::format("{}: model_type \"{}\" is {}; ft trains {}", path, model_type, why,
                                supported_model_types()));
}

void read_shape(const json& j, const Family& f, ModelConfig& c, const std::string& path) {
  c.vocab_size = require<int64_t>(j, "vocab_size", path);
  c.hidden_size = require<int64_t>(j, "hidden_size", path);
  c.intermediate_size = require<int64_t>(j, "intermediate_size", path);
  c.num_hidden_layers = require<int64_t>(j, "num_hidden_layers", path);
  c.num_attention_heads = require<int64_t>(j, "num_attention_heads", path);
  c.num_key_value_heads = get_or<int64_t>(j, "num_key_value_heads", c.num_attention_heads, path);
  FT_CHECK_T(FormatError, c.num_attention_heads > 0, path, ": num_attention_heads must be >= 1");
  const int64_t head_dim =
      f.default_head_dim ? f.default_head_dim : c.hidden_size / c.num_attention_heads;
  c.head_dim = get_or<int64_t>(j, "head_dim", head_dim, path);
  c.max_position_embeddings =
      get_or<int64_t>(j, "max_position_embeddings", f.default_max_position_embeddings, path);
  c.rms_norm_eps = get_or<double>(j, "rms_norm_eps", f.default_rms_norm_eps, path);
  c.initializer_range = get_or<double>(j, "initializer_range", 0.02, path);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", f.default_tie, path);
  if (f.qkv_bias) {
    c.qkv_bias = true;
  } else if (f.attention_bias_key) {
    c.qkv_bias = c.o_bias = get_or<bool>(j, "attention_bias", false, path);
  }
  if (f.mlp_bias_key) c.mlp_bias = get_or<bool>(j, "mlp_bias", false, path);
  c.bos_token_id = get_or<int64_t>(j, "bos_token_id", 1, path);
  c.pad_token_id = get_or<int64_t>(j, "pad_token_id", -1, path);
  if (c.pad_token_id >= c.vocab_size || c.pad_token_id < -1) c.pad_token_id = -1;
  if (j.contains("eos_token_id") && j["eos_token_id"].is_array()) {
    c.eos_token_id = j["eos_token_id"].empty() ? 2 : j["eos_token_id"][0].get<int64_t>();
  } else {
    c.eos_token_id = get_or<int64_t>(j, "eos_token_id", 2, path);
  }
}

}  // namespace

ModelConfig load_model_config(const std::string& path) {
  FT_CHECK_T(FormatError, std::ifstream(path).good(), "cannot read model config ", path,
             ": the model directory needs a Hugging Face config.json");
  const std::string text = read_text_file<FormatError>(path);
  const json j = parse_json<FormatError>(text, path);
  FT_CHECK_T(FormatError, j.is_object(), path, ": expected a JSON object");
  ModelConfig c;
  c.model_type = get_or<std::string>(j, "model_type", "llama", path);
  const Family& f = family_of(c.model_type, path);
  read_quantization(j, c, path);
  read_shape(j, f, c, path);
  refuse_dropout(j, path);
  c.activation = read_activation(j, f, path);
  read_rotary(j, f, c, path);
  read_windows(j, f, c, path);
  read_scales(j, f, c, path);
  read_moe(j, f, c, path);
  c.source_json = text;
  try {
    c.validate(path);
  } catch (const ConfigError& e) {
    throw FormatError(e.what());
  }
  return c;
}

namespace {

json rope_json(const RopeConfig& r) {
  json o = {{"rope_type", r.type}, {"rope_theta", r.theta}};
  if (r.type == "linear") o["factor"] = r.factor;
  if (r.type == "llama3") {
    o["factor"] = r.factor;
    o["low_freq_factor"] = r.low_freq_factor;
    o["high_freq_factor"] = r.high_freq_factor;
    o["original_max_position_embeddings"] = r.original_max_position_embeddings;
  }
  if (r.type == "longrope") {
    o["short_factor"] = r.short_factor;
    o["long_factor"] = r.long_factor;
    o["attention_factor"] = r.attention_factor;
    o["original_max_position_embeddings"] = r.original_max_position_embeddings;
  }
  return o;
}

void moe_json(const ModelConfig& c, json& j) {
  const MoeConfig& m = c.moe;
  const bool mixtral = c.family().moe == MoeStyle::kMixtral;
  j["num_local_experts"] = m.num_experts;
  j["num_experts_per_tok"] = m.experts_per_token;
  j["router_aux_loss_coef"] = m.router_aux_loss_coef;
  j["output_router_logits"] = m.output_router_logits;
  if (mixtral) return;
  j["moe_intermediate_size"] = m.expert_intermediate;
  j["norm_topk_prob"] = m.norm_topk_prob;
  j["decoder_sparse_step"] = 1;
  json dense = json::array();
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (!c.is_moe_layer(i)) dense.push_back(i);
  j["mlp_only_layers"] = dense;
}

// A config.json from the fields alone (a preset's shape, or a test's config).
json built_config(const ModelConfig& c) {
  const Family& f = c.family();
  json j = {{"architectures", {f.architecture}},
            {"model_type", c.model_type},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.num_hidden_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_key_value_heads},
            {"head_dim", c.head_dim},
            {"max_position_embeddings", c.max_position_embeddings},
            {"rms_norm_eps", c.rms_norm_eps},
            {"initializer_range", c.initializer_range},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {f.activation_key, c.activation == Activation::kSilu ? "silu" : "gelu_pytorch_tanh"},
            {"bos_token_id", c.bos_token_id},
            {"eos_token_id", c.eos_token_id},
            {"dtype", "float32"},
            {"torch_dtype", "float32"}};
  if (f.attention_bias_key) j["attention_bias"] = c.o_bias;
  if (f.mlp_bias_key) j["mlp_bias"] = c.mlp_bias;
  if (c.has_local_rope) {
    j["rope_parameters"] = {{"full_attention", rope_json(c.rope)},
                            {"sliding_attention", rope_json(c.local_rope)}};
  } else {
    j["rope_parameters"] = rope_json(c.rope);
    if (f.partial_rotary) j["rope_parameters"]["partial_rotary_factor"] = c.partial_rotary_factor;
  }
  if (f.windows != WindowRule::kNone) {
    int64_t w = 0;
    json types = json::array();
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      w = std::max(w, c.window(i));
      types.push_back(c.window(i) ? "sliding_attention" : "full_attention");
    }
    j["sliding_window"] = w ? json(w) : json(nullptr);
    if (f.windows == WindowRule::kFromMaxWindowLayers) j["use_sliding_window"] = w > 0;
    if (f.windows != WindowRule::kAll || c.model_type == "ministral") j["layer_types"] = types;
  }
  if (f.soft_caps) {
    j["attn_logit_softcapping"] = c.attn_softcap > 0 ? json(c.attn_softcap) : json(nullptr);
    j["final_logit_softcapping"] = c.final_softcap > 0 ? json(c.final_softcap) : json(nullptr);
  }
  if (f.query_pre_attn_scalar)
    j["query_pre_attn_scalar"] = 1.0 / (c.attention_scale * c.attention_scale);
  if (f.moe != MoeStyle::kNone) moe_json(c, j);
  if (f.multipliers) {
    j["embedding_multiplier"] = c.embedding_scale;
    j["residual_multiplier"] = c.residual_multiplier;
    j["attention_multiplier"] = c.softmax_scale();
    j["logits_scaling"] = c.logits_divisor;
  }
  return j;
}

}  // namespace

std::string model_config_json(const ModelConfig& c) {
  if (c.source_json.empty()) return built_config(c).dump(2) + "\n";
  // The file as read, with the shape ft trained (the same numbers unless a caller changed them).
  json j = json::parse(c.source_json);
  // ft writes unquantized weights only (a QLoRA base is dequantized to merge into it).
  j.erase("quantization_config");
  const json shape = built_config(c);
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "num_key_value_heads", "tie_word_embeddings"})
    j[key] = shape[key];
  return j.dump(2) + "\n";
}

}  // namespace ft::model

#include "model/config.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/json.h"

namespace ft::model {

using nlohmann::json;

int64_t LlamaConfig::num_parameters() const {
  const int64_t q = num_attention_heads * head_dim, kv = num_key_value_heads * head_dim;
  int64_t per_layer = hidden_size * q + 2 * hidden_size * kv + q * hidden_size +
                      3 * hidden_size * intermediate_size + 2 * hidden_size;
  if (attention_bias) per_layer += q + 2 * kv + hidden_size;
  if (mlp_bias) per_layer += 2 * intermediate_size + hidden_size;
  int64_t emb = vocab_size * hidden_size;
  return emb * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * per_layer + hidden_size;
}

void LlamaConfig::validate(const std::string& where) const {
  auto pos = [&](const char* key, int64_t v) {
    FT_CHECK(v > 0, where, ": ", key, " must be >= 1, got ", v);
  };
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
  FT_CHECK(rms_norm_eps > 0, where, ": rms_norm_eps must be > 0");
  FT_CHECK(rope.theta > 0, where, ": rope_theta must be > 0");
  FT_CHECK(rope.type == "default" || rope.type == "linear" || rope.type == "llama3", where,
           ": rope type '", rope.type, "' is not supported (default, linear, llama3)");
  FT_CHECK(rope.factor > 0, where, ": rope factor must be > 0");
  if (rope.type == "llama3") {
    FT_CHECK(rope.high_freq_factor > rope.low_freq_factor, where,
             ": rope high_freq_factor must exceed low_freq_factor");
  }
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

void read_rope(const json& r, RopeConfig& rope, const std::string& file, const char* where) {
  std::string type = r.contains("rope_type") ? get_or<std::string>(r, "rope_type", "default", file)
                                             : get_or<std::string>(r, "type", "default", file);
  FT_CHECK_T(FormatError, type == "default" || type == "linear" || type == "llama3", file, ": \"",
             where, "\" type '", type,
             "' is not supported by ft (supported: default, linear, llama3); refusing rather than "
             "computing different positions");
  rope.type = type;
  rope.theta = get_or<double>(r, "rope_theta", rope.theta, file);
  rope.factor = get_or<double>(r, "factor", rope.factor, file);
  rope.low_freq_factor = get_or<double>(r, "low_freq_factor", rope.low_freq_factor, file);
  rope.high_freq_factor = get_or<double>(r, "high_freq_factor", rope.high_freq_factor, file);
  rope.original_max_position_embeddings = get_or<int64_t>(
      r, "original_max_position_embeddings", rope.original_max_position_embeddings, file);
}

}  // namespace

LlamaConfig load_llama_config(const std::string& path) {
  std::ifstream in(path);
  FT_CHECK_T(FormatError, in.good(), "cannot read model config ", path,
             ": the model directory needs a Hugging Face config.json");
  std::stringstream text;
  text << in.rdbuf();
  const json j = parse_json<FormatError>(text.str(), path);
  FT_CHECK_T(FormatError, j.is_object(), path, ": expected a JSON object");
  LlamaConfig c;
  c.model_type = get_or<std::string>(j, "model_type", "llama", path);
  FT_CHECK_T(FormatError, c.model_type == "llama" || c.model_type == "mistral", path,
             ": model_type \"", c.model_type,
             "\" is not a Llama-family model ft supports (llama, mistral)");
  c.vocab_size = require<int64_t>(j, "vocab_size", path);
  c.hidden_size = require<int64_t>(j, "hidden_size", path);
  c.intermediate_size = require<int64_t>(j, "intermediate_size", path);
  c.num_hidden_layers = require<int64_t>(j, "num_hidden_layers", path);
  c.num_attention_heads = require<int64_t>(j, "num_attention_heads", path);
  c.num_key_value_heads = get_or<int64_t>(j, "num_key_value_heads", c.num_attention_heads, path);
  FT_CHECK_T(FormatError, c.num_attention_heads > 0, path, ": num_attention_heads must be >= 1");
  c.head_dim = get_or<int64_t>(j, "head_dim", c.hidden_size / c.num_attention_heads, path);
  c.max_position_embeddings = get_or<int64_t>(j, "max_position_embeddings", 2048, path);
  c.rms_norm_eps = get_or<double>(j, "rms_norm_eps", 1e-6, path);
  c.initializer_range = get_or<double>(j, "initializer_range", 0.02, path);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false, path);
  c.attention_bias = get_or<bool>(j, "attention_bias", false, path);
  c.mlp_bias = get_or<bool>(j, "mlp_bias", false, path);
  c.bos_token_id = get_or<int64_t>(j, "bos_token_id", 1, path);
  if (j.contains("eos_token_id") && j["eos_token_id"].is_array()) {
    c.eos_token_id = j["eos_token_id"].empty() ? 2 : j["eos_token_id"][0].get<int64_t>();
  } else {
    c.eos_token_id = get_or<int64_t>(j, "eos_token_id", 2, path);
  }
  const double attention_dropout = get_or<double>(j, "attention_dropout", 0.0, path);
  FT_CHECK_T(FormatError, attention_dropout == 0.0, path, ": attention_dropout ", attention_dropout,
             " is not supported (ft's attention has no dropout)");
  std::string act = get_or<std::string>(j, "hidden_act", "silu", path);
  FT_CHECK_T(FormatError, act == "silu", path, ": hidden_act \"", act,
             "\" is not supported (Llama-family models use silu)");
  if (c.model_type == "mistral") {
    // Mistral v0.1 used a 4096-token sliding window; a window ft would not apply is refused when it
    // can matter (sequences longer than the window are possible).
    auto sw = j.find("sliding_window");
    if (sw != j.end() && !sw->is_null()) {
      int64_t w = get_or<int64_t>(j, "sliding_window", 0, path);
      FT_CHECK_T(FormatError, w >= c.max_position_embeddings, path, ": sliding_window ", w,
                 " is shorter than max_position_embeddings ", c.max_position_embeddings,
                 "; ft's attention is full causal. Set sliding_window to null for sequences up to ",
                 w, " tokens");
    }
  }
  // Rotary settings: transformers >= 5 writes "rope_parameters"; older files "rope_theta" +
  // "rope_scaling" (with "type" or "rope_type").
  c.rope.theta = get_or<double>(j, "rope_theta", 10000.0, path);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object())
    read_rope(j["rope_parameters"], c.rope, path, "rope_parameters");
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object())
    read_rope(j["rope_scaling"], c.rope, path, "rope_scaling");
  try {
    c.validate(path);
  } catch (const ConfigError& e) {
    throw FormatError(e.what());
  }
  return c;
}

std::string llama_config_json(const LlamaConfig& c) {
  json j = {
      {"architectures", {c.model_type == "mistral" ? "MistralForCausalLM" : "LlamaForCausalLM"}},
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
      {"attention_bias", c.attention_bias},
      {"mlp_bias", c.mlp_bias},
      {"hidden_act", "silu"},
      {"rope_theta", c.rope.theta},
      {"bos_token_id", c.bos_token_id},
      {"eos_token_id", c.eos_token_id},
      {"torch_dtype", "float32"}};
  if (c.model_type == "mistral") j["sliding_window"] = nullptr;  // full attention, as trained
  if (c.rope.type == "linear") {
    j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", c.rope.factor}};
  } else if (c.rope.type == "llama3") {
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", c.rope.factor},
        {"low_freq_factor", c.rope.low_freq_factor},
        {"high_freq_factor", c.rope.high_freq_factor},
        {"original_max_position_embeddings", c.rope.original_max_position_embeddings}};
  }
  return j.dump(2) + "\n";
}

}  // namespace ft::model

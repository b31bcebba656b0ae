// The architecture of a Llama-family model (Llama 2, Llama 3/3.1, Mistral), read from a Hugging
// Face config.json or built from a preset's shape. Plain data; thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace ft::model {

struct RopeConfig {
  std::string type = "default";  // default | linear | llama3
  double theta = 10000.0;
  double factor = 1.0;                              // linear, llama3
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3
};

struct LlamaConfig {
  std::string model_type = "llama";  // llama | mistral
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
  bool attention_bias = false;
  bool mlp_bias = false;
  RopeConfig rope;
  int64_t bos_token_id = 1;
  int64_t eos_token_id = 2;

  // Parameter count of the full model (embeddings and head included, tied counted once).
  int64_t num_parameters() const;
  // Throws ConfigError when the shape is inconsistent (heads not dividing, GQA groups...).
  void validate(const std::string& where) const;
};

// Reads config.json; throws FormatError naming the file and key for missing or wrong-typed keys and
// for features ft does not implement (refused, never silently ignored).
LlamaConfig load_llama_config(const std::string& path);

// The config.json ft writes next to exported weights (round-trips through load_llama_config and
// loads in transformers).
std::string llama_config_json(const LlamaConfig& c);

}  // namespace ft::model

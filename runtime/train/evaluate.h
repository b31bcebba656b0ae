// `ft eval`: the mean token loss (and perplexity) of a model, optionally with a LoRA adapter, over
// every record of a JSONL file, each record once, rendered and masked as training would.
// Not thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "config/settings.h"

namespace ft::train {

struct EvalOptions {
  config::DataSettings data;   // how to read the records (the preset's data section)
  std::string model_dir;       // Hugging Face directory (config.json + safetensors)
  std::string adapter_dir;     // PEFT adapter directory, or ""
  std::string data_path;       // JSONL
  std::string tokenizer_path;  // default: <model_dir>/tokenizer.json
};

struct EvalResult {
  double loss = 0;        // mean token loss over every trained token
  int64_t tokens = 0;     // tokens that carried a loss
  double perplexity = 0;  // exp(loss)
  int64_t records = 0;
  int64_t truncated = 0;  // records cut to data.seq_len
  nlohmann::json to_json() const;
};

EvalResult evaluate(const EvalOptions& options);

}  // namespace ft::train

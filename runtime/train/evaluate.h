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
  config::EvalSettings eval;   // long records, tokens per forward
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
  int64_t windowed = 0;  // records longer than data.seq_len, split into windows
  int64_t windows = 0;   // the windows they made
  int64_t forwards = 0;  // batches run
  int64_t padding = 0;   // padding tokens in them
  nlohmann::json to_json() const;
};

// Every record once, tokenized whole (in parallel), sorted by length and batched up to
// eval.batch_tokens with padding only to the longest record of its batch (causal attention, no
// mask); a record longer than data.seq_len is split into windows or refused (eval.long_records).
// The mean is over every token that carries a loss, each scored exactly once.
EvalResult evaluate(const EvalOptions& options);

}  // namespace ft::train

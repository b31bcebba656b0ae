// The end of a training run: final/ written from the engine's shards one tensor at a time. Rank 0
// writes each tensor as it receives its pieces from the ranks holding them; the other ranks walk
// the writer's order (io::write_order) to send theirs in step, so no rank holds more of the model
// than its own shards and the one tensor being written. Every rank calls it (collectives); not
// thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "model/config.h"
#include "model/lora.h"
#include "parallel/engine.h"

namespace ft::train {

struct FinalSaveOptions {
  std::string output_dir;                   // final/ and final_save.json go here
  model::LlamaConfig config;                // written as config.json for a full model
  const model::LoraConfig* lora = nullptr;  // a PEFT adapter (fp32) when set
  at::ScalarType dtype = at::kFloat;        // a full model's stored dtype (the compute dtype)
  // Copied beside the model (the tokenizer it was trained with), by rank 0.
  std::vector<std::string> tokenizer_files;
};

// Writes OUTPUT/final and, on rank 0, final_save.json (time, bytes, rank 0's peak memory).
void save_final(parallel::Engine& engine, const FinalSaveOptions& options);

}  // namespace ft::train

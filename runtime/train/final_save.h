// The end of a training run: final/ written from the engine's shards one tensor at a time. Rank 0
// writes each tensor as it receives its pieces from the ranks holding them; the other ranks walk
// the writer's order (io::write_order) to send theirs in step, so no rank holds more of the model
// than its own shards and the one tensor being written. Every rank calls it (collectives); not
// thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "core/worker_contract.h"
#include "model/config.h"
#include "model/lora.h"
#include "parallel/engine.h"

namespace ft::train {

struct FinalSaveOptions {
  std::string output_dir;                   // final/ and final_save.json go here
  model::ModelConfig config;                // written as config.json for a full model
  const model::LoraConfig* lora = nullptr;  // a PEFT adapter (fp32) when set
  at::ScalarType dtype = at::kFloat;        // a full model's stored dtype (the compute dtype)
  // Copied beside the model (the tokenizer it was trained with), by rank 0.
  std::vector<std::string> tokenizer_files;
  // The chat template the data was rendered with (Jinja source), written as chat_template.jinja;
  // "" when none was (write_tokenizer_files).
  std::string chat_template;
  // For the message of a failed save: the newest committed checkpoint ("" if none) and its step.
  std::string last_checkpoint;
  int64_t last_checkpoint_step = 0, steps = 0;
};

// final/ was not written (a full disk, an unwritable file): every rank gets it, with rank 0's
// account (the file, the free space), and exits 74 like a failed checkpoint save.
class FinalSaveError : public Error {
 public:
  using Error::Error;
  int exit_code() const override { return contract::kExitSaveFailed; }
};

// Writes OUTPUT/final and, on rank 0, final_save.json (time, bytes, rank 0's peak memory). When
// rank 0 cannot write, it still takes part in every gather (so no rank waits for it), removes the
// incomplete final/, and every rank throws FinalSaveError.
void save_final(parallel::Engine& engine, const FinalSaveOptions& options);

}  // namespace ft::train

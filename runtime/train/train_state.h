// A training run's state and its checkpoints, both ways (torchtitan's state_dict /
// load_state_dict): this rank's share of the masters, Adam moments, generator states, loop
// counters and data position as a ckpt::Snapshot; choosing the checkpoint to resume from (every
// rank verifies the chunks it will read, the ranks agree); and restoring the trainer, data source
// and generators from it. Not thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/checkpoint.h"
#include "data/batch.h"
#include "parallel/engine.h"
#include "train/trainer.h"

namespace ft::train {

// What a checkpoint records about the run beside its tensors (what `ft export` reads back).
struct RunRecord {
  nlohmann::json preset;   // the resolved preset
  bool lora = false;       // the trained tensors are adapters
  std::string base_model;  // the --model directory, "" for a random init
  std::string tokenizer;   // the --tokenizer file that final/ copies, "" when none
  std::string strategy;    // the strategy's label
  // The chat template the data was rendered with (Jinja source), "" when none was: what an export
  // writes as chat_template.jinja (saved_model.h write_tokenizer_files).
  std::string chat_template;
};

// This rank's share of the training state at the trainer's current step. Host tensors are handed
// over as views (an async saver copies them on its own thread); device tensors are copied.
ckpt::Snapshot make_snapshot(parallel::Engine& engine, Trainer& trainer,
                             const data::BatchSource& source, const RunRecord& record, int rank);

// The newest of `candidates` (committed step directories, newest first) whose every chunk this
// rank reads (`held`: its pieces) reads back whole, agreed by every rank through a collective;
// null when none is left. With `resume` "auto" a damaged one is named and the previous one tried;
// with an explicit directory it is an error. `unusable` gets each one passed over and why (this
// rank's reason, or that another rank found it damaged), for events.jsonl.
std::unique_ptr<ckpt::Checkpoint> choose_checkpoint(
    const std::vector<std::string>& candidates, const std::vector<parallel::Engine::Piece>& held,
    parallel::Engine& engine, const std::string& resume,
    std::vector<std::pair<std::string, std::string>>* unusable = nullptr);

// Optimizer state, loop counters, generator states and data position from `ck`, after the
// parameters were loaded from it. At the same world size every rank continues its own streams; at
// another, the saving run's last rank's data position (the global stream) is continued.
void restore_state(const ckpt::Checkpoint& ck, const std::vector<parallel::Engine::Piece>& held,
                   Trainer& trainer, data::BatchSource& source, int rank, int world_size,
                   at::Device device);

}  // namespace ft::train

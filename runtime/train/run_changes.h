// What a command asks of a run directory that already holds a run: the earlier run's inputs (its
// preset.json and run.json), this command's, and what differs between them, judged by the schema's
// OnResume of each key. ft train refuses a change of what the run computes before anything is
// loaded or written, unless --resume-changed says it is meant (docs/training.md "Continuing a run
// with other settings"). Pure functions over files and JSON; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "config/schema.h"
#include "train/run.h"

namespace ft::train {

// What a run was given beside its preset: written as OUTPUT/run.json when it starts.
struct RunInputs {
  nlohmann::json preset;     // the resolved preset (preset.json)
  std::string model;         // --model's directory, absolute; "" for a random init
  std::string model_config;  // the CRC-32C of its config.json as 8 hex digits; "" without
  // --data's sources: [{"path": absolute, "weight": w, "bytes": size}], in the order given.
  nlohmann::json data = nlohmann::json::array();
  std::string tokenizer;  // the tokenizer file the data is read with, absolute; "" when none
  int64_t world_size = 1;
  bool has_inputs = true;  // false: a run of an ft before run.json (its preset only is known)
};

inline constexpr const char* kRunInputsFile = "run.json";

// This command's inputs on a job of `world_size` ranks.
RunInputs inputs_of(const RunOptions& o, int64_t world_size);
nlohmann::json to_json(const RunInputs& in);

// The inputs of the run `output_dir` holds; nullopt when it holds none (no preset.json). A file
// that cannot be read as JSON is a ConfigError naming it.
std::optional<RunInputs> recorded_inputs(const std::string& output_dir);

struct SettingChange {
  std::string key;  // a schema key, or "model", "model config.json", "data", "tokenizer",
                    // "global batch"
  nlohmann::json was, now;
  config::OnResume effect = config::OnResume::kComputes;
  std::string note;  // why it has that effect, when the key alone does not say
};

// Every difference, in schema order, then the inputs beside the preset. kBatch keys are judged
// together: free while micro_batch x grad_accum x ranks stays, else one "global batch" change;
// on a `launcher_restart` (a later round of ft launch, which may have other ranks) the ranks
// alone are free.
std::vector<SettingChange> changes_between(const RunInputs& was, const RunInputs& now,
                                           bool launcher_restart);

// "lora.r 16 -> 8", with the note in parentheses.
std::string change_text(const SettingChange& c);
nlohmann::json change_json(const SettingChange& c);

// The verdict on continuing the run in `output_dir` with `changes`: throws ConfigError listing the
// changes that are not free, and the ways on (a new --output; the earlier values; --resume-changed
// where the state still fits), unless `resume_changed` and none changes the state's shape.
// Returns the changes that the run goes on with (free ones, and the others when resume_changed).
std::vector<SettingChange> judge_changes(const std::vector<SettingChange>& changes,
                                         const std::string& output_dir, bool resume_changed);

}  // namespace ft::train

// A whole training run as `ft train` performs it, on one rank or on every rank of a job under
// `ft launch`: resolve what the preset asks for, plan the strategy, build the model shapes, let the
// strategy load this rank's slices (random init from the preset's shape, or a Hugging Face
// directory), attach LoRA, pick the data source, train, report (rank 0 writes the shared files,
// every rank its own metrics when there are several). Validates every input before writing
// anything, and never writes over an earlier run. Not thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/settings.h"
#include "core/worker_contract.h"

namespace ft::train {

struct RunOptions {
  config::Settings settings;  // the resolved preset (config::resolve_settings)
  std::string model_dir;      // "" = random init from preset.model
  // --data, once per source: PATH or PATH:WEIGHT (data/mixture.h); none = the preset's data
  // (data.sources, or the synthetic task).
  std::vector<std::string> data_paths;
  std::string tokenizer_path;  // tokenizer.json for --data; default: <model_dir>/tokenizer.json
  std::string data_cache_dir;  // ft data prepare's caches of --data; default: <PATH>.ftcache
  std::string output_dir;      // created; must not hold an earlier run unless resuming it
  // "auto": the newest committed checkpoint in output_dir/checkpoints that reads back whole (older
  // ones if not), else a fresh start; "none": a fresh start; else a checkpoint directory.
  std::string resume = "auto";
  // Continue the run --output holds although settings that change what it computes differ from
  // its own (train/run_changes.h); recorded in events.jsonl.
  bool resume_changed = false;
  // The plan's expected time to the first step (plan/preflight.h), shown while loading; 0: none.
  double expected_start_s = 0;
  // The preflight's plan (plan::plan_json), written to plan.json for `ft report`; null: none.
  nlohmann::json plan;
};

struct RunSummary {
  int64_t steps = 0;       // the last step trained
  int64_t first_step = 0;  // the first step this process trained (past 1 when it resumed)
  int64_t ran = 0;         // steps this process trained (skipped fp16 steps not counted)
  double first_loss = 0, last_loss = 0;
  int64_t skipped_steps = 0;
  bool preempted = false;  // stopped by SIGTERM after writing a checkpoint (no final model)
};

// ft train's exit code after SIGTERM: a checkpoint of the last finished step was written and the
// run stopped; the same command continues it. The launcher passes it on (core/worker_contract.h).
using contract::kExitPreempted;

struct OutputPlan;  // train/run_dir.h

// `out`: plan_output's decision on the output directory, taken before the preflight.
RunSummary run_training(const RunOptions& options, OutputPlan out);

// Optimizer steps that `epochs` passes over data of `rows_per_epoch` sequences take, when each
// step takes micro_batch * grad_accum sequences on each of world_size ranks:
// ceil(epochs * rows_per_epoch / (micro_batch * grad_accum * world_size)), at least 1. Throws
// ConfigError for epochs <= 0.
int64_t steps_for_epochs(double epochs, int64_t rows_per_epoch, int64_t micro_batch,
                         int64_t grad_accum, int64_t world_size);

}  // namespace ft::train

// A run's output directory before the run starts: what it holds (an earlier run, its checkpoints,
// its final model), whether this command may continue it (train/run_changes.h), and what it
// resumes from. Decided on every rank alike from the files alone, before anything is loaded or
// written; not thread-safe (prints on rank 0).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/dist_env.h"
#include "train/run.h"
#include "train/run_changes.h"

namespace ft::train {

struct OutputPlan {
  std::string ckpt_root;                // OUTPUT/checkpoints
  std::vector<std::string> candidates;  // checkpoints to resume from, newest first
  bool finished = false;                // the run is already finished: nothing to do
  int64_t finished_step = -1;           // the step its final/ holds, when finished
  bool started_over = false;            // an interrupted run without a checkpoint, begun anew
  std::vector<nlohmann::json> damage;   // events.jsonl records of damaged checkpoints found
  // What differs from the run the directory holds (allowed ones only: judge_changes refused the
  // rest), recorded in events.jsonl; and whether --resume-changed allowed some.
  std::vector<SettingChange> changes;
  bool resume_changed = false;
  RunInputs inputs;  // this command's, written to OUTPUT/run.json
};

// The events.jsonl record of a damaged checkpoint directory.
nlohmann::json damaged_checkpoint(const std::string& dir, const std::string& reason);

// The step a run's final/ holds: final_save.json's, else the events' last "finished" (runs from
// before final_save.json recorded it); -1 when there is no complete final/ or neither says.
int64_t final_step(const std::filesystem::path& run_dir);

// "OUT already finished at step N ...: nothing to do ...", for a plan that is `finished`.
std::string finished_text(const OutputPlan& out, const std::string& output_dir);

// Throws ConfigError for an output that holds another run, or this run with changes that are not
// allowed (judge_changes), and for --resume that names no committed checkpoint.
OutputPlan plan_output(const RunOptions& o, const comm::DistEnv& env);

}  // namespace ft::train

// Reading a run directory's records back for `ft report`: metrics.jsonl (and each rank's
// metrics.rank<k>.jsonl), checkpoints.jsonl, events.jsonl, preset.json and plan.json, as a running,
// resumed, interrupted or damaged run left them. Nothing here throws on a bad record: a torn last
// line, a line that is not JSON, a missing file are noted in `issues` and the rest is read.
// Pure functions over files; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace ft::report {

// One optimizer step's record (metrics.jsonl, docs/training.md#metricsjsonl), the fields the
// report draws.
struct StepPoint {
  int64_t step = 0;
  double loss = 0;
  std::optional<double> eval_loss;  // a step that evaluated (eval.every)
  double lr = 0;
  std::optional<double> grad_norm;  // null on a skipped fp16 step
  double tokens_per_s = 0;
  double mfu = 0;
  double step_time_s = 0;
  // The step-time breakdown (time.*), seconds.
  double data_s = 0, compute_s = 0, comm_s = 0, optimizer_s = 0, checkpoint_s = 0, other_s = 0;
  bool skipped = false;  // fp16 overflow: no update (its step repeats the previous number)
  double loss_scale = 1;
  // Memory: the step's peak as the plan's step_peak counts it (the GPU's peak allocation on a GPU
  // job, the process's peak resident set on a CPU job), and the model state.
  int64_t peak_bytes = 0;
  bool peak_on_gpu = false;
  int64_t model_state_bytes = 0;  // param + grad + optimizer bytes
  // A mixture's step (source_records, source_tokens): each source's records and input tokens,
  // over all ranks, by source name; empty for one file or the synthetic task.
  std::map<std::string, int64_t> source_records, source_tokens;
  // A mixture-of-experts model's step (metrics.jsonl moe): the load-balancing loss when it was
  // added, and per MoE layer (model index) its most-loaded expert's picks over the mean.
  std::optional<double> aux_loss;
  std::map<int64_t, double> expert_imbalance;
  // This rank's own work: step time less exposed communication.
  double busy_s() const { return step_time_s - comm_s; }
};

// Something on the run's timeline.
struct Event {
  enum class Kind {
    kStart,
    kStartOver,  // a start from step 0 after an attempt that committed no checkpoint
    kResume,
    kRestart,
    kCheckpoint,
    kCheckpointFailed,
    kCheckpointDamaged,  // found unusable (meta.json lost, a chunk's checksum) when resuming
    kPreempted,
    kFinished,
    kSkipped,
    kSettingsChanged  // the run continued with other settings (train/run_changes.h)
  };
  Kind kind = Kind::kStart;
  int64_t step = 0;    // the step it happened after (a start: the step it starts from)
  std::string detail;  // one line: "SIGTERM", "rank 1 exited with code 1 ...", "async, 0.02 s"
};
const char* event_name(Event::Kind kind);

// A file the report wanted and did not get whole.
struct Issue {
  std::string file;  // relative to the run directory
  std::string what;  // "missing", "line 17: not JSON (skipped)", ...
};

struct RunRecords {
  std::string dir;
  std::vector<StepPoint> steps;    // metrics.jsonl: by step, one per step (see read_run)
  std::vector<StepPoint> skipped;  // fp16 steps skipped, in order
  std::map<int, std::vector<StepPoint>> ranks;  // metrics.rank<k>.jsonl, world size > 1
  std::vector<Event> events;                    // the timeline, in the order it happened
  nlohmann::json preset;                        // preset.json (null when missing)
  nlohmann::json plan;         // plan.json: the preflight's plan (null when missing)
  nlohmann::json environment;  // the last start record of events.jsonl (null: none)
  bool finished = false;       // events.jsonl or final/ says the run ended
  std::vector<Issue> issues;
};

// Reads everything the report shows from `dir`. A resumed run's metrics.jsonl may hold steps
// twice (a restart redoes the steps after its checkpoint): the later record of a step wins and the
// curve is one, sorted by step. Throws ConfigError only when `dir` is not a directory.
RunRecords read_run(const std::string& dir);

// The JSON objects of a JSONL file, in order; each line that is not one is noted in `issues`
// under `name` (a torn last line as the run still writing it, or killed while writing it).
std::vector<nlohmann::json> read_jsonl(const std::string& path, const std::string& name,
                                       std::vector<Issue>& issues);

}  // namespace ft::report

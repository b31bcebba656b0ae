// What a run reports: metrics.jsonl (one JSON object per optimizer step, flushed as written, so a
// killed run keeps every finished step) and the console (a progress bar with ETA on a terminal,
// one line per logging interval otherwise). Not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "train/trainer.h"

namespace ft::train {

// Where one optimizer step's wall time went on this rank, seconds. The parts add up to the step
// time: other_s is what none of them covers (the profiler, logging, the loop).
struct StepTimes {
  double data_s = 0;        // waiting for the step's micro-batches (and moving them to the device)
  double compute_s = 0;     // forward and backward, less the waits on communication inside them
  double comm_s = 0;        // exposed communication: blocked on collectives, including waiting for
                            // slower ranks (what overlap did not hide)
  double optimizer_s = 0;   // unscaling, clipping and AdamW, less the waits on communication
  double checkpoint_s = 0;  // the checkpointer: its per-step agreement, copies and saves when due
  double other_s = 0;
  // This rank's own work: the step less exposed communication (what finds a straggler).
  double busy_s() const { return data_s + compute_s + optimizer_s + checkpoint_s + other_s; }
};

// Over all ranks, on rank 0's record (world size > 1).
struct RanksSummary {
  bool known = false;
  double busy_median_s = 0;  // the ranks' median busy time
  int64_t input_tokens = 0;  // every rank's non-padding tokens of the step
  double busy_max_s = 0;
  int slowest_rank = 0;
};

// One source of a mixture in a step: its records and input tokens placed in the step's batches,
// over all ranks (metrics.jsonl's source_records and source_tokens).
struct SourceCount {
  std::string name;
  int64_t records = 0, tokens = 0;
};

struct StepRecord {
  StepStats stats;
  double step_time_s = 0;  // the whole iteration: data to checkpoint (StepTimes)
  StepTimes times;
  double flops = 0;         // model FLOPs of this rank's step (model/flops.h), its input tokens
  double peak_flops_s = 0;  // the device's peak it is measured against (train/device_peak.h)
  double mfu() const {
    return peak_flops_s > 0 && step_time_s > 0 ? flops / step_time_s / peak_flops_s : 0;
  }
  RanksSummary ranks;
  int64_t input_tokens = 0;  // non-padding tokens processed this step (this rank)
  double tokens_per_s = 0;   // input_tokens / step_time_s
  // The job's: every rank's tokens over rank 0's step time (the ranks step together).
  double job_tokens_per_s() const {
    return ranks.known && step_time_s > 0 ? static_cast<double>(ranks.input_tokens) / step_time_s
                                          : tokens_per_s;
  }
  MemoryStats memory;
  int64_t peak_rss_bytes = 0;
  int64_t samples_consumed = 0;
  std::vector<SourceCount> sources;  // a mixture's sources (data/mixture.h); empty otherwise
  // Expert parallelism's token exchange this step (parallel/expert_exchange.h: ExchangeStats), a
  // part of times.compute_s: wall seconds in dispatches and combines (forward and backward), and
  // the bytes that left and reached this rank.
  bool exchanged = false;
  double dispatch_s = 0, combine_s = 0;
  double exchange_counts_s = 0;  // of dispatch_s: the row-count exchange, mostly waiting
  int64_t exchange_bytes_sent = 0, exchange_bytes_received = 0;
  // A step after which eval.data was evaluated (eval_tokens > 0): the mean token loss over the
  // whole file, its token count and the seconds it took (not part of step_time_s).
  double eval_loss = 0;
  int64_t eval_tokens = 0;
  double eval_s = 0;
};

class MetricsLog {
 public:
  // "" = no file. keep_through_step >= 0 (a resumed run): the records of steps up to it stay and
  // new ones are appended; later ones (steps the run redoes) are dropped.
  explicit MetricsLog(const std::string& path, int64_t keep_through_step = -1);
  void write(const StepRecord& r);

 private:
  std::ofstream out_;
  std::string path_;
};

// The progress line (a bar on a terminal). Its ETA is the remaining steps at the pace of the last
// kPaceWindow steps of this process: a resumed run counts only the steps it ran itself, and the
// first steps' warm-up fades out of it.
class Progress {
 public:
  static constexpr size_t kPaceWindow = 20;
  // `from_step`: the step the run resumed from (0 for a fresh start).
  Progress(int64_t total_steps, int64_t log_every, int64_t from_step = 0);
  void update(const StepRecord& r);
  void finish();
  // Seconds left after `step` at the recent pace, from the elapsed seconds at each update.
  double eta(double elapsed_s, int64_t step);

 private:
  int64_t total_, every_, from_;
  bool tty_;
  std::chrono::steady_clock::time_point start_;
  std::deque<std::pair<double, int64_t>> recent_;  // (elapsed seconds, step) of recent updates
};

// Peak resident set size of this process (VmHWM), bytes.
int64_t peak_rss_bytes();
// Resident set size of this process now (VmRSS), bytes.
int64_t rss_bytes();
// Resets the peak resident size to the current one (Linux: "5" into /proc/self/clear_refs), so
// peak_rss_bytes() measures one phase. False where the kernel refuses (then the peak is since
// start).
bool reset_peak_rss();

// How this rank loaded its parameters: written to load.rank<k>.json in the output directory.
struct LoadRecord {
  std::string source;  // "files" or "random init"
  double seconds = 0;
  int64_t bytes_read = 0;        // from the safetensors files (this rank's slices)
  int64_t param_bytes = 0;       // resident parameter bytes afterwards (the engine's accounting)
  int64_t rss_before_bytes = 0;  // resident set just before loading
  int64_t peak_rss_bytes = 0;    // peak resident set while loading
  bool peak_reset = false;       // the peak was reset before loading (else: peak since start)
};
void write_load_record(const std::string& path, const LoadRecord& r, int rank, int world_size);

// How rank 0 wrote the final model: final_save.json in the output directory.
struct FinalSaveRecord {
  int64_t step = 0;  // the step final/ holds (ft export compares it with the checkpoints')
  double seconds = 0;
  int64_t bytes = 0;             // tensor data written
  int64_t rss_before_bytes = 0;  // rank 0's resident set just before
  int64_t peak_rss_bytes = 0;    // its peak while gathering and writing
  bool peak_reset = false;
};
void write_final_save_record(const std::string& path, const FinalSaveRecord& r);

}  // namespace ft::train

// When a training run checkpoints, and the record of each save (torchtitan's checkpointer: the
// loop calls it every step, the cadence is decided here). A save is due every
// output.save_every steps, every output.save_every_minutes by rank 0's clock, at the last step of
// a run that checkpoints at all, and on SIGTERM (preemption) on any rank, after which every rank
// stops. A save that fails on any rank (a full disk), in the background or not, fails on every
// rank alike: the run stops with CheckpointSaveError or warns and goes on, as
// output.on_save_error says. The ranks agree through one scalar collective per step, and a few
// more at each save, in the same order on every rank. Owns the Saver and, on rank 0,
// checkpoints.jsonl. Installs a SIGTERM handler for its lifetime; not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"

namespace ft::ckpt {

// What a run does when a checkpoint cannot be saved (output.on_save_error).
enum class OnSaveError {
  kStop,      // every rank stops with CheckpointSaveError (exit 74); the last commit is intact
  kContinue,  // rank 0 warns, training goes on, the next save tries again
};

struct CheckpointerOptions {
  SaverOptions saver;
  int64_t save_every = 0;         // steps; 0: none by steps
  double save_every_minutes = 0;  // 0: none by time
  bool async_save = true;
  OnSaveError on_save_error = OnSaveError::kStop;
  std::string log_path;  // checkpoints.jsonl; written by rank 0 when the run checkpoints at all
  // The largest of a value over all ranks (one collective, in step on every rank); the value
  // itself on a single rank.
  std::function<double(double)> max_over_ranks;
  std::function<double(double)> sum_over_ranks;  // the same, summed
  // SIGTERM / SIGINT while training: `announce` (rank 0) says at once what happens next; with
  // `second_signal_stops` (ft train run by itself, no launcher to escalate) a second signal ends
  // the process at once, leaving the committed checkpoints as they are.
  bool announce = false;
  bool second_signal_stops = false;
};

class Checkpointer {
 public:
  explicit Checkpointer(CheckpointerOptions options);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Before the optimizer update changes the state: an async save in flight finishes copying it,
  // and the record of that save is completed with the wait.
  void before_update();

  // After the update of optimizer step `step` of `total_steps`: saves when due (every rank
  // calls this at every step: it runs one collective). `snapshot()` makes this rank's share (an
  // async save copies its host tensors on the saver's thread). Returns true when the run must stop
  // now: SIGTERM reached a rank before the last step, and the checkpoint of `step` is durable.
  // Throws CheckpointSaveError on every rank when a save failed on any rank and the run stops
  // (output.on_save_error=stop, or the checkpoint of a SIGTERM).
  bool after_step(int64_t step, int64_t total_steps, const std::function<Snapshot()>& snapshot);

  // The end of the run: the last save is durable (rank 0: committed) and recorded; its failure
  // is treated as after_step treats one.
  void finish(int64_t step);

  // The optimizer step now running, for the message a signal prints.
  void running(int64_t step);
  // What stopping costs, for the launcher (contract::StopEstimate). The newest checkpoint known
  // committed: `resumed_from` (the checkpoint the run started from), a save every rank agreed
  // succeeded, or on rank 0 one its background save committed; -1 when none.
  void resumed_from(int64_t step) { committed_ = step; }
  int64_t committed_step() const;
  // Seconds the last save took on this rank, from its snapshot to its write (and on rank 0 its
  // commit); 0 before one has completed.
  double last_save_s() const;
  // The signal that stopped the run: "SIGTERM" or "SIGINT".
  static const char* stop_signal();

  const std::string& root() const { return options_.saver.root; }

 private:
  void log(const nlohmann::json& record);
  double agree_max(double v) const;
  double agree_sum(double v) const;
  bool settle(bool stopping, std::string error = "");
  void save_failed(int64_t step, const std::string& what, bool stopping);
  void warn_if_no_room(int64_t step, const Snapshot& snapshot) const;

  CheckpointerOptions options_;
  Saver saver_;
  bool rank0_;
  std::ofstream log_;
  std::chrono::steady_clock::time_point last_save_;
  std::optional<nlohmann::json> pending_;  // an async save's record, completed at the next update
  int64_t in_flight_ = -1;  // the step of the save whose outcome the ranks have not agreed on yet
  int64_t committed_ = -1;  // the newest save the ranks agreed on (or resumed_from)
  double snapshot_s_ = 0;   // what the last save's snapshot took, before its write
  std::vector<int64_t> failed_steps_;  // saves that failed (output.on_save_error=continue)
};

}  // namespace ft::ckpt

// What a rank tells the launcher that supervises it, through the launcher's store: progress for
// its hang detection (--hang-timeout), and what stopping it costs (the slowest recent iteration,
// a checkpoint's save, the newest committed step) for the wait between SIGTERM and SIGKILL
// (launcher/grace.h). Does nothing without a store (not launched). One per rank; not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>

#include "core/worker_contract.h"

namespace c10d {
class Store;
}

namespace ft::train {

class LauncherLink {
 public:
  // `store`: the launcher's store under this round's prefix (null: not launched), outliving this;
  // `state_elements`: this rank's trained elements, counted once when a save is first guessed.
  LauncherLink(c10d::Store* store, int rank, std::function<int64_t()> state_elements);

  // At most once a second.
  void report_progress();

  // After `step` (`iteration_s`: its time, checkpoint stalls left out; 0 before the first), with
  // the checkpointer's `committed_step` and `last_save_s` (0: no save measured yet, then guessed
  // from the state's size). At most once a second, and at once when a checkpoint commits.
  void publish_stop_estimate(int64_t step, int64_t committed_step, double last_save_s,
                             double iteration_s);

 private:
  c10d::Store* store_;
  int rank_;
  std::function<int64_t()> state_elements_;
  std::chrono::steady_clock::time_point next_progress_ = std::chrono::steady_clock::now();
  std::deque<double> recent_iterations_s_;  // the last 8
  std::optional<contract::StopEstimate> published_;
  double assumed_save_s_ = -1;  // a save's guessed seconds before one is measured
  std::chrono::steady_clock::time_point next_publish_;
};

}  // namespace ft::train

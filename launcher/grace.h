// How long the launcher waits between SIGTERM and SIGKILL when it stops its workers, and what a
// SIGKILL before their checkpoint loses. `ft train` answers SIGTERM by finishing the step it is in
// and saving a checkpoint, and publishes what those take (contract::StopEstimate); --term-grace
// auto waits for that, and never less than kMinTermGrace. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/worker_contract.h"

namespace ft::launcher {

// --term-grace auto's shortest wait: what a program that publishes no estimate gets.
inline constexpr double kMinTermGrace = 15;
// The margin on an estimate: steps and saves vary (a busy disk, an evaluation after the step).
inline constexpr double kGraceFactor = 1.25;
inline constexpr double kGraceSlack_s = 5;

// One rank's estimate as the launcher read it from the store.
struct RankEstimate {
  int rank = 0;
  contract::StopEstimate estimate;
};

// What stopping the workers waits for, and for how long.
struct StopWait {
  double seconds = kMinTermGrace;  // between SIGTERM and SIGKILL
  bool given = false;              // --term-grace was a number, not auto
  bool known = false;              // the workers published estimates (ft train does)
  int64_t step = 0;                // the step they finish (the last finished + 1)
  double step_s = 0;               // the slowest rank's step; 0: no step finished yet
  double save_s = 0;               // the slowest rank's checkpoint save
  bool save_measured = false;      // every save_s was measured, not estimated
  int64_t committed_step = -1;     // the newest committed checkpoint (-1: none)
  // What finishing the step and saving take, with margin (kGraceFactor, kGraceSlack_s), in whole
  // seconds: what auto waits and what a --term-grace should be at least. 0 when not known.
  double needed_s = 0;
  bool too_short() const { return given && known && seconds < needed_s; }
};

// The wait for workers that published `ranks`. `term_grace_s`: --term-grace as a number, nullopt
// for auto. `checkpointing`: the workers were asked to checkpoint (a signal or a node joining);
// otherwise (a failure: a checkpoint needs every rank) auto waits kMinTermGrace.
StopWait stop_wait(std::optional<double> term_grace_s, const std::vector<RankEstimate>& ranks,
                   bool checkpointing);

// "waiting up to 78 s for the workers to finish step 7 (~28 s a step) and save its checkpoint
// (~30 s, measured), then SIGKILL (--term-grace auto)".
std::string stop_wait_text(const StopWait& w);

// For a --term-grace shorter than what the workers need: what will likely happen and the value
// that would do; "" when it is long enough or nothing is known.
std::string too_short_text(const StopWait& w);

// After `killed` (global ranks) got SIGKILL, when the wait ran out or (`cut_short`) a second
// signal ended it: what was lost, from `w` (read at the signal) and `now` (read at the kill), and
// the --term-grace that would have saved it.
std::string lost_text(const StopWait& w, const std::vector<int>& killed,
                      const std::vector<RankEstimate>& now, bool cut_short);

}  // namespace ft::launcher

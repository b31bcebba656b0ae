// The contract between `ft launch` (launcher/) and the workers it starts (`ft train`, runtime/):
// the worker exit codes the launcher interprets and the store keys and records both sides name.
// The launcher hosts the store and only reads the workers' keys; the workers write them. Pure;
// thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace ft::contract {

// A worker's exit code after SIGTERM: it wrote a checkpoint of its last finished step and stopped;
// the same command continues the run. A launcher stopped by a signal whose workers all exit with
// it exits with it too. Every other non-zero exit is a failure the launcher may restart.
inline constexpr int kExitPreempted = 75;

// A worker's exit code when a checkpoint could not be saved (a full disk, say) and
// output.on_save_error is "stop": every rank stops; the newest committed checkpoint is intact and
// the same command continues from it once the storage has room (sysexits' EX_IOERR).
inline constexpr int kExitSaveFailed = 74;

// A worker's exit code when communication with another rank failed: a collective or the store
// connection broke (connection reset or closed, a timeout). The cause is elsewhere, usually a peer
// rank or node that died first, so the launcher waits a moment to learn which (another node's
// failure record, a node's missing heartbeats, a local worker's own failure) and blames that.
inline constexpr int kExitPeerLost = 76;

// The store prefix of restart round `restart_count` (TORCHELASTIC_RESTART_COUNT): ft's workers
// keep every key of theirs under it (c10d PrefixStore), so each round starts with none.
inline std::string worker_store_prefix(int restart_count) {
  return "/worker/attempt_" + std::to_string(restart_count);
}

// Rank `rank`'s progress counter, relative to its round's prefix: ft train adds 1 to it at most
// once a second while it steps; the launcher reads it for --hang-timeout.
inline std::string progress_key(int rank) { return "ft_progress/" + std::to_string(rank); }

// The same counter's full key in round `restart_count`, as the launcher reads it (c10d's
// PrefixStore joins prefix and key with '/').
inline std::string full_progress_key(int restart_count, int rank) {
  return worker_store_prefix(restart_count) + "/" + progress_key(rank);
}

// What stopping a rank costs, as ft train last measured it: on SIGTERM it finishes the step it is
// in, then saves a checkpoint. The launcher reads it on a terminating signal to size its wait
// before SIGKILL (--term-grace auto) and, when it kills anyway, to say what was lost.
struct StopEstimate {
  int64_t step = 0;             // the last step this rank finished (its resume step before any)
  double step_s = 0;            // the slowest of its recent steps; 0: no step finished yet
  int64_t committed_step = -1;  // the newest checkpoint committed as this rank knows it; -1: none
  double save_s = 0;            // expected seconds of one checkpoint save
  bool save_measured = false;   // save_s was measured on a save of this run (else estimated)
};

// Rank `rank`'s StopEstimate as JSON, relative to its round's prefix: ft train rewrites it at most
// once a second while it steps and whenever a checkpoint commits.
inline std::string stop_estimate_key(int rank) { return "ft_stop/" + std::to_string(rank); }
inline std::string full_stop_estimate_key(int restart_count, int rank) {
  return worker_store_prefix(restart_count) + "/" + stop_estimate_key(rank);
}
std::string to_json(const StopEstimate& e);
// nullopt for anything that is not a StopEstimate's JSON (another program may use the key).
std::optional<StopEstimate> parse_stop_estimate(const std::string& text);

}  // namespace ft::contract

// What ended a restart round early, as one record: the launcher that sees it publishes it to the
// store ("ft/r<round>/failure", the first one published wins) and every launcher reads that one
// back to decide restart or exit and to print the same summary. Value types; thread-safe.
#pragma once

#include <optional>
#include <string>

#include "supervisor.h"

namespace ft::launcher {

// What ended the round; published as the record's "kind" (kind_name).
enum class FailureKind {
  kWorker,  // "worker": a local worker exited non-zero or was killed
  kNode,    // "node": a launcher sent no heartbeat for --heartbeat-timeout
  kHang,    // "hang": a rank reported no progress for --hang-timeout
  kRejoin,  // "rejoin": below --nnodes MAX a node waits to join; a new round takes it in
  kSignal,  // "signal": a launcher received a terminating signal
  kError,   // "error": a launcher could not start its workers
};

// The kind's name in the store: "worker", "node", "hang", "rejoin", "signal", "error".
const char* kind_name(FailureKind kind);

// Whether a restart (one of --max-restarts) may cure it: a worker, node or hang failure. A joining
// node is not a failure and uses none; a signal or a program that cannot start ends the job.
bool restartable(FailureKind kind);

struct Failure {
  FailureKind kind = FailureKind::kError;
  int node_rank = -1;                // the node it happened on (for kNode: the node that was lost)
  std::string hostname = "?";        // that node's
  std::string description;           // completes "job stopped: node N (host) ..."
  std::optional<WorkerExit> worker;  // kWorker: which worker, how it ended, its output's tail

  // The store's value: a JSON object with "kind", "node_rank", "hostname", "description" and, for
  // a worker, "rank", "local_rank", "exit_code", "signal", "elapsed_s" and "tail".
  std::string to_json() const;
  // Reads what to_json wrote, with the defaults above for missing fields. A kind this build does
  // not name (another ft version's launcher, refused at rendezvous anyway) reads as kError: it ends
  // the job. Throws nlohmann::json::exception when `text` is not a JSON object.
  static Failure from_json(const std::string& text);
};

// The one way a record is made: `worker` is given for kWorker and only for it.
Failure make_failure(FailureKind kind, int node_rank, std::string hostname, std::string description,
                     std::optional<WorkerExit> worker = std::nullopt);

// Whether worker exit `w` only reports a lost connection to another rank, so that the root cause
// is elsewhere (a peer that died first): `ft train`'s contract::kExitPeerLost, SIGPIPE, or, for any
// other program, a last output line naming a reset or closed connection (Gloo, c10d, NCCL).
bool follows_peer_loss(const WorkerExit& w);

// The root-cause summary every launcher prints when a round ends early: for a worker, its rank,
// exit, run time and the last lines of its output.
std::string summary_text(const Failure& f);

}  // namespace ft::launcher

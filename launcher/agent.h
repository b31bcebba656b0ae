// The per-node launch agent: rendezvous -> spawn local workers -> supervise -> on failure stop
// everything, tell the other nodes through the store and restart the whole job (one global budget)
// or exit with a root-cause summary.
// Ordering: every launcher walks the same rounds in the same order; round r's keys are only written
// after round r-1's workers on that node are gone. Single-threaded.
#pragma once

#include <string>

#include "core/build_info.h"
#include "core/worker_contract.h"
#include "options.h"

namespace ft::launcher {

// Exit codes of `ft launch`.
constexpr int kExitOk = 0;
constexpr int kExitWorkerFailed = 1;
constexpr int kExitConfig = 2;
constexpr int kExitRendezvous = 3;
constexpr int kExitStoreLost = 4;
// Every worker of this node saved a checkpoint and exited with it after a terminating signal
// (ft train's answer to SIGTERM): the job was preempted cleanly; run it again to continue. The
// worker's exit code, passed on: one constant (core/worker_contract.h).
using contract::kExitPreempted;

// Runs the job described by `cfg` on a node described by `node` (the software and GPU fields of its
// fingerprint); returns the launcher's exit code (128+signal when stopped by one).
int run_launch(const LaunchConfig& cfg, const BuildInfo& node);

// `--dry-run` text: the resolved layout, each value's source and local rank 0's environment.
std::string dry_run_text(const LaunchConfig& cfg);

}  // namespace ft::launcher

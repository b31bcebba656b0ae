// What a worker learns from its environment, validated: torchrun's contract (RANK, WORLD_SIZE, ...
// set by `ft launch` or torchrun), or else the variables of mpirun or srun when they started it as
// one task of a job (core/scheduler_env.h). Run without either, a worker is world size 1. Pure
// functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "core/scheduler_env.h"
#include "core/worker_contract.h"

namespace ft::comm {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  int nnodes = 1;
  int restart_count = 0;
  std::string master_addr;  // "" when not launched
  uint16_t master_port = 0;
  bool agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE=True: the launcher hosts the store
  // Who started this worker as one rank of several: "torchrun contract" (ft launch, torchrun, or
  // the user's RANK/WORLD_SIZE), a starter of core/scheduler_env.h ("OpenMPI (mpirun)"), or "".
  std::string started_by;
  std::string master_source;  // where master_addr came from, for messages
  bool launched() const { return !master_addr.empty(); }
  // No launcher hosts a store: rank 0 hosts the job's TCPStore on MASTER_PORT (torchrun's env://).
  bool rank0_hosts_store() const { return launched() && !agent_store; }
};

// Reads RANK, WORLD_SIZE, ... and, when they are unset, the scheduler's task variables; throws
// ConfigError naming the variable when one is malformed, the set is inconsistent (rank outside
// world size), or a scheduler started several tasks in a way ft cannot join into one job.
DistEnv read_dist_env(const sched::EnvMap& env);
DistEnv read_dist_env();  // this process's environment

// The store prefix of a restart round: the launcher's contract (core/worker_contract.h).
using contract::worker_store_prefix;

}  // namespace ft::comm

// What a worker learns from its launcher's environment (torchrun's contract), validated.
// Run without a launcher, a worker is world size 1. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>

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
  bool launched() const { return !master_addr.empty(); }
};

// Reads RANK, WORLD_SIZE, ... ; throws ConfigError naming the variable when one is malformed or the
// set is inconsistent (rank outside world size).
DistEnv read_dist_env();

// The store prefix of a restart round: the launcher's contract (core/worker_contract.h).
using contract::worker_store_prefix;

}  // namespace ft::comm

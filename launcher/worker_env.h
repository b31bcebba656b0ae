// The environment of a worker process: torchrun's exact contract (so a stock PyTorch script runs
// unchanged) plus NODE_RANK / NNODES. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "options.h"

namespace ft::launcher {

struct JobLayout {
  int node_rank = 0;
  int nnodes = 1;
  int nproc_per_node = 1;
  std::string master_addr;  // the store host as workers reach it
  uint16_t master_port = 0;
  int restart_count = 0;
  int max_restarts = 0;
  std::string run_id;
  std::string role = "default";
  int cpu_cores = 1;
  // --bind-cores: local rank r runs on cores bound_cores[r] (empty: not bound).
  std::vector<std::vector<int>> bound_cores;
  int world_size() const { return nnodes * nproc_per_node; }
  int global_rank(int local_rank) const { return node_rank * nproc_per_node + local_rank; }
};

// --bind-cores: `allowed` (the launcher's cores, ascending) in `workers` contiguous shares as equal
// as they come, the first ones one core larger when they do not divide. Throws ConfigError when
// there are fewer cores than workers.
std::vector<std::vector<int>> core_shares(const std::vector<int>& allowed, int workers);
// "0-3,8,10-11".
std::string cpu_list_text(const std::vector<int>& cores);

// `base` is the launcher's environment; the result is the worker's full environment.
EnvMap worker_environment(const EnvMap& base, const JobLayout& layout, int local_rank);

// The variables ft sets (for --dry-run and docs), in a stable order.
const std::vector<std::string>& worker_env_keys();

std::vector<std::string> to_envp(const EnvMap& env);

}  // namespace ft::launcher

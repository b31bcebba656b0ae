#include "worker_env.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace ft::launcher {

const std::vector<std::string>& worker_env_keys() {
  static const std::vector<std::string> keys = {"RANK",
                                                "LOCAL_RANK",
                                                "WORLD_SIZE",
                                                "LOCAL_WORLD_SIZE",
                                                "GROUP_RANK",
                                                "GROUP_WORLD_SIZE",
                                                "ROLE_RANK",
                                                "ROLE_WORLD_SIZE",
                                                "ROLE_NAME",
                                                "MASTER_ADDR",
                                                "MASTER_PORT",
                                                "TORCHELASTIC_RESTART_COUNT",
                                                "TORCHELASTIC_MAX_RESTARTS",
                                                "TORCHELASTIC_RUN_ID",
                                                "TORCHELASTIC_USE_AGENT_STORE",
                                                "NODE_RANK",
                                                "NNODES",
                                                "OMP_NUM_THREADS",
                                                "FT_BOUND_CORES",
                                                "TORCH_NCCL_ASYNC_ERROR_HANDLING"};
  return keys;
}

EnvMap worker_environment(const EnvMap& base, const JobLayout& l, int local_rank) {
  EnvMap env = base;
  const int rank = l.global_rank(local_rank);
  env["RANK"] = std::to_string(rank);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["WORLD_SIZE"] = std::to_string(l.world_size());
  env["LOCAL_WORLD_SIZE"] = std::to_string(l.nproc_per_node);
  env["GROUP_RANK"] = std::to_string(l.node_rank);
  env["GROUP_WORLD_SIZE"] = std::to_string(l.nnodes);
  // One role per job, so role ranks equal global ranks (as torchrun with a single role).
  env["ROLE_RANK"] = std::to_string(rank);
  env["ROLE_WORLD_SIZE"] = std::to_string(l.world_size());
  env["ROLE_NAME"] = l.role;
  env["MASTER_ADDR"] = l.master_addr;
  env["MASTER_PORT"] = std::to_string(l.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(l.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(l.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = l.run_id;
  // Workers attach to the launcher's store as clients instead of rank 0 hosting a second one.
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["NODE_RANK"] = std::to_string(l.node_rank);
  env["NNODES"] = std::to_string(l.nnodes);
  if (env.find("TORCH_NCCL_ASYNC_ERROR_HANDLING") == env.end())
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1";
  const bool bound = local_rank < static_cast<int>(l.bound_cores.size());
  if (bound) env["FT_BOUND_CORES"] = cpu_list_text(l.bound_cores[local_rank]);
  if (env.find("OMP_NUM_THREADS") == env.end())
    env["OMP_NUM_THREADS"] =
        std::to_string(bound ? static_cast<int>(l.bound_cores[local_rank].size())
                             : std::max(1, l.cpu_cores / std::max(1, l.nproc_per_node)));
  return env;
}

std::vector<std::vector<int>> core_shares(const std::vector<int>& allowed, int workers) {
  const int n = static_cast<int>(allowed.size());
  if (workers < 1 || n < workers)
    throw ConfigError(fmt::format(
        "--bind-cores: {} worker(s) per node but this launcher may run on {} core(s) ({}): give "
        "each worker at least one core (fewer --nproc-per-node, a wider taskset / cgroup) or "
        "leave --bind-cores off",
        workers, n, cpu_list_text(allowed)));
  std::vector<std::vector<int>> shares(static_cast<size_t>(workers));
  int at = 0;
  for (int w = 0; w < workers; ++w) {
    const int take = n / workers + (w < n % workers ? 1 : 0);
    shares[static_cast<size_t>(w)].assign(allowed.begin() + at, allowed.begin() + at + take);
    at += take;
  }
  return shares;
}

std::string cpu_list_text(const std::vector<int>& cores) {
  std::string s;
  for (size_t i = 0; i < cores.size();) {
    size_t j = i;
    while (j + 1 < cores.size() && cores[j + 1] == cores[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += j == i ? std::to_string(cores[i]) : fmt::format("{}-{}", cores[i], cores[j]);
    i = j + 1;
  }
  return s;
}

std::vector<std::string> to_envp(const EnvMap& env) {
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

}  // namespace ft::launcher

#include "comm/dist_env.h"

#include <cstdlib>
#include <string>

#include "core/error.h"

namespace ft::comm {
namespace {

using sched::env_value;

int env_int(const sched::EnvMap& env, const char* name, int fallback, int lo, int hi) {
  const std::string v = env_value(env, name);
  if (v.empty()) return fallback;
  char* end = nullptr;
  long x = std::strtol(v.c_str(), &end, 10);
  FT_CHECK(end && *end == '\0' && x >= lo && x <= hi, "environment variable ", name, "='", v,
           "' must be an integer in [", lo, ", ", hi,
           "]; it is normally set by `ft launch` or torchrun");
  return static_cast<int>(x);
}

// torchrun's contract: RANK, WORLD_SIZE and the rest, as `ft launch` sets them.
DistEnv torchrun_env(const sched::EnvMap& env) {
  DistEnv e;
  const std::string addr = env_value(env, "MASTER_ADDR");
  e.started_by = "torchrun contract";
  e.world_size = env_int(env, "WORLD_SIZE", 1, 1, 1 << 20);
  e.rank = env_int(env, "RANK", 0, 0, (1 << 20) - 1);
  e.local_rank = env_int(env, "LOCAL_RANK", 0, 0, 1 << 16);
  e.local_world_size = env_int(env, "LOCAL_WORLD_SIZE", 1, 1, 1 << 16);
  e.node_rank = env_int(env, "GROUP_RANK", env_int(env, "NODE_RANK", 0, 0, 1 << 20), 0, 1 << 20);
  e.nnodes = env_int(env, "GROUP_WORLD_SIZE", env_int(env, "NNODES", 1, 1, 1 << 20), 1, 1 << 20);
  e.restart_count = env_int(env, "TORCHELASTIC_RESTART_COUNT", 0, 0, 1 << 30);
  e.master_port = static_cast<uint16_t>(env_int(env, "MASTER_PORT", 0, 0, 65535));
  e.agent_store = env_value(env, "TORCHELASTIC_USE_AGENT_STORE") == "True";
  FT_CHECK(e.rank < e.world_size, "RANK=", e.rank, " must be below WORLD_SIZE=", e.world_size);
  FT_CHECK(e.local_rank < e.local_world_size, "LOCAL_RANK=", e.local_rank,
           " must be below LOCAL_WORLD_SIZE=", e.local_world_size);
  if (e.world_size > 1) {
    FT_CHECK(!addr.empty(), "WORLD_SIZE=", e.world_size,
             " but MASTER_ADDR is not set: start workers with `ft launch` (or torchrun)");
    FT_CHECK(e.master_port != 0, "WORLD_SIZE=", e.world_size, " but MASTER_PORT is not set");
  }
  e.master_addr = addr;
  e.master_source = "env MASTER_ADDR";
  return e;
}

// One task of several that mpirun or srun started, with no launcher of ft's around it.
DistEnv task_env(const sched::TaskPlace& t) {
  DistEnv e;
  e.started_by = t.starter;
  e.rank = t.rank;
  e.world_size = t.size;
  e.local_rank = t.local_rank;
  e.local_world_size = t.local_size;
  e.node_rank = t.node_rank;
  e.nnodes = t.nnodes;
  if (t.size == 1) return e;  // a job of one task: alone, as without a starter
  FT_CHECK(!t.master_addr.empty(), t.starter, " started ", t.size, " tasks (", t.size_var, "=",
           t.size, ") on ", t.nnodes,
           " nodes but nothing says where rank 0 runs, which hosts the job's store: set "
           "MASTER_ADDR to rank 0's host (and MASTER_PORT, default ",
           sched::kDefaultMasterPort,
           ") and pass them to every task (mpirun: -x MASTER_ADDR -x MASTER_PORT), or start one "
           "`ft launch` per node instead");
  e.master_addr = t.master_addr;
  e.master_port = t.master_port;
  e.master_source = t.master_source;
  return e;
}

}  // namespace

DistEnv read_dist_env(const sched::EnvMap& env) {
  // torchrun's variables win: `ft launch` under mpirun or srun sets them for its workers, which
  // inherit the starter's variables too.
  if (!env_value(env, "RANK").empty() || !env_value(env, "WORLD_SIZE").empty())
    return torchrun_env(env);
  if (const auto task = sched::scheduler_task(env)) return task_env(*task);
  DistEnv alone = torchrun_env(env);
  alone.started_by.clear();
  return alone;
}

DistEnv read_dist_env() { return read_dist_env(sched::current_environment()); }

}  // namespace ft::comm

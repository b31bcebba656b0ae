// Which scheduler started this process, and where the process sits in its job, read from the
// environment in one place: the variables each starter sets (one table: OpenMPI's mpirun, PMIx,
// MPICH / Intel MPI's Hydra, SLURM's srun), used both by a worker that mpirun or srun started as
// one task of a job (comm/dist_env.cpp) and by `ft launch` started once per node
// (launcher/options.cpp). torchrun's own variables (RANK, WORLD_SIZE, set by `ft launch` and
// torchrun) are read by those callers and win over everything here. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ft::sched {

using EnvMap = std::map<std::string, std::string>;

// This process's environment as a map.
EnvMap current_environment();

// `key`'s value in `env`; "" when unset (an empty variable counts as unset).
std::string env_value(const EnvMap& env, const std::string& key);

// The variables one starter sets in each task it starts; "" where it sets none. In precedence
// order: mpirun inside a SLURM allocation sees the allocation's SLURM variables too, and its own
// describe the task.
struct TaskVars {
  std::string starter;        // for messages: "OpenMPI (mpirun)"
  std::string rank;           // the task's rank in the job
  std::string size;           // the job's task count
  std::string local_rank;     // the task's index on its host
  std::string local_size;     // tasks on its host
  std::string start_command;  // how to start one ft per task with it, for messages
};
const std::vector<TaskVars>& task_starters();

// The default MASTER_PORT when MASTER_ADDR (or SLURM's first node) is known: torchrun's.
inline constexpr uint16_t kDefaultMasterPort = 29500;

// A task's place in a job that mpirun or srun started, without a launcher of ft's: rank 0 hosts
// the job's store at master_addr:master_port.
struct TaskPlace {
  std::string starter;  // TaskVars::starter
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int node_rank = 0;  // ranks are placed node after node: rank / local_size
  int nnodes = 1;
  std::string master_addr;  // "" when nothing says where rank 0 is (refused by the worker)
  uint16_t master_port = kDefaultMasterPort;
  std::string master_source;  // "env MASTER_ADDR", "first host of SLURM_STEP_NODELIST=n[1-2]", ...
  // The variables rank, size and local size came from, for messages.
  std::string rank_var, size_var, local_size_var;
};

// The task this process is, when a starter of the table set its variables (nullopt when none did).
// Throws ConfigError naming the variable and what to set when they are malformed, incomplete
// (a size without a rank, PMIX_RANK alone), contradict each other, or describe a job ft cannot run
// as one (an uneven or interleaved layout; a batch script's SLURM_NTASKS outside any srun step).
// MASTER_ADDR / MASTER_PORT win over what a starter implies; `master_addr` stays "" when neither
// they, SLURM's node list nor an all-local job say where rank 0 runs.
std::optional<TaskPlace> scheduler_task(const EnvMap& env);

// A value `ft launch` takes from a scheduler, and where it came from ("SLURM_NODEID").
struct NodeValue {
  std::string value;
  std::string source;
};

// What `ft launch`, run as one task per node, takes from the scheduler that started it: SLURM's
// node variables (SLURM_NNODES, SLURM_NODEID, the node list's first host, SLURM_JOB_ID), or an MPI
// starter's task rank and count as node rank and count (mpirun --map-by ppr:1:node). When MPI
// tasks span several hosts and MASTER_ADDR is unset, `master_refusal` says so (the caller throws it
// only when no flag or variable gave a master).
struct SchedulerNode {
  std::optional<NodeValue> nnodes, node_rank, master_addr, job_id;
  std::string master_refusal;
  int tasks_on_host = 1;  // launchers this starter put on this host (OMPI_COMM_WORLD_LOCAL_SIZE)
  std::string tasks_on_host_var;
};
SchedulerNode scheduler_node(const EnvMap& env);

}  // namespace ft::sched

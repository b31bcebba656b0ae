#include "core/scheduler_env.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>

#include "core/error.h"
#include "core/hostlist.h"

extern char** environ;

namespace ft::sched {

EnvMap current_environment() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

std::string env_value(const EnvMap& env, const std::string& key) {
  auto it = env.find(key);
  return it == env.end() ? std::string() : it->second;
}

const std::vector<TaskVars>& task_starters() {
  // OpenMPI's OMPI_COMM_WORLD_NODE_RANK is not a node index (it counts the tasks of every job on
  // the host, like a local rank): a node's index comes from the layout instead. PMIx's PMIX_RANK
  // comes with no size; it is only checked against the starter that gives one.
  // clang-format off
  static const std::vector<TaskVars> starters = {
      {"OpenMPI (mpirun)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun -np N ft train ..."},
      {"MPICH / Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
       "mpiexec -n N ft train ..."},
      {"SLURM (srun)", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
       "SLURM_STEP_TASKS_PER_NODE", "srun ft train ..."},
  };
  // clang-format on
  return starters;
}

namespace {

constexpr int kMaxTasks = 1 << 20;
constexpr const char* kPmixRank = "PMIX_RANK";
const TaskVars& slurm_vars() { return task_starters().back(); }

// `why`: who sets the variable, or what it is for, closing the message.
int to_int(const std::string& name, const std::string& text, int lo, int hi,
           const std::string& why) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text.c_str(), &end, 10);
  FT_CHECK(errno == 0 && end && *end == '\0' && !text.empty() && v >= lo && v <= hi,
           "environment variable ", name, "='", text, "' must be an integer in [", lo, ", ", hi,
           "]; ", why);
  return static_cast<int>(v);
}

std::string set_by(const std::string& starter) {
  return starter + " sets it for each task it starts";
}

// `name`'s value as an integer, refused when unset: `because` says what the variables set imply.
int required(const EnvMap& env, const std::string& name, int lo, int hi, const TaskVars& s,
             const std::string& because) {
  const std::string v = env_value(env, name);
  FT_CHECK(!v.empty(), because, " but ", name,
           " is not set: ft cannot tell this task's place in the job and will not run it alone. "
           "Start one ft per task with `",
           s.start_command, "`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself");
  return to_int(name, v, lo, hi, set_by(s.starter));
}

// SLURM's tasks per node ("2(x3),1": 2 on each of 3 nodes, then 1) as one count per node.
std::vector<int> tasks_per_node(const std::string& name, const std::string& text) {
  std::vector<int> counts;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = text.find(',', at);
    const std::string item = text.substr(at, comma == std::string::npos ? comma : comma - at);
    const size_t paren = item.find("(x");
    const int n = to_int(name, item.substr(0, paren), 1, kMaxTasks, set_by("SLURM (srun)"));
    int times = 1;
    if (paren != std::string::npos) {
      FT_CHECK(item.back() == ')', "environment variable ", name, "='", text,
               "' is not a SLURM task count list like 2(x3),1");
      times = to_int(name, item.substr(paren + 2, item.size() - paren - 3), 1, kMaxTasks,
                     set_by("SLURM (srun)"));
    }
    FT_CHECK(counts.size() + static_cast<size_t>(times) <= static_cast<size_t>(kMaxTasks),
             "environment variable ", name, "='", text, "' names more than ", kMaxTasks, " nodes");
    counts.insert(counts.end(), static_cast<size_t>(times), n);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return counts;
}

// The first host of SLURM's step (or job) node list: node 0. Never SLURM_LAUNCH_NODE_IPADDR, the
// host the job was submitted from.
std::optional<NodeValue> slurm_first_host(const EnvMap& env) {
  for (const char* k : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})
    if (const std::string v = env_value(env, k); !v.empty())
      return NodeValue{expand_hostlist(v).front(), fmt::format("first host of {}={}", k, v)};
  return std::nullopt;
}

// MASTER_ADDR / MASTER_PORT over what the starter implies.
void resolve_master(const EnvMap& env, TaskPlace& p, const std::string& implied,
                    const std::string& implied_source) {
  if (const std::string addr = env_value(env, "MASTER_ADDR"); !addr.empty()) {
    p.master_addr = addr;
    p.master_source = "env MASTER_ADDR";
  } else {
    p.master_addr = implied;
    p.master_source = implied_source;
  }
  if (const std::string port = env_value(env, "MASTER_PORT"); !port.empty())
    p.master_port = static_cast<uint16_t>(
        to_int("MASTER_PORT", port, 1, 65535, "give every task the same free port"));
}

// The node layout of a task: every node holds local_size tasks, ranks placed node after node, as
// torchrun's contract (and ft's node-local groups) assume.
void place_on_nodes(TaskPlace& p, const TaskVars& s) {
  FT_CHECK(p.size % p.local_size == 0, p.size_var, "=", p.size, " tasks do not fill nodes of ",
           p.local_size_var, "=", p.local_size,
           " each: ft needs the same number of tasks on every node (mpirun --map-by ppr:N:node, "
           "srun --ntasks-per-node=N)");
  FT_CHECK(p.local_rank == p.rank % p.local_size, p.rank_var, "=", p.rank, " is ", s.local_rank,
           "=", p.local_rank, " of its node, but ft needs ranks placed node after node (rank ",
           p.rank, " as local rank ", p.rank % p.local_size,
           "): map tasks by slot or node block (mpirun's default, --map-by ppr:N:node; srun "
           "--distribution=block), not round-robin");
  p.nnodes = p.size / p.local_size;
  p.node_rank = p.rank / p.local_size;
}

// A task of OpenMPI's mpirun or of a PMI starter (MPICH, Intel MPI), when their variables are set.
std::optional<TaskPlace> mpi_task(const EnvMap& env) {
  for (const TaskVars& s : task_starters()) {
    if (&s == &slurm_vars()) break;
    if (env_value(env, s.rank).empty() && env_value(env, s.size).empty()) continue;
    TaskPlace p;
    p.starter = s.starter;
    p.rank_var = s.rank;
    p.size_var = s.size;
    p.local_size_var = s.local_size;
    p.size = required(env, s.size, 1, kMaxTasks, s, s.rank + "=" + env_value(env, s.rank));
    p.rank = required(env, s.rank, 0, kMaxTasks - 1, s, s.size + "=" + env_value(env, s.size));
    FT_CHECK(p.rank < p.size, s.rank, "=", p.rank, " must be below ", s.size, "=", p.size);
    if (p.size > 1) {
      const std::string because = s.starter + " started " + std::to_string(p.size) + " tasks";
      p.local_size = required(env, s.local_size, 1, p.size, s, because);
      p.local_rank = required(env, s.local_rank, 0, p.local_size - 1, s, because);
      place_on_nodes(p, s);
    }
    // All tasks on this host: rank 0 is here too, so loopback reaches its store.
    const bool all_here = p.local_size == p.size;
    resolve_master(env, p, all_here ? "127.0.0.1" : "",
                   all_here ? fmt::format("all {} tasks on this host, {}={}", p.size, s.local_size,
                                          p.local_size)
                            : "");
    return p;
  }
  return std::nullopt;
}

// A task of an srun step. The batch script of a job (no step) sees SLURM_NTASKS too, but it is
// one process, not one of the tasks.
std::optional<TaskPlace> slurm_task(const EnvMap& env) {
  const TaskVars& s = slurm_vars();
  const bool in_step = !env_value(env, "SLURM_STEP_ID").empty() || !env_value(env, s.size).empty();
  const std::string ntasks = env_value(env, "SLURM_NTASKS");
  if (!in_step) {
    if (ntasks.empty() || env_value(env, "SLURM_JOB_ID").empty()) return std::nullopt;
    const int n = to_int("SLURM_NTASKS", ntasks, 1, kMaxTasks, set_by("SLURM"));
    FT_CHECK(n == 1, "SLURM_NTASKS=", n,
             " but this process runs outside any srun step (SLURM_STEP_ID is unset: the batch "
             "script or salloc's shell itself), so it would run alone: start one ft per task "
             "with `srun ft train ...`, or one `ft launch` per node with `srun ft launch ...`");
    return std::nullopt;
  }
  TaskPlace p;
  p.starter = s.starter;
  p.rank_var = s.rank;
  p.size_var = env_value(env, s.size).empty() ? "SLURM_NTASKS" : s.size;
  p.local_size_var = s.local_size;
  const std::string size_text = env_value(env, p.size_var);
  FT_CHECK(!size_text.empty(), "SLURM_STEP_ID=", env_value(env, "SLURM_STEP_ID"), " but neither ",
           s.size,
           " nor SLURM_NTASKS is set: ft cannot tell how many tasks srun started; "
           "give srun --ntasks=N");
  p.size = to_int(p.size_var, size_text, 1, kMaxTasks, set_by(s.starter));
  p.rank = required(env, s.rank, 0, kMaxTasks - 1, s, p.size_var + "=" + size_text);
  FT_CHECK(p.rank < p.size, s.rank, "=", p.rank, " must be below ", p.size_var, "=", p.size);
  if (p.size > 1) {
    const std::string because = "srun started " + std::to_string(p.size) + " tasks";
    const int node = required(env, "SLURM_NODEID", 0, kMaxTasks - 1, s, because);
    const std::string per_node_var =
        env_value(env, s.local_size).empty() ? "SLURM_TASKS_PER_NODE" : s.local_size;
    const std::string per_node = env_value(env, per_node_var);
    FT_CHECK(!per_node.empty(), because, " but neither ", s.local_size,
             " nor SLURM_TASKS_PER_NODE is set: ft cannot tell how many tasks share this node");
    const std::vector<int> counts = tasks_per_node(per_node_var, per_node);
    FT_CHECK(static_cast<size_t>(node) < counts.size(), "SLURM_NODEID=", node, " but ",
             per_node_var, "=", per_node, " names ", counts.size(), " node(s)");
    for (int c : counts)
      FT_CHECK(c == counts.front(), per_node_var, "=", per_node,
               " puts an uneven number of tasks on the nodes: ft needs the same number on every "
               "node (srun --ntasks-per-node=N)");
    p.local_size = counts[static_cast<size_t>(node)];
    p.local_size_var = per_node_var;
    p.local_rank = required(env, s.local_rank, 0, p.local_size - 1, s, because);
    place_on_nodes(p, s);
    FT_CHECK(p.node_rank == node, s.rank, "=", p.rank, " runs on SLURM_NODEID=", node,
             ", but ft needs ranks placed node after node (rank ", p.rank, " on node ", p.node_rank,
             "): srun --distribution=block");
  }
  // The step's first node runs rank 0 under the block distribution checked above.
  const std::optional<NodeValue> first = slurm_first_host(env);
  resolve_master(env, p, first ? first->value : "", first ? first->source : "");
  return p;
}

}  // namespace

std::optional<TaskPlace> scheduler_task(const EnvMap& env) {
  std::optional<TaskPlace> p = mpi_task(env);
  if (!p) p = slurm_task(env);
  const std::string pmix = env_value(env, kPmixRank);
  if (!p) {
    FT_CHECK(pmix.empty(), kPmixRank, "=", pmix,
             " is set but no variable gives the job's size (OMPI_COMM_WORLD_SIZE, PMI_SIZE, "
             "SLURM_NTASKS): ft cannot tell how many tasks to wait for and will not run alone. "
             "Start it with OpenMPI's mpirun or with srun, or set RANK, WORLD_SIZE, MASTER_ADDR "
             "and MASTER_PORT yourself");
    return std::nullopt;
  }
  if (!pmix.empty()) {
    const int r = to_int(kPmixRank, pmix, 0, kMaxTasks - 1, set_by("PMIx"));
    FT_CHECK(r == p->rank, kPmixRank, "=", r, " but ", p->rank_var, "=", p->rank,
             ": the variables of two starters are mixed; start ft with one of them");
  }
  return p;
}

SchedulerNode scheduler_node(const EnvMap& env) {
  SchedulerNode n;
  const bool slurm =
      !env_value(env, "SLURM_JOB_ID").empty() || !env_value(env, "SLURM_NNODES").empty();
  if (slurm) {
    for (const char* k : {"SLURM_NNODES", "SLURM_JOB_NUM_NODES"})
      if (auto v = env_value(env, k); !v.empty() && !n.nnodes) n.nnodes = NodeValue{v, k};
    if (auto v = env_value(env, "SLURM_NODEID"); !v.empty())
      n.node_rank = NodeValue{v, "SLURM_NODEID"};
    n.master_addr = slurm_first_host(env);
    if (auto v = env_value(env, "SLURM_JOB_ID"); !v.empty())
      n.job_id = NodeValue{v, "SLURM_JOB_ID"};
  }
  // mpirun --map-by ppr:1:node: each task is one node's launcher. Its variables describe this
  // process better than an enclosing SLURM allocation's.
  if (const std::optional<TaskPlace> t = mpi_task(env)) {
    n.nnodes = NodeValue{std::to_string(t->size), t->size_var};
    n.node_rank = NodeValue{std::to_string(t->rank), t->rank_var};
    n.tasks_on_host = t->local_size;
    n.tasks_on_host_var = t->local_size_var;
    n.master_addr.reset();
    if (!t->master_addr.empty() && t->master_source != "env MASTER_ADDR")
      n.master_addr = NodeValue{t->master_addr, t->master_source};
    if (t->master_addr.empty())
      n.master_refusal = fmt::format(
          "{} started ft launch on several hosts ({}={}, {} per host) and nothing says where "
          "node 0 (rank 0) runs: set MASTER_ADDR to its host and pass it on (mpirun -x "
          "MASTER_ADDR=<host of rank 0> -x MASTER_PORT={} ...), or give --master-addr",
          t->starter, t->size_var, t->size, n.tasks_on_host, kDefaultMasterPort);
  }
  return n;
}

}  // namespace ft::sched

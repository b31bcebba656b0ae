// Unit tests: which scheduler variables a process reads (core/scheduler_env.h), as a worker that
// mpirun or srun started (comm::read_dist_env) and as `ft launch` started once per node by mpirun
// (resolve_options): each MPI flavour, srun, torchrun's variables winning, and every refusal's
// message naming the variable.
#include "core/scheduler_env.h"

#include <catch2/catch.hpp>
#include <vector>

#include "comm/dist_env.h"
#include "core/error.h"
#include "options.h"

using Catch::Contains;
using ft::comm::DistEnv;
using ft::comm::read_dist_env;
using ft::sched::EnvMap;

namespace {

// Task `rank` of `size` as OpenMPI's mpirun starts it, `per_host` tasks on each host.
EnvMap ompi(int rank, int size, int per_host) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank % per_host)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(per_host)},
          // Not a node index: OpenMPI counts every job's tasks on the host.
          {"OMPI_COMM_WORLD_NODE_RANK", std::to_string(rank % per_host)},
          {"PMIX_RANK", std::to_string(rank)}};
}

// Task `rank` of an srun step of `nodes` x `per_node` tasks on gpu[01-..].
EnvMap srun(int rank, int nodes, int per_node) {
  return {
      {"SLURM_JOB_ID", "4242"},
      {"SLURM_STEP_ID", "0"},
      {"SLURM_PROCID", std::to_string(rank)},
      {"SLURM_NTASKS", std::to_string(nodes * per_node)},
      {"SLURM_STEP_NUM_TASKS", std::to_string(nodes * per_node)},
      {"SLURM_LOCALID", std::to_string(rank % per_node)},
      {"SLURM_NODEID", std::to_string(rank / per_node)},
      {"SLURM_NNODES", std::to_string(nodes)},
      {"SLURM_STEP_TASKS_PER_NODE", std::to_string(per_node) + "(x" + std::to_string(nodes) + ")"},
      {"SLURM_STEP_NODELIST",
       "gpu[01-" + std::string(nodes < 10 ? "0" : "") + std::to_string(nodes) + "]"},
      {"SLURM_JOB_NODELIST", "gpu[01-09]"},
      {"SLURM_LAUNCH_NODE_IPADDR", "10.9.9.9"}};
}

// rank, world size, local rank, local world size, node rank, node count: one CHECK shows them all.
std::vector<int> layout(const DistEnv& e) {
  return {e.rank, e.world_size, e.local_rank, e.local_world_size, e.node_rank, e.nnodes};
}

EnvMap with(EnvMap env, const EnvMap& more) {
  for (const auto& [k, v] : more) env[k] = v;
  return env;
}

EnvMap without(EnvMap env, const std::string& key) {
  env.erase(key);
  return env;
}

}  // namespace

TEST_CASE("mpirun (OpenMPI): a task joins one job, rank 0 hosting the store", "[unit]") {
  SECTION("all tasks on this host: loopback, port 29500 by default") {
    const DistEnv e = read_dist_env(ompi(1, 2, 2));
    CHECK(layout(e) == std::vector<int>{1, 2, 1, 2, 0, 1});
    CHECK(e.master_addr == "127.0.0.1");
    CHECK(e.master_port == 29500);
    CHECK_THAT(e.master_source, Contains("all 2 tasks on this host"));
    CHECK(e.started_by == "OpenMPI (mpirun)");
    CHECK(e.rank0_hosts_store());
    CHECK_FALSE(e.agent_store);
  }
  SECTION("2 hosts x 8: node layout from the local size, master from MASTER_ADDR/MASTER_PORT") {
    const DistEnv e =
        read_dist_env(with(ompi(11, 16, 8), {{"MASTER_ADDR", "gpu01"}, {"MASTER_PORT", "6000"}}));
    CHECK(layout(e) == std::vector<int>{11, 16, 3, 8, 1, 2});
    CHECK(e.master_addr == "gpu01");
    CHECK(e.master_port == 6000);
  }
  SECTION("one task: alone, as without mpirun") {
    const DistEnv e = read_dist_env(ompi(0, 1, 1));
    CHECK(e.world_size == 1);
    CHECK_FALSE(e.launched());
  }
}

TEST_CASE("MPICH / Intel MPI (PMI_RANK, PMI_SIZE) and srun tasks join one job", "[unit]") {
  const DistEnv m = read_dist_env({{"PMI_RANK", "3"},
                                   {"PMI_SIZE", "4"},
                                   {"MPI_LOCALRANKID", "1"},
                                   {"MPI_LOCALNRANKS", "2"},
                                   {"MASTER_ADDR", "10.0.0.1"}});
  CHECK(m.started_by == "MPICH / Intel MPI (PMI)");
  CHECK(layout(m) == std::vector<int>{3, 4, 1, 2, 1, 2});
  CHECK(m.master_addr == "10.0.0.1");

  // srun: the master is the first host of the step's node list, never the submit host.
  const DistEnv s = read_dist_env(srun(5, 2, 4));
  CHECK(s.started_by == "SLURM (srun)");
  CHECK(layout(s) == std::vector<int>{5, 8, 1, 4, 1, 2});
  CHECK(s.master_addr == "gpu01");
  CHECK(s.master_port == 29500);
  CHECK_THAT(s.master_source, Contains("first host of SLURM_STEP_NODELIST=gpu[01-02]"));
  // MASTER_ADDR wins over the node list; the job's node list serves where the step's is unset.
  CHECK(read_dist_env(with(srun(0, 2, 1), {{"MASTER_ADDR", "10.1.1.1"}})).master_addr ==
        "10.1.1.1");
  CHECK(read_dist_env(without(srun(0, 2, 1), "SLURM_STEP_NODELIST")).master_addr == "gpu01");
  // PMIx's rank under srun --mpi=pmix agrees with SLURM's.
  CHECK(read_dist_env(with(srun(1, 2, 1), {{"PMIX_RANK", "1"}})).rank == 1);
}

TEST_CASE(
    "torchrun's variables win over a scheduler's, and the scheduler's over an enclosing one's",
    "[unit]") {
  // A worker of `ft launch` that mpirun started once per node inherits mpirun's variables.
  const DistEnv w = read_dist_env(with(ompi(1, 2, 1), {{"RANK", "3"},
                                                       {"WORLD_SIZE", "4"},
                                                       {"LOCAL_RANK", "1"},
                                                       {"LOCAL_WORLD_SIZE", "2"},
                                                       {"MASTER_ADDR", "n0"},
                                                       {"MASTER_PORT", "29400"},
                                                       {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  CHECK(w.started_by == "torchrun contract");
  CHECK(layout(w) == std::vector<int>{3, 4, 1, 2, 0, 1});
  CHECK(w.agent_store);
  CHECK_FALSE(w.rank0_hosts_store());
  // mpirun inside a SLURM batch script: the batch step's SLURM variables describe the allocation,
  // OpenMPI's the task.
  const EnvMap batch = {{"SLURM_JOB_ID", "7"}, {"SLURM_NTASKS", "2"}, {"SLURM_PROCID", "0"}};
  const DistEnv t = read_dist_env(with(ompi(1, 2, 2), batch));
  CHECK(t.started_by == "OpenMPI (mpirun)");
  CHECK(t.rank == 1);
  // Nothing at all: one process, not launched.
  const DistEnv alone = read_dist_env(EnvMap{});
  CHECK(alone.world_size == 1);
  CHECK(alone.started_by.empty());
  CHECK_FALSE(alone.launched());
}

TEST_CASE("scheduler variables ft cannot use are refused, naming the variable", "[unit]") {
  auto refused = [](const EnvMap& env) {
    try {
      read_dist_env(env);
    } catch (const ft::ConfigError& e) {
      return std::string(e.what());
    }
    FAIL("accepted: a task that would run alone or wrongly");
    return std::string();
  };
  // A size without a rank, and the other way round.
  CHECK_THAT(refused(without(ompi(1, 2, 2), "OMPI_COMM_WORLD_RANK")),
             Contains("OMPI_COMM_WORLD_SIZE=2 but OMPI_COMM_WORLD_RANK is not set") &&
                 Contains("will not run it alone"));
  CHECK_THAT(refused({{"OMPI_COMM_WORLD_RANK", "1"}}),
             Contains("OMPI_COMM_WORLD_RANK=1 but OMPI_COMM_WORLD_SIZE is not set"));
  CHECK_THAT(refused({{"PMI_SIZE", "2"}}), Contains("PMI_RANK is not set"));
  CHECK_THAT(refused(without(srun(1, 2, 1), "SLURM_PROCID")),
             Contains("SLURM_STEP_NUM_TASKS=2 but SLURM_PROCID is not set"));
  // No local layout: GPUs could not be assigned.
  CHECK_THAT(refused(without(ompi(1, 2, 2), "OMPI_COMM_WORLD_LOCAL_SIZE")),
             Contains("OMPI_COMM_WORLD_LOCAL_SIZE is not set"));
  // Several hosts and nothing says where rank 0 runs.
  CHECK_THAT(refused(ompi(3, 4, 2)), Contains("OpenMPI (mpirun) started 4 tasks") &&
                                         Contains("on 2 nodes") && Contains("set MASTER_ADDR") &&
                                         Contains("mpirun: -x MASTER_ADDR -x MASTER_PORT"));
  CHECK_THAT(
      refused(without(without(without(srun(1, 2, 1), "SLURM_STEP_NODELIST"), "SLURM_JOB_NODELIST"),
                      "SLURM_NODELIST")),
      Contains("set MASTER_ADDR"));
  // PMIx's rank alone gives no size; with another starter's it must agree.
  CHECK_THAT(refused({{"PMIX_RANK", "1"}}),
             Contains("PMIX_RANK=1 is set but no variable gives the job's size"));
  CHECK_THAT(refused(with(ompi(1, 2, 2), {{"PMIX_RANK", "0"}})),
             Contains("PMIX_RANK=0 but OMPI_COMM_WORLD_RANK=1"));
  // Malformed and out-of-range values.
  CHECK_THAT(refused(with(ompi(1, 2, 2), {{"OMPI_COMM_WORLD_SIZE", "two"}})),
             Contains("OMPI_COMM_WORLD_SIZE='two' must be an integer"));
  CHECK_THAT(refused(with(ompi(1, 2, 2), {{"OMPI_COMM_WORLD_RANK", "2"}})),
             Contains("OMPI_COMM_WORLD_RANK=2 must be below OMPI_COMM_WORLD_SIZE=2"));
  CHECK_THAT(refused(with(ompi(1, 2, 2), {{"MASTER_PORT", "0"}})),
             Contains("MASTER_PORT='0' must be an integer in [1, 65535]"));
  // Layouts ft's node-local groups cannot use: uneven, or ranks dealt round-robin over nodes.
  CHECK_THAT(refused(with(ompi(1, 3, 2), {{"MASTER_ADDR", "h"}})),
             Contains("OMPI_COMM_WORLD_SIZE=3 tasks do not fill nodes of "
                      "OMPI_COMM_WORLD_LOCAL_SIZE=2"));
  CHECK_THAT(
      refused(with(ompi(1, 4, 2), {{"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"MASTER_ADDR", "h"}})),
      Contains("ranks placed node after node") && Contains("--map-by ppr:N:node"));
  CHECK_THAT(refused(with(srun(1, 2, 2), {{"SLURM_NODEID", "1"}, {"SLURM_LOCALID", "0"}})),
             Contains("srun --distribution=block"));
  CHECK_THAT(refused(with(srun(0, 2, 1),
                          {{"SLURM_STEP_TASKS_PER_NODE", "2,1"}, {"SLURM_STEP_NUM_TASKS", "3"}})),
             Contains("SLURM_STEP_TASKS_PER_NODE=2,1 puts an uneven number of tasks"));
  // The batch script of a 2-task job is not one of its tasks.
  CHECK_THAT(refused({{"SLURM_JOB_ID", "7"}, {"SLURM_NTASKS", "2"}}),
             Contains("SLURM_NTASKS=2 but this process runs outside any srun step") &&
                 Contains("srun ft train"));
}

TEST_CASE("SLURM task counts per node expand like SLURM writes them", "[unit]") {
  const auto t =
      ft::sched::scheduler_task(with(srun(5, 3, 2), {{"SLURM_STEP_TASKS_PER_NODE", "2(x2),2"}}));
  REQUIRE(t);
  CHECK(t->local_size == 2);
  CHECK(t->nnodes == 3);
  CHECK(t->node_rank == 2);
  CHECK_THROWS_WITH(
      ft::sched::scheduler_task(with(srun(1, 2, 1), {{"SLURM_STEP_TASKS_PER_NODE", "1(x2"}})),
      Contains("not a SLURM task count list"));
}

TEST_CASE("ft launch under mpirun --map-by ppr:1:node: node rank and count from OpenMPI's task",
          "[unit]") {
  using namespace ft::launcher;
  auto config = [](const std::map<std::string, std::string>& flags, const EnvMap& env) {
    return make_launch_config(resolve_options(flags, env), {"true"}, 8, 8);
  };
  SECTION("one launcher per host, MASTER_ADDR given") {
    const LaunchConfig c = config({}, with(ompi(1, 2, 1), {{"MASTER_ADDR", "gpu01"}}));
    CHECK(c.min_nodes == 2);
    CHECK(c.max_nodes == 2);
    REQUIRE(c.node_rank);
    CHECK(*c.node_rank == 1);
    CHECK(c.nproc_per_node == 8);
    CHECK(c.rdzv_host == "gpu01");
    CHECK(c.sources.at("nnodes").source == "OMPI_COMM_WORLD_SIZE");
    CHECK(c.sources.at("node-rank").source == "OMPI_COMM_WORLD_RANK");
  }
  SECTION("two launchers as two nodes of one host: loopback, --nproc-per-node required") {
    const LaunchConfig c = config({{"nproc-per-node", "1"}}, ompi(1, 2, 2));
    CHECK(c.max_nodes == 2);
    CHECK(*c.node_rank == 1);
    CHECK(c.rdzv_host == "127.0.0.1");
    CHECK_THAT(c.sources.at("master-addr").source, Contains("all 2 tasks on this host"));
    CHECK_THROWS_WITH(
        config({}, ompi(1, 2, 2)),
        Contains("OMPI_COMM_WORLD_LOCAL_SIZE=2: 2 ft launch tasks run on this host") &&
            Contains("--map-by ppr:1:node"));
  }
  SECTION("several hosts and no master: refused, unless a flag or MASTER_ADDR gives it") {
    CHECK_THROWS_AS(config({}, ompi(1, 2, 1)), ft::ConfigError);
    CHECK_THROWS_WITH(config({}, ompi(1, 2, 1)), Contains("started ft launch on several hosts") &&
                                                     Contains("-x MASTER_ADDR=<host of rank 0>"));
    CHECK(config({{"master-addr", "n0"}}, ompi(1, 2, 1)).rdzv_host == "n0");
  }
  SECTION("flags and variables still win; mpirun's task wins over an enclosing SLURM job's") {
    const LaunchConfig c =
        config({{"nnodes", "3"}, {"node-rank", "2"}}, with(ompi(1, 2, 1), {{"MASTER_ADDR", "m"}}));
    CHECK(c.max_nodes == 3);
    CHECK(*c.node_rank == 2);
    const LaunchConfig s = config({}, with(ompi(1, 2, 1), {{"MASTER_ADDR", "m"},
                                                           {"SLURM_JOB_ID", "9"},
                                                           {"SLURM_NNODES", "4"},
                                                           {"SLURM_NODEID", "0"}}));
    CHECK(s.max_nodes == 2);
    CHECK(*s.node_rank == 1);
    CHECK(s.rdzv_id == "9");
  }
}

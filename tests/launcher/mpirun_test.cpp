// `ft train` and `ft launch` started by a real OpenMPI `mpirun` (Debian's openmpi-bin) on loopback,
// with no launcher of ft's: the tasks join one job (rank 0 hosting the store), train to the same
// losses and weights as the same job under `ft launch`, and a task killed with SIGKILL is recovered
// by running the same mpirun command again. `ft launch` run once per "node" by mpirun takes its
// node rank and count from OpenMPI's variables. docs/launcher.md's mpirun section shows these
// commands. Where mpirun is missing each case prints SKIP and exits 77 (CTest: skipped), except
// under CI=true, where it fails: CI installs it (scripts/setup.sh), so a skip there would hide the
// test. The refusals of variables ft cannot use run everywhere.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
namespace fs = std::filesystem;

namespace {

constexpr const char* kMpirun = "/usr/bin/mpirun";

// Skips unless OpenMPI's mpirun is installed.
void require_mpirun() {
  if (::access(kMpirun, X_OK) == 0) {
    const Finished v = run_to_end({kMpirun, "--version"}, {}, make_temp_dir() + "/v.out", 20);
    if (v.output.find("Open MPI") != std::string::npos) return;
  }
  const std::string why = std::string("OpenMPI's mpirun is not installed here (") + kMpirun +
                          "; scripts/setup.sh installs Debian's openmpi-bin)";
  const char* ci = std::getenv("CI");
  if (ci && std::string(ci) == "true") FAIL(why + " under CI=true");
  skip_test(why);
}

// The environment of every command here: no scheduler or torchrun variables of the caller's, one
// thread per process (`ft launch` gives its workers cores / workers, which is 1 on the 2-core CI
// machine; the same everywhere keeps the sums in the same order), and OpenMPI able to run as
// root in a container (CI's).
std::map<std::string, std::string> clean_env() {
  std::map<std::string, std::string> env = {{"OMP_NUM_THREADS", "1"},
                                            {"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                                            {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  for (const char* k :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "NNODES", "NODE_RANK", "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_PROCID",
        "SLURM_STEP_ID", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    env.emplace(k, "\x01");
  return env;
}

// `mpirun -np N -x MASTER_PORT=P PROGRAM...` as docs/launcher.md shows it, with what a CI
// container needs on loopback: --oversubscribe (2 cores, up to 4 tasks), every task on this host
// (--host localhost:4, so no ssh), the TCP transport of OpenMPI's own (btl self,tcp; ft's
// traffic is Gloo's and the store's either way) and `extra` mpirun options.
std::vector<std::string> mpirun_argv(int np, int port, const std::vector<std::string>& program,
                                     const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv = {kMpirun,
                                   "--oversubscribe",
                                   "--host",
                                   "localhost:4",
                                   "--mca",
                                   "btl",
                                   "self,tcp",
                                   "-np",
                                   std::to_string(np),
                                   "-x",
                                   "MASTER_PORT=" + std::to_string(port),
                                   "-x",
                                   "OMP_NUM_THREADS"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

// The small model (runs.h), 12 steps, a checkpoint every 4, one metrics line per step.
const std::vector<std::string> kSets =
    with(small_run_sets(),
         {"train.max_steps=12", "output.save_every=4", "output.keep_last=3", "train.log_every=1"});

std::vector<std::string> train(const std::string& out) {
  return ft_train_argv({"--preset", "tiny-demo", "--output", out}, kSets);
}

Finished run(const std::vector<std::string>& argv, double timeout_s = 120) {
  return run_to_end(argv, clean_env(), make_temp_dir() + "/out.txt", timeout_s);
}

// The run's events.jsonl records of kind `event`.
std::vector<nlohmann::json> events(const std::string& run_dir, const std::string& event) {
  std::vector<nlohmann::json> out;
  for (auto& e : read_jsonl(run_dir + "/events.jsonl"))
    if (e.value("event", "") == event) out.push_back(e);
  return out;
}

// Two runs logged the same steps with the same losses and saved the same weights.
void check_same_run(const std::string& a, const std::string& b) {
  const auto ma = read_metrics(a), mb = read_metrics(b);
  REQUIRE(ma.size() == 12);
  REQUIRE(mb.size() == ma.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    CHECK(mb[i]["step"] == ma[i]["step"]);
    CHECK(mb[i]["loss"] == ma[i]["loss"]);
  }
  CHECK(read_file(a + "/final/model.safetensors") == read_file(b + "/final/model.safetensors"));
}

// `mpirun -np N ft train` joins one job of N ranks and trains as `ft launch --nproc-per-node N`.
void check_mpirun_matches_ft_launch(int np) {
  require_mpirun();
  const std::string dir = make_temp_dir();
  const std::string ref = dir + "/launch", out = dir + "/mpirun";
  const Finished l = run(ft_launch_argv(
      {"--nproc-per-node", std::to_string(np), "--master-port", std::to_string(free_port())},
      train(ref)));
  INFO(output_tail(l.output));
  REQUIRE(l.code == 0);
  const Finished m = run(mpirun_argv(np, free_port(), train(out)));
  INFO(output_tail(m.output));
  REQUIRE(m.code == 0);
  // Not N runs of one rank into one directory: one job, rank 0 hosting the store.
  CHECK_THAT(m.output, !Catch::Contains("on a single rank"));
  CHECK_THAT(m.output, Catch::Contains("ft train: " + std::to_string(np) +
                                       " tasks started by OpenMPI (mpirun) joined one job on 1 "
                                       "node(s); store 127.0.0.1:") &&
                           Catch::Contains("hosted by rank 0"));
  const auto starts = events(out, "start");
  REQUIRE(starts.size() == 1);
  CHECK(starts[0]["world_size"] == np);
  CHECK(starts[0]["local_world_size"] == np);
  CHECK(starts[0]["started_by"] == "OpenMPI (mpirun)");
  CHECK(events(ref, "start").at(0)["started_by"] == "torchrun contract");
  // Each rank wrote its own record of every step (metrics.rank<k>.jsonl) and no other.
  for (int r = 0; r < np; ++r)
    CHECK(read_jsonl(out + "/metrics.rank" + std::to_string(r) + ".jsonl").size() == 12);
  CHECK_FALSE(fs::exists(out + "/metrics.rank" + std::to_string(np) + ".jsonl"));
  check_same_run(ref, out);
}

}  // namespace

TEST_CASE("mpirun -np 2 ft train: the tasks join one job with the losses of ft launch",
          "[multiproc]") {
  check_mpirun_matches_ft_launch(2);
}

TEST_CASE("mpirun -np 4 ft train: the tasks join one job with the losses of ft launch",
          "[multiproc]") {
  check_mpirun_matches_ft_launch(4);
}

TEST_CASE(
    "mpirun -np 2 ft train: a task killed with SIGKILL ends the job and the same mpirun command "
    "resumes from the checkpoint to the uninterrupted run's losses and weights",
    "[multiproc]") {
  require_mpirun();
  const std::string dir = make_temp_dir();
  const std::string ref = dir + "/ref", out = dir + "/run";
  const int port = free_port();
  const Finished r = run(mpirun_argv(2, port, train(ref)));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);

  // Rank 1 is slowed (0.3 s a step) in the first attempt only, so that the kill lands after the
  // checkpoint of step 4 and before the end however fast the machine.
  auto env = clean_env();
  env["FT_FAULT_STEP_DELAY"] = "1:0.3";
  Child m = start(mpirun_argv(2, port, train(out), {"-x", "FT_FAULT_STEP_DELAY"}), env,
                  dir + "/first.out");
  // Killed once step 6 is logged and the checkpoint of step 4, saved in the background, committed.
  const std::string committed = out + "/checkpoints/step-000000004/meta.json";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while ((read_metrics(out).size() < 6 || !fs::exists(committed)) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(read_metrics(out).size() >= 6);
  REQUIRE(fs::exists(committed));
  // mpirun's own children are the tasks; the victim is rank 1.
  pid_t victim = -1;
  for (pid_t p : children_of(m.pid)) {
    const std::string environ = read_file("/proc/" + std::to_string(p) + "/environ");
    if (environ.find(std::string("OMPI_COMM_WORLD_RANK=1\0", 23)) != std::string::npos) victim = p;
  }
  REQUIRE(victim > 0);
  ::kill(victim, SIGKILL);
  // No supervising agent: the job ends (rank 0 loses its peer; mpirun stops what is left).
  const auto ended = wait_for(m, 90);
  INFO(output_tail(m.output()));
  REQUIRE(ended.has_value());
  CHECK(*ended != 0);
  CHECK_FALSE(fs::exists(out + "/final"));
  const size_t logged = read_metrics(out).size();
  CHECK(logged < 12);

  // The same command again continues from the newest checkpoint.
  const Finished again = run(mpirun_argv(2, port, train(out)));
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains("resuming from"));
  const auto starts = events(out, "start");
  REQUIRE(starts.size() == 2);
  CHECK(starts[1]["step"].get<int>() >= 4);
  CHECK(starts[1]["world_size"] == 2);
  check_same_run(ref, out);
}

TEST_CASE(
    "ft launch under mpirun: node rank and count from OpenMPI's variables (two launchers on one "
    "host as two nodes)",
    "[multiproc]") {
  require_mpirun();
  const std::string dir = make_temp_dir();
  auto env = clean_env();
  env["DIR"] = dir;
  const int port = free_port();
  const std::vector<std::string> launch =
      ft_launch_argv({"--nproc-per-node", "1"}, {"/bin/sh", "-c", "env > $DIR/env.$RANK"});
  const Finished r =
      run_to_end(mpirun_argv(2, port, launch, {"--map-by", "ppr:2:node", "-x", "DIR"}), env,
                 dir + "/out.txt", 60);
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  // Node 0 (OpenMPI's rank 0) hosted the store on loopback, MASTER_PORT from mpirun's -x.
  CHECK_THAT(r.output, Catch::Contains("[ft node 0] round 0: 2 node(s) x 1 worker(s), world size "
                                       "2, store 127.0.0.1:" +
                                       std::to_string(port)));
  for (int rank = 0; rank < 2; ++rank) {
    std::map<std::string, std::string> e;
    std::istringstream in(read_file(dir + "/env." + std::to_string(rank)));
    for (std::string line; std::getline(in, line);)
      if (const size_t eq = line.find('='); eq != std::string::npos)
        e[line.substr(0, eq)] = line.substr(eq + 1);
    CHECK(e["NODE_RANK"] == std::to_string(rank));
    CHECK(e["NNODES"] == "2");
    CHECK(e["WORLD_SIZE"] == "2");
    CHECK(e["OMPI_COMM_WORLD_RANK"] == std::to_string(rank));
  }
  // Without --nproc-per-node each launcher would take every GPU of the host: refused.
  const Finished refused = run_to_end(mpirun_argv(2, port, ft_launch_argv({}, {"/bin/true"})), env,
                                      dir + "/refused.txt", 60);
  CHECK(refused.code != 0);
  CHECK_THAT(refused.output, Catch::Contains("OMPI_COMM_WORLD_LOCAL_SIZE=2: 2 ft launch tasks "
                                             "run on this host"));
}

TEST_CASE(
    "ft train refuses scheduler variables it cannot use before writing anything, instead of "
    "running alone",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  struct Case {
    std::map<std::string, std::string> vars;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{{"OMPI_COMM_WORLD_SIZE", "2"}},
       "OMPI_COMM_WORLD_SIZE=2 but OMPI_COMM_WORLD_RANK is not set"},
      {{{"SLURM_JOB_ID", "7"}, {"SLURM_NTASKS", "2"}},
       "SLURM_NTASKS=2 but this process runs outside any srun step"},
      {{{"SLURM_JOB_ID", "7"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"}},
       "SLURM_NTASKS=2 but SLURM_PROCID is not set"},
      {{{"PMIX_RANK", "1"}}, "PMIX_RANK=1 is set but no variable gives the job's size"}};
  int i = 0;
  for (const Case& c : cases) {
    const std::string out = dir + "/run" + std::to_string(i++);
    auto env = clean_env();
    for (const auto& [k, v] : c.vars) env[k] = v;
    const Finished r = run_to_end(train(out), env, dir + "/out" + std::to_string(i) + ".txt", 60);
    INFO(output_tail(r.output));
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains(c.says));
    CHECK_FALSE(fs::exists(out));
  }
}

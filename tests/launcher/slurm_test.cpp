// A real SLURM cluster (Debian's slurm-wlm: slurmctld and one slurmd per node) in network
// namespaces: the controller and each compute node is a host of its own (support/netns.h), with its
// own hostname and /etc/hosts (a private mount and UTS namespace per daemon). README's sbatch
// script is submitted to it as written (job_script says what is substituted), and the tests watch
// what SLURM and ft do: a 2-node run, a killed launcher, a killed slurmd and the requeue, scancel
// and a resubmission. Needs root and slurm-wlm (scripts/setup.sh installs it); elsewhere each test
// prints SKIP and exits 77 (CTest: skipped). Under CI=true missing slurm binaries fail instead: CI
// installs them, so a skip there would hide the test.
//
// Ports: every daemon and ft launch listens in its own namespace, so SLURM's and ft's default ports
// (6817, 6818, 29500) never meet another program's. The cluster's state, logs and the runs live in
// one temporary directory; daemons and job processes are killed and the namespaces deleted when a
// test ends, passed or failed.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/netns.h"
#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kSlurmctld = "/usr/sbin/slurmctld";
constexpr const char* kSlurmd = "/usr/sbin/slurmd";
constexpr const char* kNsenter = "/usr/bin/nsenter";
constexpr const char* kUnshare = "/usr/bin/unshare";

// Skips unless namespaces can be made and slurm-wlm's daemons and clients are installed.
void require_slurm() {
  require_netns();
  std::string missing;
  for (const char* p : {kSlurmctld, kSlurmd, "/usr/bin/sbatch", "/usr/bin/scontrol",
                        "/usr/bin/scancel", "/usr/bin/sinfo", kNsenter, kUnshare})
    if (::access(p, X_OK) != 0) missing += std::string(missing.empty() ? "" : ", ") + p;
  if (missing.empty()) return;
  const std::string why = "SLURM is not installed here (missing " + missing +
                          "; scripts/setup.sh installs Debian's slurm-wlm)";
  const char* ci = std::getenv("CI");
  if (ci && std::string(ci) == "true") FAIL(why + " under CI=true");
  skip_test(why);
}

// The first ```bash block after the line `heading` in `file` (relative to the repository).
std::string first_bash_block(const std::string& file, const std::string& heading) {
  const std::string text = read_file(test_dir() + "/../" + file);
  const size_t section = text.find("\n" + heading + "\n");
  INFO(file << " has no line " << heading);
  REQUIRE(section != std::string::npos);
  const size_t open = text.find("```bash\n", section);
  REQUIRE(open != std::string::npos);
  const size_t body = open + 8, close = text.find("```", body);
  REQUIRE(close != std::string::npos);
  return text.substr(body, close - body);
}

// README's SLURM sbatch script.
std::string readme_script() { return first_bash_block("README.md", "### SLURM"); }

// `text` with `from` replaced by `to`; REQUIREs that `from` occurs exactly once, so a change to
// README's script shows here instead of quietly testing something else.
std::string substitute(const std::string& text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  INFO("README's SLURM script:\n" << text << "\nlooked for: " << from);
  REQUIRE(at != std::string::npos);
  REQUIRE(text.find(from, at + 1) == std::string::npos);
  return text.substr(0, at) + to + text.substr(at + from.size());
}

// The job tests' small model (runs.h), `steps` steps, one metrics line per step.
std::string train_sets(int steps, int save_every) {
  std::string sets;
  for (const auto& s :
       with(small_run_sets(), {"train.max_steps=" + std::to_string(steps), "train.log_every=1",
                               "output.save_every=" + std::to_string(save_every)}))
    sets += " --set " + s;
  return sets;
}

// README's script with only what this cluster and build need substituted:
// - `#SBATCH --gpus-per-node=8` removed: the test nodes are CPUs and declare no GPUs (SLURM
//   refuses a job asking for GRES a cluster does not have);
// - `ft` -> this build's binary;
// - `--preset lora-7b` -> `--preset tiny-demo` with the small model's --sets (a 7B model is not
//   trained on a 2-core CI machine);
// - `launch_flags`, when given, inserted after `ft launch` (the elastic restart test).
// The output stays `runs/finetune`, relative to the directory the job is submitted from.
std::string job_script(const std::string& sets, const std::string& launch_flags = "") {
  std::string s = readme_script();
  s = substitute(s, "#SBATCH --gpus-per-node=8\n", "");
  s = substitute(s, "srun ft launch ", "srun " + ft_bin() + " launch " + launch_flags);
  s = substitute(s, "--preset lora-7b", "--preset tiny-demo" + sets);
  return s;
}

// docs/launcher.md's script for one ft train per task under srun (no ft launch): the first ```bash
// block after "### SLURM: srun without ft launch", with what job_script substitutes and one task
// per node (the test nodes have one CPU each).
std::string srun_train_script(const std::string& sets) {
  std::string s = first_bash_block("docs/launcher.md", "### SLURM: srun without ft launch");
  s = substitute(s, "#SBATCH --gpus-per-node=8\n", "");
  s = substitute(s, "#SBATCH --ntasks-per-node=8\n", "#SBATCH --ntasks-per-node=1\n");
  s = substitute(s, "srun ft train ", "srun " + ft_bin() + " train ");
  s = substitute(s, "--preset lora-7b", "--preset tiny-demo" + sets);
  return s;
}

// Waits until `pred` holds, polling every 100 ms; false at the deadline.
template <class Pred>
bool wait_until(double timeout_s, Pred pred) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return true;
}

// A SLURM cluster: the controller `ctl` on namespace 0, compute nodes node0..node{n-1} on
// namespaces 1..n. AuthType=auth/none (this Slurm, 22.05, still has it; no munge key to make).
class Cluster {
 public:
  explicit Cluster(int nodes) : net_(nodes + 1), nodes_(nodes), dir_(make_temp_dir()) {
    // slurmstepd and slurmscriptd detach from their daemon: as this process's orphans rather
    // than init's, they are reaped here when the cluster goes (no zombies left behind).
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
    write_config();
    daemons_.push_back(start(on(0, "ctl", {kSlurmctld, "-D"}), env(), dir_ + "/slurmctld.out"));
    for (int i = 0; i < nodes_; ++i) {
      fs::create_directories(dir_ + "/spool/" + node(i));
      daemons_.push_back(start_slurmd(i));
    }
    if (!wait_until(60, [&] { return idle_nodes() == nodes_; })) {
      const std::string why = "the nodes did not come up idle within 60 s:\n" + logs();
      stop();  // no destructor runs for a constructor that throws
      FAIL(why);
    }
  }
  ~Cluster() { stop(); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  static std::string node(int i) { return "node" + std::to_string(i); }
  const std::string& dir() const { return dir_; }

  // A SLURM command (sbatch, scontrol, ...) run on the controller host.
  Finished client(const std::vector<std::string>& argv, double timeout_s = 30) {
    return run_to_end(on(0, "ctl", argv), env(), dir_ + "/client.out", timeout_s);
  }

  // Submits `script` from dir() (the job's working directory), with `export` added to the
  // environment the job inherits (sbatch --export=ALL,VAR=value); the job id.
  std::string submit(const std::string& script, const std::string& export_vars = "") {
    const std::string path = dir_ + "/job" + std::to_string(++submitted_) + ".sh";
    std::ofstream(path) << script;
    const Finished r =
        client({"sbatch", "--parsable", "--chdir=" + dir_, "--output=" + dir_ + "/slurm-%j.out",
                "--export=ALL" + (export_vars.empty() ? "" : "," + export_vars), path});
    INFO(output_tail(r.output));
    REQUIRE(r.code == 0);
    const std::string id = r.output.substr(0, r.output.find_first_of(";\n"));
    REQUIRE(!id.empty());
    return id;
  }

  // `scontrol show job ID` as KEY -> VALUE.
  std::map<std::string, std::string> job(const std::string& id) {
    const Finished r = client({"scontrol", "show", "job", id});
    std::map<std::string, std::string> fields;
    std::istringstream in(r.output);
    for (std::string word; in >> word;)
      if (const size_t eq = word.find('='); eq != std::string::npos)
        fields.emplace(word.substr(0, eq), word.substr(eq + 1));
    return fields;
  }

  // Waits for job `id` to end; its final JobState ("" at the deadline).
  std::string wait_end(const std::string& id, double timeout_s) {
    std::string state;
    wait_until(timeout_s, [&] {
      state = job(id)["JobState"];
      return state == "COMPLETED" || state == "FAILED" || state == "CANCELLED" ||
             state == "NODE_FAIL" || state == "TIMEOUT";
    });
    return state == "RUNNING" || state == "PENDING" || state == "COMPLETING" ? "" : state;
  }

  // The job's output file (the batch script's and srun's: every launcher's and worker's lines).
  std::string output(const std::string& id) const {
    return read_file(dir_ + "/slurm-" + id + ".out");
  }

  // The pid of `ft launch` on compute node i (-1 when none runs there).
  pid_t launcher_on(int i) const {
    const Shell r = sh("ip netns pids " + net_.name(i + 1));
    std::istringstream in(r.out);
    for (pid_t pid; in >> pid;) {
      const std::string cmd = read_file("/proc/" + std::to_string(pid) + "/cmdline");
      if (cmd.rfind(ft_bin() + std::string("\0launch\0", 8), 0) == 0) return pid;
    }
    return -1;
  }

  // Node i's slurmd killed (SIGKILL: the machine's daemon dies, its job steps run on), or started
  // again.
  void kill_slurmd(int i) { kill_and_reap(daemons_[i + 1]); }
  void restart_slurmd(int i) { daemons_[i + 1] = start_slurmd(i); }

  // The daemons' logs, for failure messages.
  std::string logs() const {
    std::string out;
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().extension() == ".log" || e.path().extension() == ".out")
        out += "--- " + e.path().string() + "\n" + read_file(e.path().string());
    return out;
  }

 private:
  std::map<std::string, std::string> env() const { return {{"SLURM_CONF", dir_ + "/slurm.conf"}}; }

  // argv run on namespace `ns` as host `name`: its own hostname and /etc/hosts (a bind mount in a
  // private mount namespace). nsenter rather than `ip netns exec`, which remounts /sys and hides
  // the cgroup hierarchy that slurmd probes at start even with cgroups unused.
  std::vector<std::string> on(int ns, const std::string& name,
                              const std::vector<std::string>& argv) const {
    std::vector<std::string> v = {
        kNsenter,
        "--net=/run/netns/" + net_.name(ns),
        kUnshare,
        "--mount",
        "--uts",
        "sh",
        "-c",
        "mount --bind \"$0\" /etc/hosts && hostname \"$1\" && shift && exec \"$@\"",
        dir_ + "/hosts",
        name};
    v.insert(v.end(), argv.begin(), argv.end());
    return v;
  }

  Child start_slurmd(int i) const {
    const std::string name = node(i);
    return start(on(i + 1, name, {kSlurmd, "-D", "-N", name}), env(),
                 dir_ + "/slurmd." + name + ".out");
  }

  // Everything that runs in the namespaces was started here: the daemons, slurmstepd and the
  // job's launchers and workers. Kill it all so that the namespaces can go.
  void stop() {
    for (int i = 0; i <= nodes_; ++i) sh("ip netns pids " + net_.name(i) + " | xargs -r kill -9");
    for (Child& d : daemons_) kill_and_reap(d);
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (Clock::now() < deadline) {
      const pid_t p = ::waitpid(-1, nullptr, WNOHANG);
      if (p < 0) break;  // no child left
      if (p == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  int idle_nodes() {
    const Finished r = client({"sinfo", "-h", "-N", "-o", "%t"});
    int idle = 0;
    std::istringstream in(r.output);
    for (std::string s; in >> s;) idle += s == "idle";
    return idle;
  }

  // Short timeouts: a dead node is noticed in seconds. KillWait 30 (SLURM's default): the time a
  // cancelled job's launchers get between SIGTERM and SIGKILL, room for a checkpoint.
  void write_config() {
    std::ofstream hosts(dir_ + "/hosts");
    hosts << "127.0.0.1 localhost\n" << net_.addr(0) << " ctl\n";
    for (int i = 0; i < nodes_; ++i) hosts << net_.addr(i + 1) << " " << node(i) << "\n";
    fs::create_directories(dir_ + "/state");
    std::ofstream c(dir_ + "/slurm.conf");
    c << "ClusterName=ftci\nSlurmctldHost=ctl(" << net_.addr(0) << ")\n"
      << "AuthType=auth/none\nCredType=cred/none\nSlurmUser=root\nSlurmdUser=root\n"
      << "StateSaveLocation=" << dir_ << "/state\nSlurmdSpoolDir=" << dir_ << "/spool/%n\n"
      << "SlurmctldPidFile=" << dir_ << "/slurmctld.pid\nSlurmdPidFile=" << dir_
      << "/slurmd.%n.pid\nSlurmctldLogFile=" << dir_ << "/slurmctld.log\nSlurmdLogFile=" << dir_
      << "/slurmd.%n.log\n"
      << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/linear\n"
      << "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
      << "JobCompType=jobcomp/none\nSwitchType=switch/none\nMpiDefault=none\nMailProg=/bin/true\n"
      << "AuthInfo=cred_expire=10\nReturnToService=2\nSlurmdTimeout=5\nSlurmctldTimeout="
         "5\nMessageTimeout=5\n"
      << "KillWait=30\nInactiveLimit=0\nMinJobAge=600\nSlurmdParameters=config_overrides\n";
    for (int i = 0; i < nodes_; ++i)
      c << "NodeName=" << node(i) << " NodeAddr=" << net_.addr(i + 1) << " CPUs=1 State=UNKNOWN\n";
    c << "PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n";
  }

  Network net_;
  int nodes_;
  std::string dir_;
  std::vector<Child> daemons_;
  int submitted_ = 0;
};

std::string run_dir(const Cluster& c) { return c.dir() + "/runs/finetune"; }

// Waits until job `id` has logged `steps` steps or ended; REQUIREs the steps.
void wait_steps(Cluster& c, const std::string& id, size_t steps, double timeout_s = 90) {
  const std::string run = run_dir(c);
  wait_until(timeout_s, [&] {
    const std::string state = c.job(id)["JobState"];
    return read_metrics(run).size() >= steps || (state != "PENDING" && state != "RUNNING");
  });
  INFO(output_tail(c.output(id)) << c.logs());
  REQUIRE(read_metrics(run).size() >= steps);
}

// Once job `id` has logged `steps` steps, SIGKILL to node 1's `ft launch` (its workers die with it:
// a node lost); the job's final JobState ("" when it runs past `timeout_s`).
std::string kill_launcher_after(Cluster& c, const std::string& id, size_t steps, double timeout_s) {
  wait_steps(c, id, steps);
  const pid_t victim = c.launcher_on(1);
  REQUIRE(victim > 0);
  ::kill(victim, SIGKILL);
  return c.wait_end(id, timeout_s);
}

// The run's events.jsonl records of kind `event`.
std::vector<nlohmann::json> events(const std::string& run, const std::string& event) {
  std::vector<nlohmann::json> out;
  for (auto& e : read_jsonl(run + "/events.jsonl"))
    if (e.value("event", "") == event) out.push_back(e);
  return out;
}

// The checkpoint directory of `step` (docs/checkpoint-format.md: checkpoints/step-%09d).
std::string step_dir(const std::string& run, int step) {
  const std::string n = std::to_string(step);
  return run + "/checkpoints/step-" + std::string(9 - n.size(), '0') + n;
}

// metrics.jsonl holds every step from 1 to `steps` once, in order.
void check_every_step_once(const std::string& run, int steps) {
  const auto m = read_metrics(run);
  REQUIRE(m.size() == static_cast<size_t>(steps));
  for (size_t i = 0; i < m.size(); ++i) CHECK(m[i]["step"] == static_cast<int>(i + 1));
}

// Job `id` completes, resuming from the checkpoint of step `at`: final/ written, every one of
// `steps` steps in metrics.jsonl once.
void check_resumed_to_the_end(Cluster& c, const std::string& id, int at, int steps) {
  const std::string state = c.wait_end(id, 180);
  const std::string out = c.output(id);
  INFO(output_tail(out));
  REQUIRE(state == "COMPLETED");
  CHECK_THAT(out, Catch::Contains("resuming from") &&
                      Catch::Contains("(step " + std::to_string(at) + ","));
  CHECK(fs::exists(run_dir(c) + "/final/model.safetensors"));
  check_every_step_once(run_dir(c), steps);
}

}  // namespace

TEST_CASE(
    "slurm: README's sbatch script trains on 2 nodes, scontrol shows the job on both, it "
    "completes with final/",
    "[multiproc]") {
  require_slurm();
  Cluster cluster(2);
  const std::string id = cluster.submit(job_script(train_sets(12, 1000)));
  std::map<std::string, std::string> running;
  const bool ran = wait_until(60, [&] {
    running = cluster.job(id);
    return running["JobState"] == "RUNNING" || running["JobState"] == "COMPLETED";
  });
  INFO(cluster.logs());
  REQUIRE(ran);
  CHECK(running["NodeList"] == "node[0-1]");
  CHECK(running["NumNodes"] == "2");
  CHECK(running["BatchHost"] == "node0");
  const std::string state = cluster.wait_end(id, 180);
  const std::string out = cluster.output(id);
  INFO(output_tail(out));
  REQUIRE(state == "COMPLETED");
  CHECK(cluster.job(id)["ExitCode"] == "0:0");
  // One launcher per node, ranks by SLURM_NODEID, the store on the first host of the node list.
  CHECK_THAT(out, Catch::Contains("[ft node 0] round 0: 2 node(s) x 1 worker(s), world size 2, "
                                  "store node0:29500"));
  CHECK_THAT(out, Catch::Contains("[ft node 1] round 0: 2 node(s) x 1 worker(s)"));
  CHECK_THAT(out, Catch::Contains("[ft node 0] job finished successfully") &&
                      Catch::Contains("[ft node 1] job finished successfully"));
  const std::string run = run_dir(cluster);
  CHECK(fs::exists(run + "/final/model.safetensors"));
  check_every_step_once(run, 12);
  // Rank 0 ran on node0 (the hostname of its namespace), in a job of 2 nodes.
  const auto starts = events(run, "start");
  REQUIRE(starts.size() == 1);
  CHECK(starts[0]["hostname"] == "node0");
  CHECK(starts[0]["nnodes"] == 2);
}

TEST_CASE(
    "slurm: one node's ft launch killed: with --max-restarts 0 (README's script) the job ends, "
    "naming the lost node",
    "[multiproc]") {
  require_slurm();
  Cluster cluster(2);
  const std::string id = cluster.submit(job_script(train_sets(400, 1000)));
  const std::string run = run_dir(cluster);
  // Noticed within --heartbeat-timeout (10 s) plus the wait for the worker's peer loss.
  const std::string state = kill_launcher_after(cluster, id, 3, 90);
  const std::string out = cluster.output(id);
  INFO(output_tail(out));
  CHECK(state == "FAILED");
  CHECK_THAT(out, Catch::Contains("[ft node 0] job stopped: node 1 (node1) was lost"));
  // Launcher exit code 1: a failure and no restart allowed.
  CHECK_THAT(out, Catch::Contains("node0: task 0: Exited with exit code 1"));
  CHECK_FALSE(fs::exists(run + "/final"));
}

TEST_CASE(
    "slurm: one node's ft launch killed: an elastic --nnodes 1:2 with --max-restarts 1 restarts "
    "on the node left and finishes",
    "[multiproc]") {
  require_slurm();
  Cluster cluster(2);
  // Added to README's launch line: the elastic range and a restart (SLURM never starts the killed
  // task again, so a fixed 2-node job could only wait for it), a 1 s last call.
  const std::string id = cluster.submit(
      job_script(train_sets(40, 3), "--nnodes 1:2 --max-restarts 1 --rdzv-last-call 1 "));
  const std::string run = run_dir(cluster);
  const std::string state = kill_launcher_after(cluster, id, 7, 150);  // a checkpoint at step 6
  const std::string out = cluster.output(id);
  INFO(output_tail(out));
  REQUIRE(!state.empty());
  CHECK_THAT(out, Catch::Contains("restarting the job: attempt 1 of 1"));
  CHECK_THAT(out, Catch::Contains("round 1: 1 node(s) x 1 worker(s), world size 1"));
  CHECK_THAT(out, Catch::Contains("resuming from"));
  CHECK(fs::exists(run + "/final/model.safetensors"));
  // SLURM counts the killed task: the job is FAILED though the training finished. Node 0's
  // launcher itself exited 0 (srun names only tasks that did not).
  CHECK(state == "FAILED");
  CHECK_THAT(out, !Catch::Contains("node0: task 0: Exited"));
}

TEST_CASE(
    "slurm: scancel makes every launcher checkpoint and exit 75, the resubmitted script resumes "
    "from that step and finishes",
    "[multiproc]") {
  require_slurm();
  Cluster cluster(2);
  const int steps = 40;
  // No periodic checkpoint: the only one is the one SIGTERM makes.
  const std::string script = job_script(train_sets(steps, 1000));
  // Rank 0 sleeps 0.25 s a step (FT_FAULT_STEP_DELAY) in the first job only, so that scancel
  // lands mid-run however fast the machine; the resubmission runs at full speed.
  const std::string first = cluster.submit(script, "FT_FAULT_STEP_DELAY=0:0.25");
  const std::string run = run_dir(cluster);
  wait_steps(cluster, first, 4);
  REQUIRE(cluster.client({"scancel", first}).code == 0);
  const std::string cancelled = cluster.wait_end(first, 90);
  const std::string out1 = cluster.output(first);
  INFO(out1);
  REQUIRE(cancelled == "CANCELLED");
  // SLURM signals every node's launcher; each saw its workers checkpoint and exited 75 (the
  // launcher that first heard of the other's signal used to exit 143 here).
  CHECK_THAT(out1, Catch::Contains("node0: task 0: Exited with exit code 75"));
  CHECK_THAT(out1, Catch::Contains("node1: task 1: Exited with exit code 75"));
  const auto preempted = events(run, "preempted");
  REQUIRE(preempted.size() == 1);
  const int at = preempted[0]["step"];
  CHECK(at >= 4);
  CHECK(at < steps);
  CHECK(fs::exists(step_dir(run, at)));

  const std::string second = cluster.submit(script);
  check_resumed_to_the_end(cluster, second, at, steps);
  const auto starts = events(run, "start");
  REQUIRE(starts.size() == 2);
  CHECK(starts[1]["step"] == at);
}

// Longer than the others (about 90 s on 2 cores): SLURM needs SlurmdTimeout and a ping round to
// call the node dead, and holds a requeued job for the credential lifetime (cred_expire, 10 s here)
// before starting it again; rank 0's steps are slowed so the first run is still going by then.
TEST_CASE(
    "slurm: node 1's slurmd killed: SLURM fails the node, the job checkpoints and is requeued, "
    "and the requeued job resumes and finishes",
    "[multiproc]") {
  require_slurm();
  Cluster cluster(2);
  const int steps = 50;
  const std::string id =
      cluster.submit(job_script(train_sets(steps, 1000)), "FT_FAULT_STEP_DELAY=0:0.5");
  const std::string run = run_dir(cluster);
  wait_steps(cluster, id, 4);
  // The daemon dies; the job's processes on node 1 (slurmstepd, ft launch, its worker) run on.
  cluster.kill_slurmd(1);
  std::map<std::string, std::string> job;
  const bool requeued = wait_until(90, [&] {
    job = cluster.job(id);
    return job["Restarts"] == "1" && job["JobState"] == "PENDING";
  });
  // The first run's output, before the requeued job starts and replaces it.
  const std::string out1 = cluster.output(id);
  {
    INFO(out1 << cluster.logs());
    REQUIRE(requeued);
  }
  INFO(out1);
  CHECK_THAT(out1, Catch::Contains("Node failure on node1"));
  // SLURM cancels the job: its SIGTERM reaches node 0's launcher (node 1's slurmd is gone), which
  // has every rank, node 1's included through the store, checkpoint, and exits 75. What node 1's
  // launcher says does not reach srun once SLURM has declared that node failed.
  CHECK_THAT(out1, Catch::Contains("[ft node 0] received SIGTERM"));
  CHECK_THAT(out1, Catch::Contains("node0: task 0: Exited with exit code 75"));
  const auto preempted = events(run, "preempted");
  REQUIRE(preempted.size() == 1);
  const int at = preempted[0]["step"];
  CHECK(fs::exists(step_dir(run, at)));
  // The machine is back: ReturnToService=2 makes the node usable when its slurmd registers.
  cluster.restart_slurmd(1);
  check_resumed_to_the_end(cluster, id, at, steps);
}

// No ft launch: srun starts one ft train per task (SLURM_PROCID, SLURM_STEP_NUM_TASKS,
// SLURM_LOCALID), and the tasks join one job on the store rank 0 hosts on the first node of the
// step.
TEST_CASE(
    "slurm: srun ft train, one task per node and no ft launch: the tasks join one job of world "
    "size 2 on node0's store and complete",
    "[multiproc]") {
  require_slurm();
  Cluster cluster(2);
  const std::string id = cluster.submit(srun_train_script(train_sets(12, 1000)));
  const std::string state = cluster.wait_end(id, 180);
  const std::string out = cluster.output(id);
  INFO(output_tail(out) << cluster.logs());
  REQUIRE(state == "COMPLETED");
  CHECK_THAT(out, !Catch::Contains("on a single rank"));
  CHECK_THAT(out, Catch::Contains("ft train: 2 tasks started by SLURM (srun) joined one job on 2 "
                                  "node(s); store node0:29500 (first host of "
                                  "SLURM_STEP_NODELIST=node[0-1]), hosted by rank 0"));
  const std::string run = run_dir(cluster);
  CHECK(fs::exists(run + "/final/model.safetensors"));
  check_every_step_once(run, 12);
  const auto starts = events(run, "start");
  REQUIRE(starts.size() == 1);
  CHECK(starts[0]["world_size"] == 2);
  CHECK(starts[0]["nnodes"] == 2);
  CHECK(starts[0]["started_by"] == "SLURM (srun)");
  CHECK(starts[0]["hostname"] == "node0");
  // Both ranks logged every step: rank 1 trained on node1 in the same job.
  CHECK(read_jsonl(run + "/metrics.rank1.jsonl").size() == 12);
}

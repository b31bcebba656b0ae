// Multi-process tests of `ft launch`: real launchers and workers on loopback, free ports, short
// timeouts. Workers are small shell programs, `ft comm-check` (a real Gloo all-reduce) and a stock
// PyTorch script.
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
using Clock = std::chrono::steady_clock;

namespace {

// Starts `ft launch ARGS -- PROGRAM...` with output in dir/name.out.
Child launch(const std::string& dir, const std::string& name, const std::vector<std::string>& args,
             const std::vector<std::string>& program, std::map<std::string, std::string> env = {}) {
  // Keep the test independent of a scheduler or torchrun variables in the caller's environment.
  for (const char* k : {"SLURM_JOB_ID", "SLURM_NNODES", "NNODES", "NODE_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "PET_NNODES", "NPROC_PER_NODE"})
    env.emplace(k, "\x01");
  return start(ft_launch_argv(args, program), env, dir + "/" + name + ".out");
}

std::vector<std::string> sh(const std::string& script) { return {"/bin/sh", "-c", script}; }

std::map<std::string, std::string> parse_env_file(const std::string& path) {
  std::map<std::string, std::string> m;
  std::istringstream in(read_file(path));
  for (std::string line; std::getline(in, line);) {
    auto eq = line.find('=');
    if (eq != std::string::npos) m[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return m;
}

std::vector<pid_t> read_pids(const std::string& dir, int n) {
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    std::string t = read_file(dir + "/pid." + std::to_string(r));
    if (!t.empty()) pids.push_back(std::stoi(t));
  }
  return pids;
}

bool wait_until(const std::function<bool()>& pred, double timeout_s) {
  auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

const std::string kWriteEnv = "env > $DIR/env.$RANK";

}  // namespace

TEST_CASE("1 node x 3 workers: torchrun environment and a Gloo all-reduce", "[multiproc]") {
  std::string dir = make_temp_dir();
  Child c = launch(dir, "env", {"--nproc-per-node", "3", "--master-port", "0", "--rdzv-id", "j1"},
                   sh(kWriteEnv), {{"DIR", dir}, {"OMP_NUM_THREADS", "\x01"}});
  REQUIRE(wait_for(c, 60) == 0);
  for (int r = 0; r < 3; ++r) {
    auto e = parse_env_file(dir + "/env." + std::to_string(r));
    CHECK(e["RANK"] == std::to_string(r));
    CHECK(e["LOCAL_RANK"] == std::to_string(r));
    CHECK(e["WORLD_SIZE"] == "3");
    CHECK(e["LOCAL_WORLD_SIZE"] == "3");
    CHECK(e["GROUP_RANK"] == "0");
    CHECK(e["GROUP_WORLD_SIZE"] == "1");
    CHECK(e["ROLE_RANK"] == std::to_string(r));
    CHECK(e["ROLE_WORLD_SIZE"] == "3");
    CHECK(e["ROLE_NAME"] == "default");
    CHECK(e["MASTER_ADDR"] == "127.0.0.1");
    CHECK(std::stoi(e["MASTER_PORT"]) > 0);
    CHECK(e["TORCHELASTIC_RESTART_COUNT"] == "0");
    CHECK(e["TORCHELASTIC_MAX_RESTARTS"] == "0");
    CHECK(e["TORCHELASTIC_RUN_ID"] == "j1");
    CHECK(e["TORCHELASTIC_USE_AGENT_STORE"] == "True");
    CHECK(e["NODE_RANK"] == "0");
    CHECK(e["NNODES"] == "1");
    CHECK(std::stoi(e["OMP_NUM_THREADS"]) >= 1);
  }
  Child cc = launch(dir, "cc", {"--nproc-per-node", "3", "--standalone"},
                    {ft_bin(), "comm-check", "--iters", "2"});
  REQUIRE(wait_for(cc, 60) == 0);
  std::string out = cc.output();
  for (int r = 0; r < 3; ++r)
    CHECK_THAT(out, Catch::Contains("[node 0 rank " + std::to_string(r) + "] comm-check rank " +
                                    std::to_string(r) + "/3: all-reduce sum = 6 (expected 6) OK"));
}

// --bind-cores: each worker runs on its own contiguous share of the launcher's cores, with
// OMP_NUM_THREADS that many and FT_BOUND_CORES naming them; more workers than cores are refused
// before any worker starts.
TEST_CASE("ft launch --bind-cores: each worker on its own share of the launcher's cores",
          "[multiproc]") {
  std::string dir = make_temp_dir();
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(::sched_getaffinity(0, sizeof set, &set) == 0);
  std::vector<int> allowed;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) allowed.push_back(c);
  const int n = allowed.size() >= 2 ? 2 : 1;
  Child c =
      launch(dir, "bind", {"--nproc-per-node", std::to_string(n), "--standalone", "--bind-cores"},
             sh("grep Cpus_allowed_list /proc/self/status > $DIR/cpus.$RANK; "
                "echo \"$OMP_NUM_THREADS $FT_BOUND_CORES\" > $DIR/env.$RANK"),
             {{"DIR", dir}, {"OMP_NUM_THREADS", "\x01"}});
  REQUIRE(wait_for(c, 60) == 0);
  CHECK_THAT(c.output(), Catch::Contains("cores (--bind-cores): rank 0 on "));
  size_t at = 0;
  for (int r = 0; r < n; ++r) {
    // The first shares take one core more when the cores do not divide.
    const size_t take = allowed.size() / n + (static_cast<size_t>(r) < allowed.size() % n);
    std::string want;
    for (size_t i = at; i < at + take;) {  // "a-b,c" as the kernel lists them
      size_t j = i;
      while (j + 1 < at + take && allowed[j + 1] == allowed[j] + 1) ++j;
      want += (want.empty() ? "" : ",") + std::to_string(allowed[i]) +
              (j > i ? "-" + std::to_string(allowed[j]) : "");
      i = j + 1;
    }
    at += take;
    INFO("rank " << r);
    CHECK(read_file(dir + "/cpus." + std::to_string(r)) == "Cpus_allowed_list:\t" + want + "\n");
    CHECK(read_file(dir + "/env." + std::to_string(r)) == std::to_string(take) + " " + want + "\n");
  }
  Child d = launch(
      dir, "toomany",
      {"--nproc-per-node", std::to_string(allowed.size() + 1), "--standalone", "--bind-cores"},
      sh("touch $DIR/started.$RANK"), {{"DIR", dir}});
  CHECK(wait_for(d, 60) == 2);
  CHECK_THAT(d.output(), Catch::Contains("--bind-cores: " + std::to_string(allowed.size() + 1) +
                                         " worker(s) per node but this launcher may run on"));
  CHECK_FALSE(std::filesystem::exists(dir + "/started.0"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("2 nodes x 2 workers on loopback: ranks, environment and all-reduce", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  auto args = [&](int node) {
    return std::vector<std::string>{
        "--nnodes",         "2",  "--node-rank",    std::to_string(node),
        "--nproc-per-node", "2",  "--master-addr",  "127.0.0.1",
        "--master-port",    port, "--rdzv-timeout", "30"};
  };
  std::vector<std::string> prog = sh(kWriteEnv + " && exec " + ft_bin() + " comm-check --iters 2");
  Child n1 = launch(dir, "n1", args(1), prog, {{"DIR", dir}});  // node 1 first: it must wait for 0
  Child n0 = launch(dir, "n0", args(0), prog, {{"DIR", dir}});
  REQUIRE(wait_for(n0, 60) == 0);
  REQUIRE(wait_for(n1, 60) == 0);
  for (int r = 0; r < 4; ++r) {
    auto e = parse_env_file(dir + "/env." + std::to_string(r));
    CHECK(e["WORLD_SIZE"] == "4");
    CHECK(e["LOCAL_RANK"] == std::to_string(r % 2));
    CHECK(e["GROUP_RANK"] == std::to_string(r / 2));
    CHECK(e["NODE_RANK"] == std::to_string(r / 2));
    CHECK(e["NNODES"] == "2");
    CHECK(e["GROUP_WORLD_SIZE"] == "2");
    CHECK(e["MASTER_PORT"] == port);
  }
  std::string out = n0.output() + n1.output();
  CHECK(lines_with(out, "all-reduce sum = 10 (expected 10) OK").size() == 4);
  CHECK_THAT(n1.output(), Catch::Contains("[node 1 rank 3] comm-check rank 3/4"));
}

TEST_CASE("node ranks are assigned in join order when not given", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  std::vector<std::string> a = {"--nnodes",      "2",  "--nproc-per-node", "1",
                                "--master-port", port, "--rdzv-timeout",   "30"};
  Child x = launch(dir, "x", a, sh(kWriteEnv), {{"DIR", dir}});
  Child y = launch(dir, "y", a, sh(kWriteEnv), {{"DIR", dir}});
  REQUIRE(wait_for(x, 60) == 0);
  REQUIRE(wait_for(y, 60) == 0);
  CHECK(parse_env_file(dir + "/env.0")["NODE_RANK"] == "0");
  CHECK(parse_env_file(dir + "/env.1")["NODE_RANK"] == "1");
}

TEST_CASE("a stock PyTorch script runs unchanged, 1 and 2 nodes, and across a restart",
          "[multiproc]") {
  if (ft_python().empty()) {
    WARN("FT_PYTHON not configured: skipping the Python script test");
    return;
  }
  std::string dir = make_temp_dir();
  std::string script = test_dir() + "/launcher/stock_ddp.py";
  Child one = launch(dir, "py1", {"--nproc-per-node", "2", "--standalone"}, {ft_python(), script});
  REQUIRE(wait_for(one, 120) == 0);
  CHECK(lines_with(one.output(), "sum=3 expected=3").size() == 2);

  std::string port = std::to_string(free_port());
  auto args = [&](int node) {
    return std::vector<std::string>{"--nnodes",         "2", "--node-rank",    std::to_string(node),
                                    "--nproc-per-node", "1", "--master-port",  port,
                                    "--max-restarts",   "1", "--rdzv-timeout", "60"};
  };
  std::vector<std::string> prog = {ft_python(), script, "--fail-first-attempt"};
  Child n0 = launch(dir, "py2a", args(0), prog);
  Child n1 = launch(dir, "py2b", args(1), prog);
  REQUIRE(wait_for(n0, 150) == 0);
  REQUIRE(wait_for(n1, 150) == 0);
  std::string out = n0.output() + n1.output();
  // Worker lines only (the failure summary quotes rank 1's last line too).
  auto worker_lines = [&](const std::string& what) {
    size_t n = 0;
    for (auto& l : lines_with(out, what)) n += l.rfind("[node ", 0) == 0;
    return n;
  };
  CHECK(worker_lines("attempt 0: sum=3 expected=3") == 2);
  CHECK(worker_lines("attempt 1: sum=3 expected=3") == 2);
  CHECK_THAT(out, Catch::Contains("restarting the job: attempt 1 of 1"));
}

TEST_CASE("a failing worker in a 2-node job stops both launchers with a root-cause summary",
          "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  auto args = [&](int node) {
    return std::vector<std::string>{"--nnodes",         "2",  "--node-rank",   std::to_string(node),
                                    "--nproc-per-node", "2",  "--master-port", port,
                                    "--rdzv-timeout",   "30", "--term-grace",  "3"};
  };
  // Rank 3 fails once every worker has started; the others would sleep for a minute.
  std::string script =
      "echo $$ > $DIR/pid.$RANK; "
      "if [ $RANK = 3 ]; then while [ $(ls $DIR | grep -c pid) -lt 4 ]; do sleep 0.05; done; "
      "echo 'loading shard 7'; echo 'CUDA error: out of memory' >&2; exit 1; fi; "
      "exec sleep 60";
  Child n0 = launch(dir, "n0", args(0), sh(script), {{"DIR", dir}});
  Child n1 = launch(dir, "n1", args(1), sh(script), {{"DIR", dir}});
  REQUIRE(wait_until([&] { return read_pids(dir, 4).size() == 4; }, 30));
  auto t0 = Clock::now();
  auto s0 = wait_for(n0, 10), s1 = wait_for(n1, 10);
  double took = std::chrono::duration<double>(Clock::now() - t0).count();
  REQUIRE(s0.has_value());
  REQUIRE(s1.has_value());
  CHECK(*s0 == 1);
  CHECK(*s1 == 1);
  CHECK(took < 10);
  for (auto* c : {&n0, &n1}) {
    std::string out = c->output();
    CHECK_THAT(out, Catch::Contains("first failure on node 1"));
    CHECK_THAT(out, Catch::Contains("rank 3 (local rank 1): worker exited with code 1"));
    CHECK_THAT(out, Catch::Contains("| CUDA error: out of memory"));
    CHECK_THAT(out, Catch::Contains("| loading shard 7"));
  }
  for (pid_t p : read_pids(dir, 4)) CHECK_FALSE(pid_alive(p));
}

TEST_CASE("SIGTERM and SIGKILL to a launcher leave none of its workers", "[multiproc]") {
  for (int sig : {SIGTERM, SIGKILL}) {
    DYNAMIC_SECTION("signal " << sig) {
      std::string dir = make_temp_dir();
      // A worker that ignores SIGTERM must still go (SIGKILL after the grace).
      std::string script =
          "if [ $RANK = 1 ]; then trap '' TERM; fi; echo $$ > $DIR/pid.$RANK; "
          "while true; do sleep 0.1; done";
      Child c = launch(dir, "l", {"--nproc-per-node", "2", "--standalone", "--term-grace", "1"},
                       sh(script), {{"DIR", dir}});
      REQUIRE(wait_until([&] { return read_pids(dir, 2).size() == 2; }, 30));
      auto pids = read_pids(dir, 2);
      ::kill(c.pid, sig);
      auto st = wait_for(c, 10);
      REQUIRE(st.has_value());
      CHECK(*st == 128 + sig);
      CHECK(wait_until(
          [&] {
            for (pid_t p : pids)
              if (pid_alive(p)) return false;
            return true;
          },
          5));
      if (sig == SIGTERM) CHECK_THAT(c.output(), Catch::Contains("received SIGTERM"));
    }
  }
}

TEST_CASE("USR1 is forwarded to workers without stopping them", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string script =
      "trap 'echo got-usr1 > $DIR/usr1.$RANK; exit 0' USR1; echo $$ > $DIR/pid.$RANK; "
      "while true; do sleep 0.05; done";
  Child c = launch(dir, "l", {"--nproc-per-node", "2", "--standalone"}, sh(script), {{"DIR", dir}});
  REQUIRE(wait_until([&] { return read_pids(dir, 2).size() == 2; }, 30));
  ::kill(c.pid, SIGUSR1);
  REQUIRE(wait_for(c, 10) == 0);
  CHECK(read_file(dir + "/usr1.0") == "got-usr1\n");
  CHECK(read_file(dir + "/usr1.1") == "got-usr1\n");
}

TEST_CASE("max-restarts 1 runs the program again with TORCHELASTIC_RESTART_COUNT=1",
          "[multiproc]") {
  std::string dir = make_temp_dir();
  // Round 0 fails once both workers have recorded it (else teardown may beat rank 1's echo).
  std::string script =
      "echo $TORCHELASTIC_RESTART_COUNT >> $DIR/count.$RANK; "
      "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then "
      "while [ $(cat $DIR/count.* | wc -l) -lt 2 ]; do sleep 0.02; done; exit 3; fi";
  Child c = launch(dir, "l", {"--nproc-per-node", "2", "--standalone", "--max-restarts", "1"},
                   sh(script), {{"DIR", dir}});
  REQUIRE(wait_for(c, 30) == 0);
  CHECK(read_file(dir + "/count.0") == "0\n1\n");
  CHECK(read_file(dir + "/count.1") == "0\n1\n");
  // Out of restarts: the failure is final and says so.
  Child d = launch(dir, "d", {"--nproc-per-node", "1", "--standalone", "--max-restarts", "1"},
                   sh("exit 5"));
  REQUIRE(wait_for(d, 30) == 1);
  CHECK_THAT(d.output(), Catch::Contains("worker exited with code 5"));
  CHECK_THAT(d.output(), Catch::Contains("no restarts left"));
}

TEST_CASE("output is prefixed line by line, never split, and logged per rank", "[multiproc]") {
  std::string dir = make_temp_dir();
  // Each worker writes 300 long lines as fast as it can, some without a trailing newline at the
  // end.
  std::string script =
      "i=0; while [ $i -lt 300 ]; do echo \"rank$RANK line$i $(printf '%0200d' 0)\"; i=$((i+1)); "
      "done; "
      "printf 'tail-without-newline'";
  Child c = launch(dir, "l", {"--nproc-per-node", "3", "--standalone", "--log-dir", dir + "/logs"},
                   sh(script));
  REQUIRE(wait_for(c, 60) == 0);
  std::string out = c.output();
  std::regex line_re(R"(^\[node 0 rank (\d)\] rank(\d) line\d+ 0{200}$)");
  int matched = 0;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.find(" line") == std::string::npos) continue;
    std::smatch m;
    REQUIRE(std::regex_match(line, m, line_re));
    CHECK(m[1] == m[2]);
    ++matched;
  }
  CHECK(matched == 900);
  CHECK(lines_with(out, "tail-without-newline").size() == 3);
  for (int r = 0; r < 3; ++r) {
    std::string log = read_file(dir + "/logs/attempt_0/node0.rank" + std::to_string(r) + ".log");
    CHECK(lines_with(log, "rank" + std::to_string(r) + " line").size() == 300);
    CHECK(log.rfind("[node", 0) == std::string::npos);  // files hold the raw output
  }
}

TEST_CASE("refused: mismatched fingerprint, every launcher names the field", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  auto args = [&](int node, const std::string& nproc) {
    return std::vector<std::string>{
        "--nnodes",         "2",   "--node-rank",   std::to_string(node),
        "--nproc-per-node", nproc, "--master-port", port,
        "--rdzv-timeout",   "20"};
  };
  Child n0 = launch(dir, "n0", args(0, "2"), sh("touch $DIR/ran.0"), {{"DIR", dir}});
  Child n1 =
      launch(dir, "n1", args(1, "1"), sh("touch $DIR/ran.1 # another program"), {{"DIR", dir}});
  REQUIRE(wait_for(n0, 30) == 3);
  REQUIRE(wait_for(n1, 30) == 3);
  for (auto* c : {&n0, &n1}) {
    std::string out = c->output();
    CHECK_THAT(out, Catch::Contains("rendezvous refused 1 node(s)"));
    CHECK_THAT(out, Catch::Contains("node_rank 1"));
    CHECK_THAT(out, Catch::Contains("nproc_per_node is '1' there but '2' on the reference"));
    CHECK_THAT(out, Catch::Contains("program_hash"));
  }
  // Nothing ran anywhere.
  CHECK(read_file(dir + "/ran.0").empty());
  CHECK(::access((dir + "/ran.0").c_str(), F_OK) != 0);
  CHECK(::access((dir + "/ran.1").c_str(), F_OK) != 0);
}

TEST_CASE("refused: a different --rdzv-id", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  auto args = [&](int node, const std::string& id) {
    return std::vector<std::string>{"--nnodes",         "2", "--node-rank",    std::to_string(node),
                                    "--nproc-per-node", "1", "--master-port",  port,
                                    "--rdzv-id",        id,  "--rdzv-timeout", "20"};
  };
  Child n0 = launch(dir, "n0", args(0, "jobA"), sh("exit 0"));
  Child n1 = launch(dir, "n1", args(1, "jobB"), sh("exit 0"));
  REQUIRE(wait_for(n0, 30) == 3);
  REQUIRE(wait_for(n1, 30) == 3);
  CHECK_THAT(n1.output(), Catch::Contains("rdzv_id is 'jobB' there but 'jobA' on the reference"));
}

TEST_CASE("refused: duplicate node rank", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  auto args = [&](int node) {
    return std::vector<std::string>{"--nnodes",         "3", "--node-rank",   std::to_string(node),
                                    "--nproc-per-node", "1", "--master-port", port,
                                    "--rdzv-timeout",   "20"};
  };
  Child n0 = launch(dir, "n0", args(0), sh("exit 0"));
  Child a = launch(dir, "a", args(1), sh("exit 0"));
  Child b = launch(dir, "b", args(1), sh("exit 0"));
  for (auto* c : {&n0, &a, &b}) {
    REQUIRE(wait_for(*c, 30) == 3);
    CHECK_THAT(c->output(), Catch::Contains("duplicate node_rank 1: claimed by"));
  }
}

TEST_CASE("rendezvous timeout says how many joined and which ranks are missing", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  Child n0 = launch(dir, "n0",
                    {"--nnodes", "3", "--node-rank", "0", "--nproc-per-node", "1", "--master-port",
                     port, "--rdzv-timeout", "1.5"},
                    sh("exit 0"));
  Child n2 = launch(dir, "n2",
                    {"--nnodes", "3", "--node-rank", "2", "--nproc-per-node", "1", "--master-port",
                     port, "--rdzv-timeout", "1.5"},
                    sh("exit 0"));
  REQUIRE(wait_for(n0, 20) == 3);
  REQUIRE(wait_for(n2, 20) == 3);
  CHECK_THAT(
      n0.output(),
      Catch::Contains("rendezvous timed out after 2 s: 2/3 nodes joined (missing node_rank 1)"));
  CHECK_THAT(n2.output(), Catch::Contains("missing node_rank 1"));
}

TEST_CASE("a port already in use is named", "[multiproc]") {
  int port_num = 0;
  int s = listen_on_free_port(&port_num);
  REQUIRE(s >= 0);
  std::string port = std::to_string(port_num);
  std::string dir = make_temp_dir();
  Child c =
      launch(dir, "l", {"--nnodes", "1", "--node-rank", "0", "--master-port", port}, sh("exit 0"));
  REQUIRE(wait_for(c, 20) == 3);
  CHECK_THAT(c.output(), Catch::Contains("port " + port + " is already in use"));
  ::close(s);
}

TEST_CASE("dry-run shows values and where they came from", "[multiproc]") {
  std::string dir = make_temp_dir();
  Child c =
      start({ft_bin(), "launch", "--dry-run", "--nproc-per-node", "2", "--", "python", "x.py"},
            {{"NNODES", "4"},
             {"PET_NNODES", "\x01"},
             {"FT_NNODES", "\x01"},
             {"NODE_RANK", "3"},
             {"SLURM_JOB_ID", "991"},
             {"SLURM_NNODES", "9"},
             {"SLURM_JOB_NODELIST", "gpu[3-6]"},
             {"MASTER_ADDR", "\x01"},
             {"PET_MASTER_ADDR", "\x01"}},
            dir + "/dry.out");
  REQUIRE(wait_for(c, 20) == 0);
  std::string out = c.output();
  CHECK_THAT(out, Catch::Contains("env NNODES"));
  CHECK_THAT(out, Catch::Contains("flag --nproc-per-node"));
  CHECK_THAT(out, Catch::Contains("first host of SLURM_JOB_NODELIST=gpu[3-6]"));
  CHECK_THAT(out, Catch::Contains("SLURM_JOB_ID"));
  CHECK_THAT(out, Catch::Contains("RANK=6"));
  CHECK_THAT(out, Catch::Contains("MASTER_ADDR=gpu3"));
  CHECK_THAT(out, Catch::Contains("WORLD_SIZE=8"));
}

TEST_CASE("a program that cannot run is a clear error", "[multiproc]") {
  std::string dir = make_temp_dir();
  // Two workers: the second is never started, and teardown must not wait for it.
  Child c = launch(dir, "l", {"--standalone", "--nproc-per-node", "2"}, {"/nonexistent/train"});
  auto st = wait_for(c, 20);
  REQUIRE(st.has_value());
  CHECK(*st != 0);
  CHECK_THAT(c.output(),
             Catch::Contains("cannot run '/nonexistent/train': No such file or directory"));
}

TEST_CASE("version names ft, LibTorch, CUDA and NCCL", "[multiproc]") {
  std::string dir = make_temp_dir();
  Child c = start({ft_bin(), "--version"}, {}, dir + "/v.out");
  REQUIRE(wait_for(c, 20) == 0);
  std::string out = c.output();
  CHECK_THAT(out,
             Catch::Matches(R"((.|\n)*ft \d+\.\d+\.\d+ \(commit [0-9a-f]+(-dirty)?\)(.|\n)*)"));
  CHECK_THAT(out, Catch::Contains("LibTorch 2."));
  CHECK_THAT(out, Catch::Contains("NCCL"));
  CHECK_THAT(out, Catch::Contains("CUDA"));
}

TEST_CASE("SLURM environment alone lays out a 2-node job", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  auto slurm = [&](int node) {
    return std::map<std::string, std::string>{{"DIR", dir},
                                              {"SLURM_JOB_ID", "5151"},
                                              {"SLURM_NNODES", "2"},
                                              {"SLURM_NODEID", std::to_string(node)},
                                              {"SLURM_JOB_NODELIST", "localhost,node[02]"},
                                              {"SLURM_LAUNCH_NODE_IPADDR", "192.0.2.1"},
                                              {"FT_MASTER_PORT", port},
                                              {"FT_NPROC_PER_NODE", "1"},
                                              {"FT_RDZV_TIMEOUT", "30"}};
  };
  // `launch` clears scheduler variables; start these directly.
  auto run = [&](int node) {
    return start({ft_bin(), "launch", "--", "/bin/sh", "-c", kWriteEnv}, slurm(node),
                 dir + "/s" + std::to_string(node) + ".out");
  };
  Child a = run(1), b = run(0);
  REQUIRE(wait_for(a, 60) == 0);
  REQUIRE(wait_for(b, 60) == 0);
  auto e1 = parse_env_file(dir + "/env.1");
  CHECK(e1["NODE_RANK"] == "1");
  CHECK(e1["WORLD_SIZE"] == "2");
  CHECK(e1["MASTER_ADDR"] == "localhost");  // first host of the node list, never the submit host
  CHECK(e1["TORCHELASTIC_RUN_ID"] == "5151");
}

TEST_CASE("PET_ variables and --rdzv-endpoint configure a launch like torchrun's", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  Child c =
      launch(dir, "pet", {"--rdzv-endpoint", "127.0.0.1:" + port, "--node-rank", "0"},
             sh(kWriteEnv), {{"DIR", dir}, {"PET_NPROC_PER_NODE", "2"}, {"PET_MAX_RESTARTS", "2"}});
  REQUIRE(wait_for(c, 60) == 0);
  auto e = parse_env_file(dir + "/env.1");
  CHECK(e["WORLD_SIZE"] == "2");
  CHECK(e["MASTER_PORT"] == port);
  CHECK(e["TORCHELASTIC_MAX_RESTARTS"] == "2");
}

TEST_CASE("elastic nnodes MIN:MAX starts with MIN nodes after the last call", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  Child c = launch(dir, "el",
                   {"--nnodes", "1:2", "--nproc-per-node", "1", "--master-port", port,
                    "--rdzv-last-call", "0.5", "--rdzv-timeout", "30"},
                   sh(kWriteEnv), {{"DIR", dir}});
  REQUIRE(wait_for(c, 30) == 0);
  auto e = parse_env_file(dir + "/env.0");
  CHECK(e["NNODES"] == "1");
  CHECK(e["WORLD_SIZE"] == "1");
  // With MAX nodes present it does not wait for the last call.
  std::string port2 = std::to_string(free_port());
  std::vector<std::string> a = {"--nnodes",       "1:2", "--nproc-per-node", "1",
                                "--master-port",  port2, "--rdzv-last-call", "20",
                                "--rdzv-timeout", "30"};
  ::mkdir((dir + "/2").c_str(), 0755);
  auto t0 = Clock::now();
  Child x = launch(dir, "x", a, sh(kWriteEnv), {{"DIR", dir + "/2"}});
  Child y = launch(dir, "y", a, sh(kWriteEnv), {{"DIR", dir + "/2"}});
  REQUIRE(wait_for(x, 30) == 0);
  REQUIRE(wait_for(y, 30) == 0);
  CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 15);
  CHECK(parse_env_file(dir + "/2/env.1")["NNODES"] == "2");
}

TEST_CASE(
    "SIGKILL of the store-hosting launcher stops the other node's workers, waits "
    "--rdzv-timeout for node 0, then exits 4",
    "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());
  auto args = [&](int node) {
    return std::vector<std::string>{"--nnodes",         "2", "--node-rank",   std::to_string(node),
                                    "--nproc-per-node", "1", "--master-port", port,
                                    "--rdzv-timeout",   "4", "--term-grace",  "2"};
  };
  std::string script = "echo $$ > $DIR/pid.$RANK; exec sleep 60";
  Child n0 = launch(dir, "n0", args(0), sh(script), {{"DIR", dir}});
  Child n1 = launch(dir, "n1", args(1), sh(script), {{"DIR", dir}});
  REQUIRE(wait_until([&] { return read_pids(dir, 2).size() == 2; }, 30));
  auto pids = read_pids(dir, 2);
  ::kill(n0.pid, SIGKILL);
  REQUIRE(wait_for(n0, 5) == 128 + SIGKILL);
  // Its workers are stopped at once; it then waits for node 0 to come back, in vain here.
  CHECK(wait_until([&] { return !pid_alive(pids[0]) && !pid_alive(pids[1]); }, 6));
  auto st = wait_for(n1, 20);
  REQUIRE(st.has_value());
  CHECK(*st == 4);
  CHECK_THAT(n1.output(),
             Catch::Contains("lost the rendezvous store") && Catch::Contains("did not come back"));
}

TEST_CASE("unknown options are refused with a suggestion, torchrun spellings accepted",
          "[multiproc]") {
  std::string dir = make_temp_dir();
  Child typo =
      start({ft_bin(), "launch", "--nproc-per-nod", "2", "--", "true"}, {}, dir + "/t.out");
  REQUIRE(wait_for(typo, 20) == 2);
  CHECK_THAT(typo.output(),
             Catch::Contains("unknown option '--nproc-per-nod' (did you mean --nproc-per-node?)"));
  Child unknown =
      start({ft_bin(), "launch", "--foo", "1", "--dry-run", "--", "true"}, {}, dir + "/u.out");
  REQUIRE(wait_for(unknown, 20) == 2);
  CHECK_THAT(unknown.output(), Catch::Contains("unknown option '--foo'"));
  // torchrun's form: no `--`, underscores, --rdzv-backend, a .py script run with python3 -u.
  Child tr = start({ft_bin(), "launch", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                    "--dry-run", "train.py", "--lr", "1e-4"},
                   {}, dir + "/tr.out");
  REQUIRE(wait_for(tr, 20) == 0);
  CHECK_THAT(tr.output(), Catch::Contains("program: python3 -u train.py --lr 1e-4"));
  CHECK_THAT(tr.output(), Catch::Contains("WORLD_SIZE=2"));
  Child np =
      start({ft_bin(), "launch", "--no-python", "--dry-run", "train.py"}, {}, dir + "/np.out");
  REQUIRE(wait_for(np, 20) == 0);
  CHECK_THAT(np.output(), Catch::Contains("program: train.py"));
  Child etcd =
      start({ft_bin(), "launch", "--rdzv-backend", "etcd", "--", "true"}, {}, dir + "/e.out");
  REQUIRE(wait_for(etcd, 20) == 2);
  CHECK_THAT(etcd.output(), Catch::Contains("--rdzv-backend 'etcd'"));
}

TEST_CASE("a launcher waiting for node 0 stops at once on SIGTERM", "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string port = std::to_string(free_port());  // nobody listens there
  Child c =
      launch(dir, "l",
             {"--nnodes", "2", "--node-rank", "1", "--master-port", port, "--rdzv-timeout", "60"},
             sh("exit 0"));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  ::kill(c.pid, SIGTERM);
  auto st = wait_for(c, 5);
  REQUIRE(st.has_value());
  CHECK(*st == 128 + SIGTERM);
}

TEST_CASE("a single-node job on a busy port says so instead of joining it", "[multiproc]") {
  int port_num = 0;
  int s = listen_on_free_port(&port_num);
  REQUIRE(s >= 0);
  std::string port = std::to_string(port_num);
  std::string dir = make_temp_dir();
  Child c = launch(dir, "l", {"--master-port", port}, sh("exit 0"));  // no --node-rank
  REQUIRE(wait_for(c, 20) == 3);
  CHECK_THAT(c.output(), Catch::Contains("port " + port + " is already in use"));
  ::close(s);
}

namespace {
// `ft launch ARGS` with no `--`: the form that runs ft train on every worker.
Child launch_train(const std::string& dir, const std::string& name,
                   const std::vector<std::string>& args,
                   std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv = {ft_bin(), "launch"};
  argv.insert(argv.end(), args.begin(), args.end());
  for (const char* k : {"SLURM_JOB_ID", "SLURM_NNODES", "NNODES", "NODE_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "PET_NNODES", "NPROC_PER_NODE", "WORLD_SIZE", "RANK"})
    env.emplace(k, "\x01");
  return start(argv, env, dir + "/" + name + ".out");
}
size_t count_lines(const std::string& text) {
  return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
}
}  // namespace

TEST_CASE("ft launch --preset runs ft train on every worker, no `--` needed", "[multiproc]") {
  std::string dir = make_temp_dir();
  Child ok = launch_train(dir, "ok",
                          {"--standalone", "--nproc-per-node", "1", "--preset", "tiny-demo",
                           "--set", "train.max_steps=3", "--output", dir + "/run"});
  REQUIRE(wait_for(ok, 120) == 0);
  CHECK(count_lines(read_file(dir + "/run/metrics.jsonl")) == 3);
  CHECK_THAT(ok.output(), Catch::Contains("ft train: 3 steps"));

  // Launcher and ft train options in any order; --dry-run shows the ft train command it runs.
  Child dry =
      launch_train(dir, "dry",
                   {"--preset", "tiny-demo", "--dry-run", "--set", "train.lr=1e-3",
                    "--nproc-per-node", "2", "--output", dir + "/o", "--set", "train.max_steps=2"});
  REQUIRE(wait_for(dry, 20) == 0);
  CHECK_THAT(dry.output(), Catch::Contains(" train --preset tiny-demo --output " + dir +
                                           "/o --set train.lr=1e-3 --set train.max_steps=2\n"));
  CHECK_THAT(dry.output(), Catch::Contains("program: /"));  // ft's own path, not a PATH lookup
  CHECK_THAT(dry.output(), Catch::Contains("WORLD_SIZE=2"));
}

TEST_CASE("ft launch --preset: two workers train together, and bad forms are refused",
          "[multiproc]") {
  std::string dir = make_temp_dir();
  Child two = launch_train(dir, "two",
                           {"--standalone", "--nproc-per-node", "2", "--preset", "tiny-demo",
                            "--set", "train.max_steps=1", "--output", dir + "/two"});
  auto st = wait_for(two, 60);
  INFO(output_tail(two.output()));
  REQUIRE(st == 0);
  CHECK(lines_with(read_file(dir + "/two/metrics.jsonl"), "\"step\":1").size() == 1);
  CHECK(::access((dir + "/two/metrics.rank1.jsonl").c_str(), F_OK) == 0);

  // Both ft train's options and a program: refused before anything starts.
  for (const auto& tail : std::vector<std::vector<std::string>>{{"--", "true"}, {"true"}}) {
    std::vector<std::string> args = {"--standalone", "--preset", "tiny-demo", "--output",
                                     dir + "/both"};
    args.insert(args.end(), tail.begin(), tail.end());
    Child both = launch_train(dir, "both", args);
    REQUIRE(wait_for(both, 20) == 2);
    CHECK_THAT(both.output(), Catch::Contains("not both"));
    CHECK_THAT(both.output(), Catch::Contains("--preset is an ft train option"));
  }
  // What ft train needs, and a bad preset, are checked once by the launcher.
  Child no_output = launch_train(dir, "noout", {"--standalone", "--preset", "tiny-demo"});
  REQUIRE(wait_for(no_output, 20) == 2);
  CHECK_THAT(no_output.output(), Catch::Contains("needs --output too"));
  Child no_preset = launch_train(dir, "nopre", {"--standalone", "--output", dir + "/x"});
  REQUIRE(wait_for(no_preset, 20) == 2);
  CHECK_THAT(no_preset.output(), Catch::Contains("--output runs `ft train` on every worker, "
                                                 "which needs --preset too"));
  Child bad = launch_train(dir, "bad",
                           {"--standalone", "--preset", "tiny-demo", "--set", "train.lr=fast",
                            "--output", dir + "/bad"});
  REQUIRE(wait_for(bad, 20) == 2);
  CHECK_THAT(bad.output(), Catch::Contains("train.lr"));
  CHECK(bad.output().find("[node 0 rank") == std::string::npos);  // no worker was started

  // --help names the form.
  Child help = start({ft_bin(), "launch", "--help"}, {}, dir + "/help.out");
  REQUIRE(wait_for(help, 20) == 0);
  CHECK_THAT(help.output(), Catch::Contains("ft launch [options] --preset NAME|FILE --output DIR"));
  CHECK_THAT(help.output(), Catch::Contains("--set KEY=VALUE"));
}

namespace {
// `ft launch --standalone` of a small ft train job on `nproc` workers into `out`, with `sets`
// after the small-run ones and `extra` launcher options.
std::vector<std::string> small_launch(int nproc, const std::string& out,
                                      const std::vector<std::string>& sets,
                                      const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"--standalone",
                                   "--nproc-per-node",
                                   std::to_string(nproc),
                                   "--preset",
                                   "tiny-demo",
                                   "--output",
                                   out};
  args.insert(args.end(), extra.begin(), extra.end());
  for (const auto& s : with(small_run_sets(), sets)) args.insert(args.end(), {"--set", s});
  return args;
}
// The number in the launcher's "waiting up to N s" line; -1 when there is none.
double waited_up_to(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex("waiting up to ([0-9.]+) s"))) return -1;
  return std::stod(m[1]);
}
}  // namespace

// Issue 28 item 4: with steps longer than the old fixed 15 s grace, a SIGTERM lost the run. Now
// the workers publish what a step and a checkpoint take and --term-grace auto waits for them.
TEST_CASE(
    "SIGTERM with steps longer than 15 s: the launcher waits for the step and its "
    "checkpoint, exit 75, and the next start resumes",
    "[multiproc]") {
  const std::string dir = make_temp_dir(), out = dir + "/run";
  const std::vector<std::string> args =
      small_launch(2, out, {"train.max_steps=4", "output.save_every=0"});
  // Rank 1 sleeps 16 s in each step (the other waits for it in the step's collectives).
  Child c = launch_train(dir, "slow", args, {{"FT_FAULT_STEP_DELAY", "1:16"}});
  wait_for_steps(out, 1, Clock::now() + std::chrono::seconds(150));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // both ranks have published
  ::kill(c.pid, SIGTERM);
  const auto code = wait_for(c, 120);
  INFO(output_tail(c.output()));
  REQUIRE(code == 75);
  // Said at the signal: how long and why (step 2 of ~16 s, its checkpoint); beyond the old 15 s.
  CHECK_THAT(c.output(), Catch::Contains("received SIGTERM: stopping this node's workers; waiting "
                                         "up to") &&
                             Catch::Contains("(--term-grace auto); send it again to stop at once"));
  CHECK(std::regex_search(c.output(), std::regex("finish step 2 \\(~1[6-9] s a step\\) and save "
                                                 "its checkpoint \\(~[0-9.]+ s, estimated\\)")));
  CHECK(waited_up_to(c.output()) >= 16 * 1.25 + 5);
  CHECK(c.output().find("got SIGKILL") == std::string::npos);
  CHECK(read_file(out + "/checkpoints/latest") == "step-000000002\n");
  // The same command, without the slow steps, continues from step 2 and finishes.
  Child again = launch_train(dir, "again", args);
  REQUIRE(wait_for(again, 120) == 0);
  INFO(output_tail(again.output()));
  CHECK_THAT(again.output(), Catch::Contains("resuming from") && Catch::Contains("(step 2,"));
  CHECK(read_metrics(out).size() == 4);
}

TEST_CASE(
    "a --term-grace too short for the step and its checkpoint: the launcher says so at the "
    "signal, then what the kill lost and which --term-grace would have saved it",
    "[multiproc]") {
  const std::string dir = make_temp_dir(), out = dir + "/run";
  // One rank (it reports through the launcher's store without a process group): steps of ~1.5 s,
  // a checkpoint every 2 steps, a grace of half a second.
  Child c = launch_train(
      dir, "short",
      small_launch(1, out, {"train.max_steps=40", "output.save_every=2"}, {"--term-grace", "0.5"}),
      {{"FT_FAULT_STEP_DELAY", "0:1.5"}});
  wait_for_steps(out, 3, Clock::now() + std::chrono::seconds(120));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // step 3's estimate is published
  ::kill(c.pid, SIGTERM);
  const auto code = wait_for(c, 60);
  INFO(output_tail(c.output()));
  CHECK(code == 128 + SIGTERM);
  CHECK_THAT(c.output(), Catch::Contains("warning: --term-grace 0.5 s is shorter than the ~") &&
                             Catch::Contains("the workers need to finish step 4"));
  CHECK_THAT(c.output(),
             Catch::Contains("rank 0 did not exit within 0.5 s of SIGTERM and got SIGKILL before "
                             "its checkpoint committed: lost 1 step(s) since the checkpoint of "
                             "step 2; the next start continues from step 2; --term-grace "));
  CHECK(
      std::regex_search(c.output(), std::regex("--term-grace [0-9]+ would have given them time")));
  CHECK(read_file(out + "/checkpoints/latest") == "step-000000002\n");
}

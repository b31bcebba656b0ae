// Faults of the network, with network namespaces as hosts (iproute2): each node of a job is a
// namespace with one address, all on one bridge (the switch, in a namespace of its own). A node's
// link is taken down mid-run by downing its switch port: its processes live on, its packets are
// gone, no connection is reset. Needs root (CAP_NET_ADMIN, `ip netns`); elsewhere each test prints
// SKIP and exits 77, which CTest shows as skipped, never passed. The namespaces share the file
// system, as nodes share the output directory of a job.
#include "support/netns.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
using Clock = std::chrono::steady_clock;

namespace {

// The job tests' small model (runs.h), a checkpoint every 3 steps, one step per metrics line.
std::vector<std::string> train(const std::string& out, int steps) {
  return ft_train_argv(
      {"--preset", "tiny-demo", "--output", out},
      with(small_run_sets(), {"train.max_steps=" + std::to_string(steps), "output.save_every=3",
                              "output.keep_last=3", "train.micro_batch=2", "train.log_every=1"}));
}

// Waits until `c`'s output contains `text`; the seconds waited, or -1 at the deadline.
double wait_output(const Child& c, const std::string& text, double timeout_s) {
  const auto start = Clock::now();
  while (c.output().find(text) == std::string::npos) {
    if (Clock::now() - start > std::chrono::duration<double>(timeout_s)) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The node rank a launcher was given in round 0 ("[ft node N] round 0: ..."), or -1.
int node_rank_in_round0(const Child& c) {
  std::smatch m;
  const std::string out = c.output();
  static const std::regex re(R"(\[ft node (\d+)\] round 0:)");
  return std::regex_search(out, m, re) ? std::stoi(m[1]) : -1;
}

// metrics.jsonl holds every step from 1 to `steps` once, in order.
void check_every_step_once(const std::string& out, int steps) {
  auto m = read_metrics(out);
  REQUIRE(m.size() == static_cast<size_t>(steps));
  for (size_t i = 0; i < m.size(); ++i) CHECK(m[i]["step"] == static_cast<int>(i + 1));
}

// Launcher options shared by the tests: a 3 s heartbeat timeout, restarts to spare.
std::vector<std::string> launch_opts(const Network& net, const std::string& nnodes) {
  return {"--nnodes",      nnodes,  "--nproc-per-node", "1", "--master-addr",       net.addr(0),
          "--master-port", "29500", "--max-restarts",   "3", "--heartbeat-timeout", "3",
          "--term-grace",  "3",     "--rdzv-timeout",   "60"};
}

}  // namespace

TEST_CASE(
    "netns, --nnodes 2:3: a node whose link goes down is lost within the heartbeat timeout and "
    "the job goes on with the other two",
    "[multiproc]") {
  require_netns();
  Network net(3);
  const std::string out = make_temp_dir() + "/run";
  std::vector<std::string> opts = launch_opts(net, "2:3");
  opts.insert(opts.end(), {"--rdzv-last-call", "3"});
  auto launcher = [&](int i) {
    return start(net.on(i, ft_launch_argv(opts, train(out, 30))), {},
                 make_temp_dir() + "/n" + std::to_string(i) + ".txt");
  };
  Child n0 = launcher(0);
  REQUIRE(wait_output(n0, "hosting the rendezvous store", 30) >= 0);
  Child n1 = launcher(1), n2 = launcher(2);
  wait_for_steps(out, 5, Clock::now() + std::chrono::seconds(120));
  INFO(output_tail(n0.output()));
  REQUIRE(read_metrics(out).size() >= 5);
  REQUIRE_THAT(n0.output(), Catch::Contains("world size 3"));
  const int lost = node_rank_in_round0(n2);
  REQUIRE(lost >= 0);
  net.link(2, false);
  // Either survivor may notice first; the other reads its record.
  const auto down = Clock::now();
  while (n0.output().find("sent no heartbeat") == std::string::npos &&
         n1.output().find("sent no heartbeat") == std::string::npos &&
         Clock::now() - down < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double detected = std::chrono::duration<double>(Clock::now() - down).count();
  std::printf("node %d declared lost %.2f s after its link went down\n", lost, detected);
  // Within --heartbeat-timeout of the link going down (the last beat came before), with 0.5 s for
  // this test's polling.
  CHECK(detected < 3 + 0.5);
  // Node 0 tells the failure before it stops its workers (which takes up to --term-grace).
  CHECK(wait_output(n0, "was lost", 1) >= 0);
  CHECK_THAT(n0.output(),
             Catch::Contains("node " + std::to_string(lost) + " (") && Catch::Contains("was lost"));
  const auto rc0 = wait_for(n0, 150), rc1 = wait_for(n1, 150);
  if (!rc0) kill_and_reap(n0);
  if (!rc1) kill_and_reap(n1);
  kill_and_reap(n2);  // cut off for good
  INFO(output_tail(n1.output()));
  REQUIRE(rc0.value_or(-1) == 0);
  REQUIRE(rc1.value_or(-1) == 0);
  CHECK_THAT(n0.output(), Catch::Contains("round 1: 2 node(s) x 1 worker(s), world size 2"));
  CHECK_THAT(n0.output() + n1.output(), Catch::Contains("resuming from"));
  check_every_step_once(out, 30);
}

namespace {

// Two nodes with fixed ranks; node `cut`'s link goes down mid-run for about 6 s and comes back.
// The other node declares it lost within the heartbeat timeout and waits for it, naming it; when
// the link is back, the node's launcher rejoins and the job finishes from the checkpoint.
void link_down_and_back(int cut) {
  require_netns();
  Network net(2);
  const std::string out = make_temp_dir() + "/run";
  auto launcher = [&](int i) {
    std::vector<std::string> opts = launch_opts(net, "2");
    opts.insert(opts.end(), {"--node-rank", std::to_string(i)});
    return start(net.on(i, ft_launch_argv(opts, train(out, 24))), {},
                 make_temp_dir() + "/n" + std::to_string(i) + ".txt");
  };
  Child n0 = launcher(0), n1 = launcher(1);
  wait_for_steps(out, 5, Clock::now() + std::chrono::seconds(120));
  REQUIRE(read_metrics(out).size() >= 5);
  const auto down = Clock::now();
  net.link(cut, false);
  // Node 0, the store host, sees node 1 go silent either way.
  const double detected = wait_output(n0, "sent no heartbeat", 30);
  CHECK(detected >= 0);
  CHECK(detected < 3 + 0.5);
  CHECK(wait_output(n0,
                    "round 1: waiting for nodes to join: 1/2 nodes joined (missing node_rank 1)",
                    30) >= 0);
  std::this_thread::sleep_for(std::chrono::seconds(6) - (Clock::now() - down));
  net.link(cut, true);
  const auto rc0 = wait_for(n0, 150), rc1 = wait_for(n1, 150);
  if (!rc0) kill_and_reap(n0);
  if (!rc1) kill_and_reap(n1);
  INFO(output_tail(n0.output()));
  INFO(output_tail(n1.output()));
  REQUIRE(rc0.value_or(-1) == 0);
  REQUIRE(rc1.value_or(-1) == 0);
  CHECK_THAT(n0.output(), Catch::Contains("sent no heartbeat") && Catch::Contains("was lost"));
  CHECK_THAT(n0.output(), Catch::Contains("round 1: 2 node(s) x 1 worker(s), world size 2"));
  CHECK_THAT(n0.output(), Catch::Contains("resuming from"));
  check_every_step_once(out, 24);
}

}  // namespace

TEST_CASE(
    "netns, --nnodes 2: node 1's link down and back: lost within the heartbeat timeout, "
    "waited for by name, rejoins, the job finishes",
    "[multiproc]") {
  link_down_and_back(1);
}

TEST_CASE("netns, --nnodes 2: the store host's link down and back: the job survives and finishes",
          "[multiproc]") {
  link_down_and_back(0);
}

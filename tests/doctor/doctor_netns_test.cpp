// `ft doctor` on a real network (issue 15): two network namespaces as two hosts joined through a
// bridge, each node's side of its link rate-limited to 200 Mbit/s by tc's token bucket, each
// running an `ft launch` of the same job. The doctor measures the cross-node bandwidth within 20%
// of the rate and names the link; for a 2-node ddp job of a small model its predicted step time is
// within 25% of the step time `ft train` then measures over the same link, with the warning and the
// advice; the same without the limit shows the difference. Needs root and tc; skipped visibly
// elsewhere (exit 77).
#include <catch2/catch.hpp>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/netns.h"
#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
using nlohmann::json;

namespace {

constexpr double kLimit = 200e6 / 8;  // 200 Mbit/s in bytes per second

std::vector<std::string> launch_opts(const Network& net) {
  return {"--nnodes",      "2",     "--nproc-per-node", "1",  "--master-addr",  net.addr(0),
          "--master-port", "29500", "--rdzv-timeout",   "60", "--max-restarts", "0"};
}

struct Both {
  int code0 = -1, code1 = -1;
  std::string out;  // both launchers' output
};

// `program` on both nodes under `ft launch --nnodes 2`. Each rank computes on one thread, so that
// the two "nodes" of this one machine do not oversubscribe its cores (ft launch gives its workers
// OMP_NUM_THREADS=1 when a node runs several; here each node runs one).
Both on_both(const Network& net, const std::vector<std::string>& program, const std::string& log) {
  const std::map<std::string, std::string> env = {{"OMP_NUM_THREADS", "1"}};
  Child n0 = start(net.on(0, ft_launch_argv(launch_opts(net), program)), env, log + ".0");
  Child n1 = start(net.on(1, ft_launch_argv(launch_opts(net), program)), env, log + ".1");
  Both b;
  b.code0 = wait_for(n0, 300).value_or(-1);
  b.code1 = wait_for(n1, 300).value_or(-1);
  b.out = n0.output() + n1.output();
  return b;
}

std::vector<std::string> doctor(const std::string& json_path) {
  return {ft_bin(), "doctor", "--preset", "tiny-demo", "--max-size", "4MiB", "--json", json_path};
}

json read_json(const std::string& path) { return json::parse(read_file(path)); }

// The bus bandwidth of the largest all-reduce the doctor timed over the whole job.
double largest_busbw(const json& j) {
  return j["collectives"]["world"]["all-reduce"].back()["busbw_bytes_per_s"].get<double>();
}

double median_step(const std::string& run) {
  std::vector<double> t;
  const auto m = read_metrics(run);
  for (size_t i = 2; i < m.size(); ++i) t.push_back(m[i]["step_time_s"].get<double>());
  std::sort(t.begin(), t.end());
  return t.empty() ? 0 : t[t.size() / 2];
}

}  // namespace

TEST_CASE(
    "netns, 2 nodes over a 200 Mbit/s link: ft doctor measures the link, names it, and "
    "predicts the ddp step within 25%",
    "[multiproc]") {
  require_netns(/*need_tc=*/true);
  Network net(2);
  net.limit(0, "200mbit");
  net.limit(1, "200mbit");
  const std::string dir = make_temp_dir();

  const Both limited = on_both(net, doctor(dir + "/limited.json"), dir + "/doctor-limited");
  INFO(output_tail(limited.out));
  REQUIRE(limited.code0 == 0);
  REQUIRE(limited.code1 == 0);
  const json lj = read_json(dir + "/limited.json");
  const double bw = largest_busbw(lj);
  INFO("cross-node all-reduce bus bandwidth " << bw / 1e6 << " MB/s, the link " << kLimit / 1e6);
  CHECK(bw > 0.8 * kLimit);
  CHECK(bw < 1.2 * kLimit);
  // The all-to-all (expert parallelism's token exchange) runs over the same link: half of what
  // each rank sends crosses it, which nccl-tests' bus bandwidth accounts for. At 1 MiB: below,
  // latency and the token bucket's burst decide; at 4 MiB Gloo's all-to-all measured 13.5 MB/s
  // once (its sends and receives interleave worse than all-gather's there).
  double a2a = 0;
  for (const auto& row : lj["collectives"]["world"]["all-to-all"])
    if (row["bytes"].get<int64_t>() == 1 << 20) a2a = row["busbw_bytes_per_s"].get<double>();
  INFO("all-to-all bus bandwidth at 1 MiB " << a2a / 1e6 << " MB/s");
  CHECK(a2a > 0.7 * kLimit);
  CHECK(a2a < 1.25 * kLimit);
  // The node pair's figure is the same link.
  const double pair = lj["pairs"]["busbw_bytes_per_s"][1].get<double>();
  CHECK(pair > 0.8 * kLimit);
  CHECK(pair < 1.2 * kLimit);
  CHECK_THAT(limited.out, Catch::Contains("bottleneck: the network between nodes"));
  // The job is communication-bound there: the warning, the reason and the advice, with numbers.
  const json& pred = lj["prediction"];
  CHECK(pred["efficiency"].get<double>() < 0.7);
  CHECK_THAT(limited.out, Catch::Contains("warning: scaling efficiency") &&
                              Catch::Contains("exposed communication") &&
                              Catch::Contains("what to do") &&
                              Catch::Contains("train.grad_accum="));
  CHECK(pred["alternatives"].size() >= 3);

  // The same job, trained over the same link: the measured step time against the prediction.
  const Both run = on_both(net,
                           ft_train_argv({"--preset", "tiny-demo", "--output", dir + "/run"},
                                         {"train.max_steps=12", "train.log_every=4"}),
                           dir + "/train-limited");
  INFO(output_tail(run.out));
  REQUIRE(run.code0 == 0);
  REQUIRE(run.code1 == 0);
  const double measured = median_step(dir + "/run");
  const double predicted = pred["step_s"].get<double>();
  INFO("predicted step " << predicted * 1e3 << " ms, measured " << measured * 1e3 << " ms");
  CHECK(std::abs(predicted - measured) <= 0.25 * measured);

  // Without the limit: the link is far faster, the predicted step shorter, the efficiency higher.
  net.limit(0, "");
  net.limit(1, "");
  const Both fast = on_both(net, doctor(dir + "/unlimited.json"), dir + "/doctor-unlimited");
  INFO(output_tail(fast.out));
  REQUIRE(fast.code0 == 0);
  REQUIRE(fast.code1 == 0);
  const json fj = read_json(dir + "/unlimited.json");
  CHECK(largest_busbw(fj) > 4 * bw);
  CHECK(fj["prediction"]["comm_s"].get<double>() < 0.5 * pred["comm_s"].get<double>());
  CHECK(fj["prediction"]["step_s"].get<double>() < predicted);
  CHECK(fj["prediction"]["efficiency"].get<double>() > pred["efficiency"].get<double>());
}

TEST_CASE("netns, 3 nodes, one behind a 100 Mbit/s link: the node-pair matrix names that node",
          "[multiproc]") {
  require_netns(/*need_tc=*/true);
  Network net(3);
  net.limit(2, "100mbit");
  const std::string dir = make_temp_dir();
  std::vector<Child> nodes;
  for (int i = 0; i < 3; ++i) {
    std::vector<std::string> opts = {"--nnodes",         "3",
                                     "--nproc-per-node", "1",
                                     "--node-rank",      std::to_string(i),
                                     "--master-addr",    net.addr(0),
                                     "--master-port",    "29500",
                                     "--rdzv-timeout",   "60",
                                     "--max-restarts",   "0"};
    nodes.push_back(start(net.on(i, ft_launch_argv(opts, {ft_bin(), "doctor", "--max-size", "1MiB",
                                                          "--json", dir + "/doctor.json"})),
                          {{"OMP_NUM_THREADS", "1"}}, dir + "/node" + std::to_string(i)));
  }
  std::string out;
  for (auto& n : nodes) {
    CHECK(wait_for(n, 300).value_or(-1) == 0);
    out += n.output();
  }
  INFO(output_tail(out));
  CHECK_THAT(out, Catch::Contains("SLOW NODE: node 2"));
  CHECK_THAT(out, !Catch::Contains("SLOW NODE: node 0") && !Catch::Contains("SLOW NODE: node 1") &&
                      !Catch::Contains("SLOW LINK"));
  const json j = read_json(dir + "/doctor.json");
  const auto& bw = j["pairs"]["busbw_bytes_per_s"];  // 3 x 3, row-major
  const double fast = bw[0 * 3 + 1].get<double>();
  CHECK(bw[0 * 3 + 2].get<double>() < 0.2 * fast);
  CHECK(bw[1 * 3 + 2].get<double>() < 0.2 * fast);
  CHECK(bw[0 * 3 + 2].get<double>() > 0.8 * 100e6 / 8);
}

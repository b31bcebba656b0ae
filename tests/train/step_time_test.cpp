// Where step time goes (issue 15): metrics.jsonl's per-step breakdown, MFU from the FLOP count,
// and the straggler warning, on real runs (one process; two ranks under `ft launch`).
#include <algorithm>
#include <catch2/catch.hpp>
#include <regex>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;

namespace {

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The share of each step's time that the named parts (data, compute, comm, optimizer, checkpoint)
// do not cover, median over the steps after the first.
double uncovered_share(const std::vector<nlohmann::json>& m) {
  std::vector<double> share;
  for (size_t i = 1; i < m.size(); ++i) {
    const auto& t = m[i]["time"];
    const double step = m[i]["step_time_s"].get<double>();
    const double parts = t["data_s"].get<double>() + t["compute_s"].get<double>() +
                         t["comm_s"].get<double>() + t["optimizer_s"].get<double>() +
                         t["checkpoint_s"].get<double>();
    // other_s is what the parts leave: the record adds up exactly.
    CHECK(parts + t["other_s"].get<double>() == Approx(step).epsilon(1e-6));
    share.push_back(std::abs(step - parts) / step);
  }
  return median_of(share);
}

}  // namespace

TEST_CASE("metrics.jsonl: the step's parts add up to its time, and MFU is the FLOP count over it",
          "[multiproc]") {
  const std::string dir = make_temp_dir(), out = dir + "/run";
  const Finished run =
      run_to_end(ft_train_argv({"--preset", "tiny-demo", "--output", out},
                               {"train.max_steps=8", "output.save_every=4", "train.log_every=1"}),
                 {}, dir + "/log", 240);
  const std::string& log = run.output;
  REQUIRE(run.code == 0);
  INFO(log);
  const auto m = read_metrics(out);
  REQUIRE(m.size() == 8);
  // The named parts cover the step within 5%.
  CHECK(uncovered_share(m) < 0.05);
  // tiny-demo by hand: layers of q 128x128, k and v 128x64, o 128x128, gate, up and down 128x352:
  // 184,320 weights; 2 layers and the (tied) head 128x320: 409,600. 6N = 2,457,600; attention
  // 12 x 2 layers x 4 heads x 32 x 128 tokens = 393,216: 2,850,816 FLOPs per token.
  for (const auto& r : m) {
    CHECK(r["flops"].get<double>() == 2850816.0 * r["input_tokens"].get<double>());
    CHECK(r["mfu"].get<double>() > 0);
  }
  // The same figure from the peak the run printed last (at the start, or measured again after 3
  // steps): mfu = flops / step time / peak. Never above 1: a step faster than the peak raises it.
  double peak_flops = 0;
  const std::regex printed(R"(MFU (?:now )?against ([0-9.e+]+) TFLOP/s)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), printed);
       it != std::sregex_iterator(); ++it)
    peak_flops = std::stod((*it)[1]) * 1e12;
  REQUIRE(peak_flops > 0);
  for (const auto& r : m) CHECK(r["mfu"].get<double>() <= 1.0);
  const auto& last = m.back();
  if (log.find("above the peak measured at start") == std::string::npos)
    CHECK(last["mfu"].get<double>() ==
          Approx(last["flops"].get<double>() / last["step_time_s"].get<double>() / peak_flops)
              .epsilon(0.01));
  // The console line shows MFU and the exposed communication's share.
  CHECK(std::regex_search(log, std::regex(R"(step 8/8 .* tok/s MFU [0-9.]+% comm 0%)")));
  // A step that saved a checkpoint spent time there.
  CHECK(m[3]["time"]["checkpoint_s"].get<double>() > m[2]["time"]["checkpoint_s"].get<double>());
}

TEST_CASE("two ranks: a rank slowed by its data is named a straggler once, and none without it",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::vector<std::string> sets = {"train.max_steps=16", "train.log_every=4"};
  // Rank 1 sleeps 300 ms in each step's data fetch (FT_FAULT_STEP_DELAY), far more than a step's
  // compute even on a loaded 2-core machine; rank 0 waits for it in the gradient all-reduce.
  Child slow = start(tiny_job_argv(2, dir + "/slow", sets), {{"FT_FAULT_STEP_DELAY", "1:0.3"}},
                     dir + "/slow.log");
  REQUIRE(wait_for(slow, 180) == 0);
  const std::string text = slow.output();
  INFO(text);
  const std::regex warning(
      R"(warning: straggler: rank 1 \(node 0, cpu\) worked ([0-9.]+) ms per step)");
  std::smatch w;
  REQUIRE(std::regex_search(text, w, warning));
  CHECK(std::stod(w[1]) >= 300);
  // Once per run.
  CHECK(text.find("straggler", text.find("straggler") + 1) == std::string::npos);
  const auto m = read_metrics(dir + "/slow");
  REQUIRE(m.size() == 16);
  CHECK(uncovered_share(m) < 0.05);
  // Rank 1 is the slowest at (nearly) every step; rank 0 spends the wait in communication, and
  // rank 1's own record has its sleep as data time. (Medians and counts: a 2-core machine running
  // other tests may pause either rank now and then.)
  int rank1_slowest = 0;
  std::vector<double> comm, busy_max;
  for (size_t i = 1; i < m.size(); ++i) {
    rank1_slowest += m[i]["ranks"]["slowest_rank"] == 1;
    busy_max.push_back(m[i]["ranks"]["busy_max_s"].get<double>());
    comm.push_back(m[i]["time"]["comm_s"].get<double>());
  }
  CHECK(rank1_slowest >= 12);
  CHECK(median_of(busy_max) >= 0.3);
  CHECK(median_of(comm) >= 0.2);
  const auto r1 = read_jsonl(dir + "/slow/metrics.rank1.jsonl");
  REQUIRE(r1.size() == 16);
  CHECK(r1.back()["time"]["data_s"].get<double>() >= 0.3);

  Child even = start(tiny_job_argv(2, dir + "/even", sets), {}, dir + "/even.log");
  REQUIRE(wait_for(even, 180) == 0);
  CHECK(even.output().find("straggler") == std::string::npos);
}

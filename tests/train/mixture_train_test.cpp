// Mixtures and eval.split with real `ft train` processes: a 70/30 mixture of two files trains with
// those proportions (metrics.jsonl's source_records, ft report's table), a mixture run killed
// with SIGKILL mid-epoch resumes bit-identically, and eval.split holds out the same records at
// world size 1 and 2 and across a restart, with its eval_loss recorded.
#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
using nlohmann::json;

namespace {

// `n` pre-tokenized records for tiny-demo's vocabulary of 320 (no tokenizer needed): record i is
// 2 + (i * 7 + salt) % 9 tokens, ids drawn from [4, 320).
std::string write_records(const std::string& path, int n, unsigned salt) {
  std::ofstream out(path);
  std::mt19937 gen(salt);
  for (int i = 0; i < n; ++i) {
    json ids = json::array();
    const int len = 2 + static_cast<int>((i * 7 + salt) % 9);
    for (int t = 0; t < len; ++t) ids.push_back(4 + static_cast<int>(gen() % 316));
    out << json{{"input_ids", ids}}.dump() << "\n";
  }
  return path;
}

// ft train on the small model over `data` (each a --data value), then the settings.
std::vector<std::string> train_argv(const std::string& out, const std::vector<std::string>& data,
                                    const std::vector<std::string>& sets) {
  std::vector<std::string> args = {"--preset", "tiny-demo", "--output", out};
  for (const auto& d : data) args.insert(args.end(), {"--data", d});
  return ft_train_argv(args, with(with(small_run_sets(), {"data.format=auto"}), sets));
}

Finished run(const std::vector<std::string>& argv) {
  return run_to_end(argv, {}, make_temp_dir() + "/out.txt", 240);
}

}  // namespace

TEST_CASE("a 70/30 mixture trains with its proportions: 4 sigma over 10,000 records",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string a = write_records(dir + "/a.jsonl", 300, 1);
  const std::string b = write_records(dir + "/b.jsonl", 200, 2);
  // One record per row, 100 rows per step, 100 steps: 10,000 records drawn.
  Finished r = run(train_argv(
      dir + "/out", {a + ":0.7", b + ":0.3"},
      {"data.seq_len=16", "data.pack=false", "train.micro_batch=100", "train.max_steps=100"}));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("a mixture of 2 sources (a.jsonl 70.0% of 300 records, "
                                       "b.jsonl 30.0% of 200 records)"));
  const auto metrics = read_metrics(dir + "/out");
  REQUIRE(metrics.size() == 100);
  int64_t from_a = 0, from_b = 0, tokens = 0, input_tokens = 0;
  for (const auto& m : metrics) {
    from_a += m["source_records"]["a.jsonl"].get<int64_t>();
    from_b += m["source_records"]["b.jsonl"].get<int64_t>();
    tokens +=
        m["source_tokens"]["a.jsonl"].get<int64_t>() + m["source_tokens"]["b.jsonl"].get<int64_t>();
    input_tokens += m["input_tokens"].get<int64_t>();
  }
  REQUIRE(from_a + from_b == 10000);
  CHECK(tokens == input_tokens);
  // Binomial(10000, 0.7): sigma = sqrt(10000 * 0.7 * 0.3) = 45.8; 4 sigma = 183.
  INFO("records from a.jsonl: " << from_a);
  CHECK(std::abs(static_cast<double>(from_a) - 7000) <= 4 * std::sqrt(10000 * 0.7 * 0.3));
  // ft report: the cumulative figure and the table of the totals.
  REQUIRE(run({ft_bin(), "report", dir + "/out"}).code == 0);
  const std::string page = read_file(dir + "/out/report.html");
  CHECK_THAT(page, Catch::Contains("<h2>Data sources</h2>") &&
                       Catch::Contains("data-sources=\"2\"") &&
                       Catch::Contains("<td>a.jsonl</td><td>" + std::to_string(from_a) + "</td>"));
}

TEST_CASE("a mixture run killed with SIGKILL mid-epoch resumes bit-identically", "[multiproc]") {
  const std::string dir = make_temp_dir();
  // 37 + 23 records packed into rows of 32 tokens, 8 rows a step: an epoch of the mixture ends
  // mid-step, and the checkpoints of steps 4 and 8 fall inside epochs of both sources.
  const std::vector<std::string> data = {write_records(dir + "/a.jsonl", 37, 3) + ":2",
                                         write_records(dir + "/b.jsonl", 23, 4) + ":1"};
  const std::vector<std::string> sets = {"data.seq_len=32", "train.micro_batch=8",
                                         "train.max_steps=12", "output.save_every=4",
                                         "output.keep_last=3"};
  const std::string ref = dir + "/ref";
  Finished r = run(train_argv(ref, data, sets));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  for (const size_t kill_after : {6u, 9u}) {
    INFO("SIGKILL after " << kill_after << " steps");
    const std::string out = dir + "/run" + std::to_string(kill_after);
    Child c = start(train_argv(out, data, sets), {}, make_temp_dir() + "/out.txt");
    wait_for_steps(out, kill_after, std::chrono::steady_clock::now() + std::chrono::seconds(120));
    ::kill(c.pid, SIGKILL);
    REQUIRE(wait_for(c, 30).value_or(-1) == 128 + SIGKILL);
    Finished again = run(train_argv(out, data, sets));
    INFO(output_tail(again.output));
    REQUIRE(again.code == 0);
    CHECK(read_file(ref + "/final/model.safetensors") ==
          read_file(out + "/final/model.safetensors"));
    const auto x = read_metrics(ref), y = read_metrics(out);
    REQUIRE(y.size() == x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      CHECK(y[i]["loss"] == x[i]["loss"]);
      CHECK(y[i]["source_records"] == x[i]["source_records"]);
      CHECK(y[i]["source_tokens"] == x[i]["source_tokens"]);
    }
  }
}

// A checkpoint's mixture position is the global stream's: one rank's run of 8 records a step,
// continued from its step-4 checkpoint by two ranks of 4 records each, takes the same records
// (one per row: the same losses within rounding, the same records and tokens per source).
TEST_CASE("a mixture checkpoint of one rank continues on two with the same records",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::vector<std::string> data = {write_records(dir + "/a.jsonl", 37, 8) + ":0.6",
                                         write_records(dir + "/b.jsonl", 23, 9) + ":0.4"};
  const std::vector<std::string> sets = {"data.seq_len=16", "data.pack=false", "train.max_steps=8",
                                         "output.save_every=4"};
  Finished one = run(train_argv(dir + "/one", data, with(sets, {"train.micro_batch=8"})));
  INFO(output_tail(one.output));
  REQUIRE(one.code == 0);
  std::vector<std::string> argv =
      train_argv(dir + "/two", data, with(sets, {"train.micro_batch=4"}));
  argv.insert(argv.end(), {"--resume", dir + "/one/checkpoints/step-000000004"});
  Finished two = run(ft_launch_argv(
      {"--nproc-per-node", "2", "--master-port", std::to_string(free_port())}, argv));
  INFO(output_tail(two.output));
  REQUIRE(two.code == 0);
  const auto ref = read_metrics(dir + "/one"), m = read_metrics(dir + "/two");
  REQUIRE(ref.size() == 8);
  REQUIRE(m.size() == 4);
  for (const auto& rec : m) {
    const int step = rec["step"];
    INFO("step " << step);
    const double want = ref[step - 1]["loss"];
    CHECK(std::abs(rec["loss"].get<double>() - want) <= 1e-5 * want);
    CHECK(rec["source_records"] == ref[step - 1]["source_records"]);
    CHECK(rec["source_tokens"] == ref[step - 1]["source_tokens"]);
  }
}

TEST_CASE("eval.split holds out the same records at world size 1 and 2 and across a restart",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::vector<std::string> data = {write_records(dir + "/a.jsonl", 60, 5) + ":0.7",
                                         write_records(dir + "/b.jsonl", 40, 6) + ":0.3"};
  const std::vector<std::string> sets = {"data.seq_len=32",   "train.micro_batch=4",
                                         "train.max_steps=8", "output.save_every=4",
                                         "eval.split=0.1",    "eval.every=4"};
  const std::string ref = dir + "/ref";
  Finished r = run(train_argv(ref, data, sets));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("eval.split (10 records held out of"));
  const json held = json::parse(read_file(ref + "/eval_split.json"));
  REQUIRE(held["records"].size() == 10);  // 6 of a.jsonl, 4 of b.jsonl
  int from_a = 0;
  for (const auto& origin : held["records"])
    from_a += origin.get<std::string>().find("/a.jsonl:") != std::string::npos;
  CHECK(from_a == 6);
  const auto ref_metrics = read_metrics(ref);
  REQUIRE(ref_metrics.size() == 8);
  CHECK(ref_metrics[3].contains("eval_loss"));
  CHECK(ref_metrics[7].contains("eval_loss"));
  CHECK_FALSE(ref_metrics[4].contains("eval_loss"));

  // Killed after step 5 (the checkpoint of step 4 committed or not) and run again: the same
  // held-out records, and the same eval loss at the end.
  const std::string resumed = dir + "/resumed";
  Child c = start(train_argv(resumed, data, sets), {}, make_temp_dir() + "/out.txt");
  wait_for_steps(resumed, 5, std::chrono::steady_clock::now() + std::chrono::seconds(120));
  ::kill(c.pid, SIGKILL);
  REQUIRE(wait_for(c, 30).value_or(-1) == 128 + SIGKILL);
  Finished again = run(train_argv(resumed, data, sets));
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  CHECK(json::parse(read_file(resumed + "/eval_split.json")) == held);
  CHECK(read_metrics(resumed)[7]["eval_loss"] == ref_metrics[7]["eval_loss"]);

  // Two ranks: the same records held out, the same tokens evaluated.
  const std::string two = dir + "/two";
  Finished w2 =
      run(ft_launch_argv({"--nproc-per-node", "2", "--master-port", std::to_string(free_port())},
                         train_argv(two, data, sets)));
  INFO(output_tail(w2.output));
  REQUIRE(w2.code == 0);
  CHECK(json::parse(read_file(two + "/eval_split.json")) == held);
  CHECK(read_metrics(two)[7]["eval_tokens"] == ref_metrics[7]["eval_tokens"]);
}

TEST_CASE("bad --data values and sources are refused before anything is written", "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string a = write_records(dir + "/a.jsonl", 10, 7);
  const auto refused = [&](const std::vector<std::string>& data,
                           const std::vector<std::string>& sets) {
    Finished r = run(train_argv(dir + "/out", data, sets));
    CHECK(r.code == 2);
    CHECK_FALSE(std::filesystem::exists(dir + "/out"));
    return r.output;
  };
  CHECK_THAT(refused({a + ":0.7", dir + "/missing.jsonl:0.3"}, {}),
             Catch::Contains("--data '" + dir + "/missing.jsonl:0.3'") &&
                 Catch::Contains("does not exist"));
  CHECK_THAT(refused({a + ":0.7", a + ":0"}, {}), Catch::Contains("must be a number > 0"));
  CHECK_THAT(refused({a + ":0.7"}, {R"(data.sources=[{"path": "x.jsonl"}])"}),
             Catch::Contains("the data is given twice"));
  CHECK_THAT(refused({a + ":0.7", a + ":0.3"}, {}), Catch::Contains("are both named 'a.jsonl'"));
  CHECK_THAT(refused({}, {R"(data.sources=[{"path": "x.jsonl", "wieght": 1}])"}),
             Catch::Contains("unknown key \"data.sources[0].wieght\" (did you mean \"weight\"?)"));
}

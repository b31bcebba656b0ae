// eval.data during ft train: the eval loss a run records at step N equals `ft eval` of the
// checkpoint it saved at step N (exported with ft export) on the same file, within 1e-6 relative,
// on 1 and 2 ranks (ddp, zero3, fsdp SHARD_GRAD_OP), with records longer than data.seq_len scored
// in windows; and evaluating does not change the training losses.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
using nlohmann::json;

namespace {

// Pre-tokenized records (no tokenizer needed) for tiny-demo's vocabulary of 320: 15 records of
// 6 to 300 tokens (data.seq_len is 128: the long ones become windows), prompts masked.
std::string write_eval_file(const std::string& dir) {
  const std::string path = dir + "/held_out.jsonl";
  std::ofstream out(path);
  std::mt19937 gen(7);
  for (int r = 0; r < 15; ++r) {
    const int n = 6 + static_cast<int>(gen() % 295);
    json ids = json::array(), labels = json::array();
    for (int t = 0; t < n; ++t) {
      const int id = 4 + static_cast<int>(gen() % 316);
      ids.push_back(id);
      labels.push_back(t < n / 3 ? -100 : id);
    }
    out << json{{"input_ids", ids}, {"labels", labels}}.dump() << "\n";
  }
  return path;
}

// ft eval's JSON of a model directory over `data`, read and batched as the run read it.
json ft_eval(const std::string& model, const std::string& data) {
  const std::string log = make_temp_dir() + "/eval.txt";
  const int code = run_ft({"eval", "--model", model, "--data", data, "--preset", "tiny-demo",
                           "--set", "data.format=auto", "--set", "eval.batch_tokens=512"},
                          log);
  const std::string text = read_file(log);
  INFO(text);
  REQUIRE(code == 0);
  return json::parse(text.substr(text.rfind("{\"")));
}

void check_eval_equals_ft_eval(int nproc, const std::vector<std::string>& extra) {
  const std::string dir = make_temp_dir();
  const std::string data = write_eval_file(dir);
  const std::string out = dir + "/run";
  Finished r =
      run_to_end(tiny_job_argv(nproc, out,
                               with({"train.max_steps=6", "output.save_every=3", "eval.every=3",
                                     "eval.data=" + data, "eval.batch_tokens=512"},
                                    extra)),
                 {}, dir + "/out.txt", 240);
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("ft train: step 3: eval loss"));
  const auto metrics = read_metrics(out);
  REQUIRE(metrics.size() == 6);
  for (const auto& m : metrics)
    CHECK(m.contains("eval_loss") == (m["step"] == 3 || m["step"] == 6));
  // Step 3: the checkpoint of step 3, exported; step 6: final/.
  const std::string exported = dir + "/step3";
  REQUIRE(
      run_ft({"export", "--checkpoint", out + "/checkpoints/step-000000003", "--output", exported},
             dir + "/export.txt") == 0);
  for (const auto& [index, model] :
       std::vector<std::pair<int, std::string>>{{2, exported}, {5, out + "/final"}}) {
    const json ref = ft_eval(model, data);
    const json& got = metrics[index];
    INFO("step " << got["step"] << ": ft train " << got["eval_loss"] << ", ft eval " << ref);
    CHECK(got["eval_tokens"] == ref["tokens"]);
    const double a = got["eval_loss"], b = ref["loss"];
    CHECK(std::abs(a - b) <= 1e-6 * std::abs(b));
  }
  // Training moved the weights: the two evaluations differ by far more than the tolerance.
  CHECK(std::abs(metrics[2]["eval_loss"].get<double>() - metrics[5]["eval_loss"].get<double>()) >
        1e-4);
  // Evaluating leaves training alone: the same run without eval.data logs the same losses.
  const std::string plain = dir + "/plain";
  Finished p = run_to_end(
      tiny_job_argv(nproc, plain, with({"train.max_steps=6", "output.save_every=3"}, extra)), {},
      dir + "/plain.txt", 240);
  REQUIRE(p.code == 0);
  const auto plain_metrics = read_metrics(plain);
  REQUIRE(plain_metrics.size() == 6);
  for (size_t i = 0; i < 6; ++i) CHECK(plain_metrics[i]["loss"] == metrics[i]["loss"]);
  // The report draws both points.
  CHECK_THAT(read_file(out + "/report.html"),
             Catch::Contains("data-series=\"eval_loss\" data-points=\"2\""));
}

}  // namespace

TEST_CASE("eval.data on 1 rank: the eval loss at step N is ft eval's of the step-N checkpoint",
          "[multiproc]") {
  check_eval_equals_ft_eval(1, {});
}

TEST_CASE("eval.data on 2 ranks (ddp): each rank's share adds up to ft eval's loss",
          "[multiproc]") {
  check_eval_equals_ft_eval(2, {});
}

TEST_CASE("eval.data on 2 ranks (zero3): sharded forwards, same loss as ft eval", "[multiproc]") {
  check_eval_equals_ft_eval(2, {"strategy.kind=zero3"});
}

TEST_CASE("eval.data on 2 ranks (fsdp SHARD_GRAD_OP): units gathered by an eval forward",
          "[multiproc]") {
  check_eval_equals_ft_eval(
      2, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP"});
}

TEST_CASE(
    "eval.every without eval.data, and eval.data without a trained token, are refused before "
    "anything is written",
    "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  const std::string log = make_temp_dir() + "/out.txt";
  CHECK(run_ft({"train", "--preset", "tiny-demo", "--output", out, "--set", "eval.every=5"}, log) ==
        2);
  CHECK_THAT(read_file(log), Catch::Contains("eval.every=5 needs eval.data"));
  CHECK_FALSE(std::filesystem::exists(out));
  const std::string prompts = make_temp_dir() + "/prompts.jsonl";
  std::ofstream(prompts) << R"({"input_ids": [5, 6, 7], "labels": [-100, -100, -100]})"
                         << "\n";
  CHECK(run_ft({"train", "--preset", "tiny-demo", "--output", out, "--set", "eval.data=" + prompts},
               log) == 2);
  CHECK_THAT(read_file(log), Catch::Contains(prompts + ": no token carries a loss"));
  CHECK_FALSE(std::filesystem::exists(out));
}

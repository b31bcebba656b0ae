// What a new user meets on a first `ft train` of their own data and model (issue 28): a malformed
// line found before anything is loaded or written, how long the run is in epochs, a warm-up that
// covers the whole run, and the presets for one's own model. Real processes, real files.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;

namespace {

bool exists(const std::string& p) { return ::access(p.c_str(), F_OK) == 0; }

// `records` pre-tokenized records of `length` ids each (below tiny-demo's vocabulary of 320); line
// `bad_line` (1-based; 0: none) is cut off mid-record.
std::string write_ids(const std::string& path, int records, int length, int bad_line = 0) {
  std::ofstream f(path);
  for (int i = 1; i <= records; ++i) {
    if (i == bad_line) {
      f << R"({"input_ids": [1, 2, 3)"
        << "\n";
      continue;
    }
    nlohmann::json ids = nlohmann::json::array();
    for (int t = 0; t < length; ++t) ids.push_back(1 + (i * 7 + t) % 300);
    f << nlohmann::json{{"input_ids", ids}}.dump() << "\n";
  }
  return path;
}

}  // namespace

TEST_CASE("a malformed line stops ft train and ft launch before the model loads or --output exists",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string data = write_ids(dir + "/ids.jsonl", 8, 20, /*bad_line=*/5);
  const std::vector<std::string> sets = {"data.format=auto", "train.max_steps=1"};
  // One step never reaches line 5 of the data: the whole file is checked first all the same.
  const int rc = run_ft({"train", "--preset", "tiny-demo", "--data", data, "--output", dir + "/run",
                         "--set", sets[0], "--set", sets[1]},
                        dir + "/train.log");
  const std::string log = read_file(dir + "/train.log");
  INFO(log);
  CHECK(rc == 2);
  CHECK_THAT(log, Catch::Contains("ids.jsonl:5:") &&
                      Catch::Contains("--set data.on_bad_record=skip") &&
                      !Catch::Contains("loading"));
  CHECK_FALSE(exists(dir + "/run"));

  // Two workers under the launcher: neither writes anything either.
  const Finished launched = run_to_end(
      ft_launch_argv(
          {"--nproc-per-node", "2", "--master-port", std::to_string(free_port())},
          ft_train_argv({"--preset", "tiny-demo", "--data", data, "--output", dir + "/launched"},
                        sets)),
      {}, dir + "/launch.log", 120);
  INFO(output_tail(launched.output));
  CHECK(launched.code != 0);
  CHECK_THAT(launched.output, Catch::Contains("ids.jsonl:5:"));
  CHECK_FALSE(exists(dir + "/launched"));

  // Skipping bad records is what the message offers, and it trains.
  REQUIRE(run_ft({"train", "--preset", "tiny-demo", "--data", data, "--output", dir + "/skip",
                  "--set", sets[0], "--set", sets[1], "--set", "data.on_bad_record=skip"},
                 dir + "/skip.log") == 0);
  CHECK(read_metrics(dir + "/skip").size() == 1);
}

TEST_CASE("the start line gives the run in epochs, and a warm-up as long as the run is a warning",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  // 16 records of 100 tokens: one to a row of 128, so an epoch is 16 rows, 2 steps of tiny-lora's
  // 8 sequences; 20 steps are 10 epochs.
  const std::string data = write_ids(dir + "/ids.jsonl", 16, 100);
  auto train = [&](const std::string& out, const std::vector<std::string>& more) {
    std::vector<std::string> a = {"train",
                                  "--preset",
                                  "tiny-lora",
                                  "--data",
                                  data,
                                  "--output",
                                  dir + "/" + out,
                                  "--set",
                                  "data.format=auto",
                                  "--set",
                                  "train.max_steps=20"};
    for (const auto& s : more) a.insert(a.end(), {"--set", s});
    return run_ft(a, dir + "/" + out + ".log");
  };
  REQUIRE(train("steps", {}) == 0);
  std::string log = read_file(dir + "/steps.log");
  INFO(log);
  CHECK_THAT(log, Catch::Contains("20 steps (about 10 epochs of 16 sequences)"));
  // tiny-lora's 20 warm-up steps are the whole run.
  CHECK_THAT(log, Catch::Contains("warning: the learning-rate warm-up (train.warmup_steps=20: 20 "
                                  "steps) lasts the whole run of 20 steps") &&
                      Catch::Contains("--set train.warmup_ratio=0.03"));
  auto metrics = read_metrics(dir + "/steps");
  REQUIRE(metrics.size() == 20);
  CHECK(metrics.back()["lr"].get<double>() == Approx(2e-3));  // the peak only at the end

  // warmup_ratio 0.1 of 20 steps: 2 steps up, then the cosine decay; no warning.
  REQUIRE(train("ratio", {"train.warmup_ratio=0.1"}) == 0);
  log = read_file(dir + "/ratio.log");
  CHECK_THAT(log, !Catch::Contains("warm-up"));
  metrics = read_metrics(dir + "/ratio");
  REQUIRE(metrics.size() == 20);
  CHECK(metrics[0]["lr"].get<double>() == Approx(1e-3));
  CHECK(metrics[1]["lr"].get<double>() == Approx(2e-3));
  CHECK(metrics.back()["lr"].get<double>() == Approx(2e-4));  // min_lr_ratio 0.1
}

TEST_CASE("the lora preset trains one's own model, and refuses clearly without --model",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string data = write_ids(dir + "/ids.jsonl", 16, 100);
  // No --model: refused before anything is written, saying what to give.
  CHECK(run_ft({"train", "--preset", "lora", "--data", data, "--output", dir + "/none"},
               dir + "/none.log") == 2);
  CHECK_THAT(read_file(dir + "/none.log"),
             Catch::Contains("this preset trains your own model (model.require_dir is true): give "
                             "its Hugging Face directory with --model DIR"));
  CHECK_FALSE(exists(dir + "/none"));

  // A model of our own: tiny-demo's, trained one step (max_position_embeddings 256).
  REQUIRE(run_ft({"train", "--preset", "tiny-demo", "--output", dir + "/base", "--set",
                  "train.max_steps=1"},
                 dir + "/base.log") == 0);
  const std::vector<std::string> args = {
      "train", "--preset", "lora", "--model", dir + "/base/final", "--data", data, "--output"};
  auto with_output = [&](const std::string& out, std::vector<std::string> more) {
    std::vector<std::string> a = args;
    a.push_back(dir + "/" + out);
    a.insert(a.end(), more.begin(), more.end());
    return a;
  };
  // Its seq_len of 2048 is longer than this model's positions: the refusal says what to set.
  CHECK(run_ft(with_output("long", {}), dir + "/long.log") == 2);
  CHECK_THAT(read_file(dir + "/long.log"),
             Catch::Contains("exceeds the model's max_position_embeddings 256") &&
                 Catch::Contains("--set data.seq_len=256 or less"));
  CHECK_FALSE(exists(dir + "/long"));
  // 16 rows of 128 at 1 x 8 rows a step: 2 steps an epoch, 3 epochs; the warm-up is 3% of 6
  // steps rounded up, 1.
  REQUIRE(run_ft(with_output("lora", {"--set", "data.seq_len=128"}), dir + "/lora.log") == 0);
  const std::string log = read_file(dir + "/lora.log");
  INFO(log);
  CHECK_THAT(log, Catch::Contains("6 steps (3 epochs of 16 sequences)") &&
                      Catch::Contains("LoRA adapters") && !Catch::Contains("warm-up"));
  const auto metrics = read_metrics(dir + "/lora");
  REQUIRE(metrics.size() == 6);
  CHECK(metrics[0]["lr"].get<double>() == Approx(2e-4));
  CHECK(exists(dir + "/lora/final/adapter_config.json"));
}

// A preset shape key set beside --model would be ignored (the shape is the model's config.json):
// refused naming the key, before anything is written.
TEST_CASE("a shape key set with --model is refused, not ignored", "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = std::string(FT_TEST_DIR) + "/model/fixtures/qwen3_headdim";
  const std::string data = write_ids(dir + "/ids.jsonl", 16, 90);
  CHECK(run_ft({"train", "--preset", "lora", "--model", model, "--data", data, "--output",
                dir + "/run", "--set", "model.hidden_size=64"},
               dir + "/train.log") == 2);
  CHECK_THAT(read_file(dir + "/train.log"),
             Catch::Contains("--set model.hidden_size: the model's shape comes from --model"));
  CHECK_FALSE(exists(dir + "/run"));
  // The model's own value says nothing new and is accepted (a command kept from a run without
  // --model still works).
  CHECK(run_ft({"plan", "--preset", "lora", "--model", model, "--set", "model.hidden_size=32",
                "--set", "model.tie_embeddings=false", "--set", "data.seq_len=32"},
               dir + "/plan.log") == 0);
  std::filesystem::remove_all(dir);
}

// Mixture-of-experts models trained by real `ft train` and `ft launch` processes on the tiny
// Mixtral and Qwen3-MoE of tests/model/fixtures/moe (issue 31): the aux loss is added as the
// settings say and changes the training, every step records each expert's picks (k per token,
// every position), the final model and the export hold transformers' per-expert tensors, and 2
// data-parallel ranks under ddp, zero3 and fsdp follow the 1-rank run.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
using nlohmann::json;

namespace {

std::string moe_fixture(const std::string& name) {
  return std::string(FT_TEST_DIR) + "/model/fixtures/moe/" + name;
}

// `n` pre-tokenized records of 6 to 20 ids below 96 (the fixtures' vocabulary).
std::string write_ids(const std::string& path, int n) {
  std::ofstream out(path);
  std::mt19937 gen(7);
  for (int i = 0; i < n; ++i) {
    json ids = json::array();
    const int len = 6 + static_cast<int>(gen() % 15);
    for (int t = 0; t < len; ++t) ids.push_back(4 + static_cast<int>(gen() % 92));
    out << json{{"input_ids", ids}}.dump() << "\n";
  }
  return path;
}

constexpr int kSeqLen = 32, kMicro = 2, kAccum = 2, kSteps = 4;

std::vector<std::string> moe_sets(const std::vector<std::string>& more) {
  return with(
      {"precision.mode=fp32", "data.seq_len=" + std::to_string(kSeqLen),
       "train.micro_batch=" + std::to_string(kMicro), "train.grad_accum=" + std::to_string(kAccum),
       "train.max_steps=" + std::to_string(kSteps), "train.lr=1e-2", "train.warmup_steps=1",
       "train.eps=1e-6", "train.log_every=100"},
      more);
}

// ft train on `model`; `data` "": the synthetic task (whose global batch splits over ranks row
// by row, so 2 ranks of 1 row see the rows 1 rank of 2 sees).
std::vector<std::string> moe_train(const std::string& model, const std::string& data,
                                   const std::string& out, const std::vector<std::string>& sets) {
  std::vector<std::string> args = {"--preset", "tiny-demo", "--model", model, "--output", out};
  if (!data.empty()) args.insert(args.end(), {"--data", data});
  return ft_train_argv(
      args, moe_sets(with(data.empty() ? std::vector<std::string>{}
                                       : std::vector<std::string>{"data.format=tokenized"},
                          sets)));
}

std::vector<json> train_ok(const std::vector<std::string>& argv, const std::string& out) {
  const Finished f = run_to_end(argv, {}, make_temp_dir() + "/train.txt", 240);
  INFO(f.output);
  REQUIRE(f.code == 0);
  return read_metrics(out);
}

std::set<std::string> tensor_names(const std::string& file) {
  std::set<std::string> names;
  for (const auto& n : ft::io::SafetensorsFile::open(file).names()) names.insert(n);
  return names;
}

}  // namespace

TEST_CASE("a MoE model trains with its aux loss and records every expert's tokens", "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string data = write_ids(dir + "/ids.jsonl", 64);
  const std::string model = moe_fixture("mixtral_tiny");  // output_router_logits: true
  const auto on = train_ok(moe_train(model, data, dir + "/on", {}), dir + "/on");
  const auto off =
      train_ok(moe_train(model, data, dir + "/off", {"moe.aux_loss=off"}), dir + "/off");
  REQUIRE(on.size() == static_cast<size_t>(kSteps));
  REQUIRE(off.size() == on.size());
  for (size_t i = 0; i < on.size(); ++i) {
    INFO("step " << i + 1);
    const json& moe = on[i]["moe"];
    // Between 1 (f and P are distributions over the experts) and E = 4 (one expert takes all).
    CHECK(moe["aux_loss"].get<double>() > 1.0);
    CHECK(moe["aux_loss"].get<double>() < 4.0);
    CHECK(off[i]["moe"]["aux_loss"].get<double>() == 0.0);
    REQUIRE(moe["layers"].size() == 2);
    REQUIRE(moe["expert_tokens"].size() == 2);
    for (const json& picks : moe["expert_tokens"]) {
      int64_t sum = 0;
      for (const json& n : picks) sum += n.get<int64_t>();
      CHECK(sum == 2 * kSeqLen * kMicro * kAccum);  // k = 2 picks for every position
    }
    const json& l0 = moe["layers"][0];
    CHECK(l0["layer"] == 0);
    CHECK(l0["imbalance"].get<double>() >= 1.0);
    CHECK(moe["expert_tokens"][0][l0["most"].get<int>()] == l0["max"]);
  }
  // The same first step (same weights, same batch); the aux gradient changes what follows.
  CHECK(on[0]["loss"] == off[0]["loss"]);
  CHECK(on.back()["loss"] != off.back()["loss"]);
  // final/ holds what transformers' save_pretrained writes: per-expert tensors under Mixtral's
  // block_sparse_moe, no fused ones; so does ft export, and ft eval loads it.
  const auto names = tensor_names(dir + "/on/final/model.safetensors");
  CHECK(names.count("model.layers.1.block_sparse_moe.experts.3.w2.weight") == 1);
  CHECK(names.count("model.layers.0.block_sparse_moe.gate.weight") == 1);
  CHECK(names.count("model.layers.0.mlp.experts.gate_up_proj") == 0);
  CHECK(names == tensor_names(model + "/model.safetensors"));
  REQUIRE(run_to_end({ft_bin(), "export", "--checkpoint", dir + "/on", "--output", dir + "/export"},
                     {}, dir + "/export.txt", 120)
              .code == 0);
  CHECK(tensor_names(dir + "/export/model.safetensors") == names);
  const Finished eval = run_to_end({ft_bin(), "eval", "--model", dir + "/export", "--data", data},
                                   {}, dir + "/eval.txt", 120);
  INFO(eval.output);
  CHECK(eval.code == 0);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a Qwen3-MoE model on 2 ranks follows the 1-rank run under ddp, zero3 and fsdp",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = moe_fixture("qwen3_moe_tiny");
  // The same global batch, 1 rank x 2 rows or 2 ranks x 1 row; f_e over both ranks' rows
  // (moe.aux_loss_scope=global), so each rank's aux loss averages to the 1-rank one.
  const std::vector<std::string> sets = {"moe.aux_loss_scope=global", "train.grad_accum=1"};
  const auto one = train_ok(moe_train(model, "", dir + "/one", sets), dir + "/one");
  REQUIRE(one.size() == static_cast<size_t>(kSteps));
  for (const std::string kind : {"ddp", "zero3", "fsdp"}) {
    INFO(kind);
    const std::string out = dir + "/" + kind;
    const std::string port = std::to_string(free_port());
    const Finished f = run_to_end(
        ft_launch_argv({"--nproc-per-node", "2", "--master-port", port},
                       moe_train(model, "", out,
                                 with(sets, {"strategy.kind=" + kind, "train.micro_batch=1"}))),
        {}, dir + "/" + kind + ".txt", 240);
    INFO(f.output);
    REQUIRE(f.code == 0);
    const auto two = read_metrics(out);
    REQUIRE(two.size() == one.size());
    for (size_t i = 0; i < one.size(); ++i) {
      INFO("step " << i + 1);
      const double a = one[i]["loss"].get<double>(), b = two[i]["loss"].get<double>();
      CHECK(std::abs(a - b) / a < 1e-5);
      const double x = one[i]["moe"]["aux_loss"].get<double>(),
                   y = two[i]["moe"]["aux_loss"].get<double>();
      CHECK(x > 1.0);
      CHECK(std::abs(x - y) / x < 1e-5);
      CHECK(two[i]["moe"]["expert_tokens"] == one[i]["moe"]["expert_tokens"]);
    }
  }
  std::filesystem::remove_all(dir);
}

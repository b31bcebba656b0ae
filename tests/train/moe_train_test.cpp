// Mixture-of-experts models trained by real `ft train` and `ft launch` processes on the tiny
// Mixtral and Qwen3-MoE of tests/model/fixtures/moe (issue 31): the aux loss is added as the
// settings say and changes the training, every step records each expert's picks (k per token,
// every position), the final model and the export hold transformers' per-expert tensors, and 2
// data-parallel ranks under ddp, zero3 and fsdp follow the 1-rank run. Expert parallelism
// (strategy.expert_parallel): EP 2 at world 2 and EP 2 x 2 replicas on 2 launcher nodes follow the
// 1-rank run, the final model holds every expert, checkpoints reshard between EP sizes, and a job
// killed with SIGKILL resumes bit for bit.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <signal.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
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

// `ft launch --nproc-per-node n` of moe_train (n > 1), run to the end.
std::vector<json> launch_ok(int n, const std::string& model, const std::string& out,
                            const std::vector<std::string>& sets,
                            const std::map<std::string, std::string>& env = {}) {
  const Finished f = run_to_end(ft_launch_argv({"--nproc-per-node", std::to_string(n),
                                                "--master-port", std::to_string(free_port())},
                                               moe_train(model, "", out, sets)),
                                env, make_temp_dir() + "/launch.txt", 240);
  INFO(output_tail(f.output));
  REQUIRE(f.code == 0);
  return read_metrics(out);
}

// Step by step: the same losses and aux losses within 1e-5 relative, the same expert picks.
void check_follows(const std::vector<json>& one, const std::vector<json>& got, size_t from = 0) {
  REQUIRE(got.size() == one.size());
  for (size_t i = from; i < one.size(); ++i) {
    INFO("step " << i + 1);
    const double a = one[i]["loss"].get<double>(), b = got[i]["loss"].get<double>();
    CHECK(std::abs(a - b) / a < 1e-5);
    const double x = one[i]["moe"]["aux_loss"].get<double>(),
                 y = got[i]["moe"]["aux_loss"].get<double>();
    CHECK(std::abs(x - y) / x < 1e-5);
    CHECK(got[i]["moe"]["expert_tokens"] == one[i]["moe"]["expert_tokens"]);
  }
}

// The largest difference of any tensor of two final models (or LoRA adapters: `file`), relative
// to the tensor's largest value; 1 when the names differ.
double final_models_apart(const std::string& a, const std::string& b,
                          const std::string& file = "model.safetensors") {
  auto fa = ft::io::SafetensorsFile::open(a + "/final/" + file);
  auto fb = ft::io::SafetensorsFile::open(b + "/final/" + file);
  if (fa.names() != fb.names()) return 1;
  double worst = 0;
  for (const auto& n : fa.names()) {
    const at::Tensor x = fa.tensor(n).to(at::kDouble), y = fb.tensor(n).to(at::kDouble);
    worst = std::max(
        worst, (x - y).abs().max().item<double>() / std::max(x.abs().max().item<double>(), 1e-30));
  }
  return worst;
}

// A copy of run `from` as if it had stopped after step `step`: its checkpoints past that step,
// the pointer to the newest and final/ removed.
std::string stopped_copy(const std::string& from, int step) {
  const std::string to = make_temp_dir() + "/run";
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
  std::filesystem::remove_all(to + "/final");
  std::filesystem::remove(to + "/checkpoints/latest");
  for (const auto& d : std::filesystem::directory_iterator(to + "/checkpoints")) {
    const std::string name = d.path().filename().string();
    if (name.rfind("step-", 0) == 0 && std::stoi(name.substr(5)) > step)
      std::filesystem::remove_all(d.path());
  }
  return to;
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

TEST_CASE("expert parallelism: EP 2 at world 2 follows the 1-rank run under ddp, zero3 and fsdp",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = moe_fixture("qwen3_moe_tiny");  // 8 experts: 4 on each EP rank
  const std::vector<std::string> sets = {"moe.aux_loss_scope=global", "train.grad_accum=1"};
  const auto one = train_ok(moe_train(model, "", dir + "/one", sets), dir + "/one");
  // 2 data-parallel ranks without EP: the same split of the batch, so the final weights differ
  // from the EP runs' only by the order sums are taken in.
  launch_ok(2, model, dir + "/dp", with(sets, {"train.micro_batch=1"}));
  for (const std::string kind : {"ddp", "zero3", "fsdp"}) {
    INFO(kind);
    const std::string out = dir + "/ep-" + kind;
    const auto ep = launch_ok(
        2, model, out,
        with(sets, {"strategy.kind=" + kind, "train.micro_batch=1", "strategy.expert_parallel=2"}));
    check_follows(one, ep);
    // The step breakdown carries the exchange: rows left the rank and came back, in time spent.
    for (const auto& r : ep) {
      CHECK(r["moe"]["exchange"]["bytes_sent"].get<int64_t>() > 0);
      CHECK(r["moe"]["exchange"]["bytes_received"].get<int64_t>() > 0);
      CHECK(r["moe"]["exchange"]["dispatch_s"].get<double>() > 0);
      CHECK(r["moe"]["exchange"]["combine_s"].get<double>() > 0);
      // The row-count exchange that starts each dispatch is a part of its time.
      CHECK(r["moe"]["exchange"]["counts_s"].get<double>() > 0);
      CHECK(r["moe"]["exchange"]["counts_s"].get<double>() <=
            r["moe"]["exchange"]["dispatch_s"].get<double>());
    }
    CHECK_FALSE(one.back()["moe"].contains("exchange"));
    // Every expert in final/, each in its place, whichever rank trained it.
    CHECK(final_models_apart(dir + "/dp", out) < 1e-4);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "LoRA on the experts and a trained router: EP 2 at world 2 follows the 1-rank run under ddp, "
    "zero3 and fsdp",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = moe_fixture("qwen3_moe_tiny");
  const std::vector<std::string> sets = {
      "moe.aux_loss_scope=global",
      "train.grad_accum=1",
      "lora.enabled=true",
      "lora.dropout=0",
      R"(lora.target_parameters=["mlp.experts.gate_up_proj","mlp.experts.down_proj"])",
      "lora.train_router=true"};
  const auto one = train_ok(moe_train(model, "", dir + "/one", sets), dir + "/one");
  launch_ok(2, model, dir + "/dp", with(sets, {"train.micro_batch=1"}));
  // The adapters hold every expert's factors; the run trains them and writes them for PEFT.
  auto adapter = ft::io::SafetensorsFile::open(dir + "/one/final/adapter_model.safetensors");
  CHECK(
      adapter.info("base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight").shape ==
      std::vector<int64_t>{8 * 16, 32});  // [E r, hidden]
  CHECK(adapter.info("base_model.model.model.layers.1.mlp.experts.lora_B.weight").shape ==
        std::vector<int64_t>{32, 16 * 8});  // [hidden, r E]
  // The router trained in full beside them (lora.train_router), under PEFT's modules_to_save name.
  const at::Tensor router = adapter.tensor("base_model.model.model.layers.1.mlp.gate.weight");
  const at::Tensor start = ft::io::SafetensorsFile::open(model + "/model.safetensors")
                               .tensor("model.layers.1.mlp.gate.weight");
  CHECK((router - start).abs().max().item<double>() > 1e-4);
  CHECK_THAT(read_file(dir + "/one/final/adapter_config.json"), Catch::Contains(R"("gate")"));
  for (const std::string kind : {"ddp", "zero3", "fsdp"}) {
    INFO(kind);
    const std::string out = dir + "/ep-" + kind;
    check_follows(one, launch_ok(2, model, out,
                                 with(sets, {"strategy.kind=" + kind, "train.micro_batch=1",
                                             "strategy.expert_parallel=2"})));
    // Against 2 data-parallel ranks without EP (the same split of the batch): 1.4e-4 measured.
    // Adam magnifies the order of sums in the adapters' tiny first gradients: those 2 ranks are
    // 2.8e-4 from 1 rank.
    CHECK(final_models_apart(dir + "/dp", out, "adapter_model.safetensors") < 1e-3);
  }
  std::filesystem::remove_all(dir);
}

// moe.grouped_mm=on: every MoE layer's experts as LibTorch's grouped GEMM (on the CPU one at::mm
// per expert, each over both threads, where the default splits the experts between the threads):
// at 1 rank, under EP 2 at world 2 with zero3 (the experts views of the flat buffer), and with
// LoRA on the experts under fsdp, the run follows the default one.
TEST_CASE(
    "moe.grouped_mm=on: the grouped GEMM's runs follow the per-expert ones, with EP 2 and LoRA",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = moe_fixture("qwen3_moe_tiny");
  const std::vector<std::string> sets = {"moe.aux_loss_scope=global", "train.grad_accum=1"};
  const std::vector<std::string> grouped = with(sets, {"moe.grouped_mm=on"});
  const auto one = train_ok(moe_train(model, "", dir + "/one", sets), dir + "/one");
  check_follows(one, train_ok(moe_train(model, "", dir + "/one-g", grouped), dir + "/one-g"));
  // The order of sums in the products only (6.4e-5 measured, as Adam magnifies it).
  CHECK(final_models_apart(dir + "/one", dir + "/one-g") < 1e-4);
  check_follows(one, launch_ok(2, model, dir + "/ep-g",
                               with(grouped, {"strategy.kind=zero3", "train.micro_batch=1",
                                              "strategy.expert_parallel=2"})));
  const std::vector<std::string> lora = {
      "lora.enabled=true", "lora.dropout=0",
      R"(lora.target_parameters=["mlp.experts.gate_up_proj","mlp.experts.down_proj"])"};
  const std::vector<std::string> ep_fsdp = {"strategy.kind=fsdp", "train.micro_batch=1",
                                            "strategy.expert_parallel=2"};
  const auto lora_ep = launch_ok(2, model, dir + "/lora", with(with(sets, lora), ep_fsdp));
  check_follows(lora_ep, launch_ok(2, model, dir + "/lora-g", with(with(grouped, lora), ep_fsdp)));
  CHECK(final_models_apart(dir + "/lora", dir + "/lora-g", "adapter_model.safetensors") <
        1e-4);  // 1e-5
  std::filesystem::remove_all(dir);
}

// What works for dense models works under expert parallelism: gradient accumulation (the
// defaults: 2 micro-batches), full activation checkpointing (a recomputed MoE layer exchanges its
// rows again, on every rank alike), bf16 and offload (with clipping off too: the update during the
// backward).
TEST_CASE(
    "expert parallelism with gradient accumulation, activation checkpointing, bf16 and offload",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = moe_fixture("qwen3_moe_tiny");
  const std::vector<std::string> sets = {"moe.aux_loss_scope=global",
                                         "train.activation_checkpointing=full"};
  const std::vector<std::string> ep2 = {"train.micro_batch=1", "strategy.expert_parallel=2",
                                        "strategy.kind=zero3"};
  const auto one = train_ok(moe_train(model, "", dir + "/one", sets), dir + "/one");
  launch_ok(2, model, dir + "/dp", with(sets, {"train.micro_batch=1"}));
  check_follows(one, launch_ok(2, model, dir + "/ep", with(sets, ep2)));
  CHECK(final_models_apart(dir + "/dp", dir + "/ep") < 1e-4);
  // Offloaded optimizer state (the CPU path, as the offload tests run it): the same bits. zero3's
  // persistent small weights are replicated 2-D groups: the plain run adds a later micro-batch's
  // gradient into their accumulators by one addmm (a gradient sink), and so must the offloaded
  // one, or the two round differently (they did, in the expert layer's router and attention).
  launch_ok(2, model, dir + "/ep-offload",
            with(with(sets, ep2), {"strategy.zero3.offload_optimizer=true"}),
            {{"FT_ALLOW_CPU_OFFLOAD", "1"}});
  CHECK(read_file(dir + "/ep/final/model.safetensors") ==
        read_file(dir + "/ep-offload/final/model.safetensors"));
  // Clipping off: the offloaded update begins during the backward, experts included (each
  // master as its gradient becomes final): the same bits again.
  const std::vector<std::string> noclip = with(with(sets, ep2), {"train.grad_clip=0"});
  launch_ok(2, model, dir + "/ep-noclip", noclip);
  const auto eager = launch_ok(2, model, dir + "/ep-noclip-offload",
                               with(noclip, {"strategy.zero3.offload_optimizer=true"}),
                               {{"FT_ALLOW_CPU_OFFLOAD", "1"}});
  CHECK(read_file(dir + "/ep-noclip/final/model.safetensors") ==
        read_file(dir + "/ep-noclip-offload/final/model.safetensors"));
  REQUIRE(eager.size() >= 2);
  CHECK(eager.back()["time"]["overlapped_update"]["during_backward"] == true);
  // bf16 compute: EP 2 against the same split without EP, within bf16's rounding.
  const std::vector<std::string> bf16 = with(sets, {"precision.mode=bf16"});
  const auto dp16 = launch_ok(2, model, dir + "/dp16",
                              with(bf16, {"train.micro_batch=1", "strategy.kind=zero3"}));
  const auto ep16 = launch_ok(2, model, dir + "/ep16", with(bf16, ep2));
  REQUIRE(ep16.size() == dp16.size());
  for (size_t i = 0; i < ep16.size(); ++i) {
    INFO("bf16 step " << i + 1);
    const double a = dp16[i]["loss"].get<double>(), b = ep16[i]["loss"].get<double>();
    CHECK(std::abs(a - b) / a < 1e-2);
  }
  CHECK(final_models_apart(dir + "/dp16", dir + "/ep16") < 1e-1);
  std::filesystem::remove_all(dir);
}

// Two launchers on loopback, as two machines run them: each node's 2 ranks form an EP group, the
// two copies of an expert are on different nodes. zero3 keeps the fixture's small experts whole
// (under its persistence threshold); fsdp HYBRID_SHARD splits the other parameters inside each
// node and the experts over their two holders, across the nodes.
TEST_CASE(
    "expert parallelism: 2 ft launch nodes x 2 workers, EP 2 inside each node, follow the "
    "1-rank run under zero3 and HYBRID_SHARD",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = moe_fixture("mixtral_tiny");
  const std::vector<std::string> sets = {"moe.aux_loss_scope=global", "train.grad_accum=1"};
  const auto one = train_ok(moe_train(model, "", dir + "/one", with(sets, {"train.micro_batch=4"})),
                            dir + "/one");
  launch_ok(4, model, dir + "/dp", with(sets, {"train.micro_batch=1"}));
  for (const auto& kind : std::vector<std::vector<std::string>>{
           {"strategy.kind=zero3"},
           {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=HYBRID_SHARD"}}) {
    INFO(kind.back());
    const std::string out = dir + "/ep-" + kind.back().substr(kind.back().find('=') + 1);
    const std::string port = std::to_string(free_port());
    std::vector<Child> nodes;
    for (int node = 0; node < 2; ++node)
      nodes.push_back(start(
          ft_launch_argv(
              {"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", port, "--max-restarts", "0"},
              moe_train(
                  model, "", out,
                  with(with(sets, {"train.micro_batch=1", "strategy.expert_parallel=2"}), kind))),
          {}, out + "-node" + std::to_string(node) + ".txt"));
    std::string output;
    bool ok = true;
    for (auto& c : nodes) {
      const auto rc = wait_for(c, 120);
      if (!rc) kill_and_reap(c);
      output += c.output();
      ok = ok && rc.value_or(-1) == 0;
    }
    INFO(output_tail(output));
    REQUIRE(ok);
    CHECK_THAT(output, !Catch::Contains("spans nodes"));
    check_follows(one, read_metrics(out));
    // Each expert's gradient was reduced over the two ranks holding it (expert_dp): a replica
    // that skipped it would have drifted from the other, and rank 0 writes its own.
    CHECK(final_models_apart(dir + "/dp", out) < 1e-4);
  }
  std::filesystem::remove_all(dir);
}

// EP 2 x 2 replicas at world 4 under ddp, zero3 and fsdp (zero3 also runs across two launchers
// above); under zero3 (no persistence threshold) and fsdp each layer's experts are split over the
// 2 ranks holding them and gathered with their layer. A checkpoint of the fsdp job continued at
// world 2 without expert parallelism, whose checkpoint EP 2 at world 4 (zero3, split) continues.
TEST_CASE(
    "expert parallelism: EP 2 x 2 replicas at world 4 under ddp, zero3 and fsdp, experts split "
    "over their holders, resharded to world 2 without EP and back",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = moe_fixture("mixtral_tiny");  // 4 experts: 2 on each EP rank
  const std::vector<std::string> sets = {"moe.aux_loss_scope=global", "train.grad_accum=1",
                                         "train.max_steps=6",         "output.save_every=2",
                                         "output.keep_last=10",       "train.micro_batch=4"};
  const auto one = train_ok(moe_train(model, "", dir + "/one", sets), dir + "/one");
  int64_t parameters = 0;
  {
    auto f = ft::io::SafetensorsFile::open(model + "/model.safetensors");
    for (const auto& n : f.names()) parameters += f.tensor(n).numel();
  }
  const std::vector<std::string> world4 = {"train.micro_batch=1", "strategy.expert_parallel=2"};
  const std::vector<std::string> zero3_split = {"strategy.kind=zero3",
                                                "strategy.zero3.param_persistence_threshold=0"};
  for (const auto& kind : std::vector<std::vector<std::string>>{
           {"strategy.kind=ddp"}, zero3_split, {"strategy.kind=fsdp"}}) {
    INFO(kind.front());
    const auto m =
        launch_ok(4, model, dir + "/ep-" + kind.front().substr(14), with(with(sets, world4), kind));
    check_follows(one, m);
    // Split experts: rank 0 holds a quarter of every parameter (fp32), the experts included, but
    // for the groups' padding; whole, it would hold half the experts.
    const int64_t held = m.back()["memory"]["param_bytes"].get<int64_t>();
    if (kind.front() != "strategy.kind=ddp") CHECK(held <= (parameters / 4 + 16) * 4);
  }
  // Saved by EP 2 at world 4 at step 2, continued by 2 ranks without EP (zero3) ...
  const std::string a = stopped_copy(dir + "/ep-fsdp", 2);
  check_follows(
      one, launch_ok(2, model, a, with(sets, {"train.micro_batch=2", "strategy.kind=zero3"})), 2);
  // ... whose step-4 checkpoint EP 2 at world 4 continues, its experts split.
  const std::string b = stopped_copy(a, 4);
  check_follows(one, launch_ok(4, model, b, with(with(sets, world4), zero3_split)), 4);
  std::filesystem::remove_all(dir);
}

// Split experts with what dense models have: at world 4 with EP 2 under zero3 without a
// persistence threshold each layer's experts are split over the 2 ranks holding them. Gradient
// accumulation (2 micro-batches) with full activation checkpointing (a recomputed layer gathers
// its experts again) follows the 1-rank run, offloaded state gives the same bits (with clipping
// off too: the update during the backward), and LoRA on the
// experts (the frozen experts split, the adapters whole on every rank) follows 1 rank too.
TEST_CASE(
    "split experts at world 4 with accumulation, activation checkpointing, offload and LoRA on "
    "the experts",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = moe_fixture("qwen3_moe_tiny");
  const std::vector<std::string> sets = {"moe.aux_loss_scope=global",
                                         "train.activation_checkpointing=full"};
  const std::vector<std::string> split = {"train.micro_batch=1", "strategy.expert_parallel=2",
                                          "strategy.kind=zero3",
                                          "strategy.zero3.param_persistence_threshold=0"};
  const auto one = train_ok(moe_train(model, "", dir + "/one", with(sets, {"train.micro_batch=4"})),
                            dir + "/one");
  check_follows(one, launch_ok(4, model, dir + "/ep", with(sets, split)));
  launch_ok(4, model, dir + "/ep-offload",
            with(with(sets, split),
                 {"strategy.zero3.offload_optimizer=true", "strategy.zero3.offload_param=true"}),
            {{"FT_ALLOW_CPU_OFFLOAD", "1"}});
  CHECK(read_file(dir + "/ep/final/model.safetensors") ==
        read_file(dir + "/ep-offload/final/model.safetensors"));
  // Clipping off, the update during the backward (split experts: final after their
  // reduce-scatter; the replicated ones after their all-reduce): the same bits.
  const std::vector<std::string> noclip = with(with(sets, split), {"train.grad_clip=0"});
  launch_ok(4, model, dir + "/ep-noclip", noclip);
  launch_ok(4, model, dir + "/ep-noclip-offload",
            with(noclip, {"strategy.zero3.offload_optimizer=true"}),
            {{"FT_ALLOW_CPU_OFFLOAD", "1"}});
  CHECK(read_file(dir + "/ep-noclip/final/model.safetensors") ==
        read_file(dir + "/ep-noclip-offload/final/model.safetensors"));
  const std::vector<std::string> lora = with(
      sets, {"lora.enabled=true", "lora.dropout=0", "train.lr=3e-3", "lora.train_router=true",
             R"(lora.target_parameters=["mlp.experts.gate_up_proj","mlp.experts.down_proj"])"});
  const auto one_lora =
      train_ok(moe_train(model, "", dir + "/one-lora", with(lora, {"train.micro_batch=4"})),
               dir + "/one-lora");
  check_follows(one_lora, launch_ok(4, model, dir + "/ep-lora", with(lora, split)));
  CHECK(final_models_apart(dir + "/one-lora", dir + "/ep-lora", "adapter_model.safetensors") <
        1e-3);
  // SIGKILL of the launcher after a random step, the same command again: the same bytes as the
  // uninterrupted job (each split expert's shards saved by the rank holding them, read back by it).
  std::mt19937 gen(std::random_device{}());
  const size_t kill_after = 1 + gen() % 2;
  INFO("SIGKILL after " << kill_after << " steps");
  const std::string k = dir + "/killed";
  const auto argv =
      ft_launch_argv({"--nproc-per-node", "4", "--master-port", std::to_string(free_port())},
                     moe_train(model, "", k, with(with(sets, split), {"output.save_every=1"})));
  Child c = start(argv, {}, dir + "/k.txt");
  wait_for_steps(k, kill_after, std::chrono::steady_clock::now() + std::chrono::seconds(120));
  ::kill(c.pid, SIGKILL);
  REQUIRE(wait_for(c, 30).value_or(-1) == 128 + SIGKILL);
  // (A checkpoint still being written when the launcher died is not one: then it starts over.)
  const bool saved = std::filesystem::exists(k + "/checkpoints/latest");
  const Finished again = run_to_end(argv, {}, dir + "/again.txt", 240);
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  if (saved) CHECK_THAT(again.output, Catch::Contains("resuming from"));
  CHECK(read_file(dir + "/ep/final/model.safetensors") ==
        read_file(k + "/final/model.safetensors"));
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "expert parallelism: checkpoints reshard EP 2 -> 1 rank -> EP 2, and SIGKILL resumes "
    "bit for bit",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string model = moe_fixture("qwen3_moe_tiny");
  const std::vector<std::string> sets = {"moe.aux_loss_scope=global", "train.grad_accum=1",
                                         "train.max_steps=6", "output.save_every=2",
                                         "output.keep_last=10"};
  const std::vector<std::string> ep2 = {"train.micro_batch=1", "strategy.expert_parallel=2",
                                        "strategy.kind=zero3"};
  const auto one = train_ok(moe_train(model, "", dir + "/one", sets), dir + "/one");
  launch_ok(2, model, dir + "/ep", with(sets, ep2));
  // Saved by EP 2 at step 2, continued by 1 rank (every expert on it) ...
  const std::string a = stopped_copy(dir + "/ep", 2);
  const Finished ra = run_to_end(moe_train(model, "", a, sets), {}, dir + "/a.txt", 240);
  INFO(output_tail(ra.output));
  REQUIRE(ra.code == 0);
  CHECK_THAT(ra.output, Catch::Contains("resuming from") && Catch::Contains("(step 2, saved by 2"));
  check_follows(one, read_metrics(a), 2);
  // ... whose step-4 checkpoint EP 2 (fsdp) continues.
  const std::string b = stopped_copy(a, 4);
  const auto rb = launch_ok(
      2, model, b,
      with(sets, {"train.micro_batch=1", "strategy.expert_parallel=2", "strategy.kind=fsdp"}));
  check_follows(one, rb, 4);
  // SIGKILL of the launcher after a random step, the same command again: the same bytes.
  std::mt19937 gen(std::random_device{}());
  const size_t kill_after = 2 + gen() % 3;
  INFO("SIGKILL after " << kill_after << " steps");
  const std::string k = dir + "/killed";
  const std::string port = std::to_string(free_port());
  const auto argv = ft_launch_argv({"--nproc-per-node", "2", "--master-port", port},
                                   moe_train(model, "", k, with(sets, ep2)));
  Child c = start(argv, {}, dir + "/k.txt");
  wait_for_steps(k, kill_after, std::chrono::steady_clock::now() + std::chrono::seconds(120));
  ::kill(c.pid, SIGKILL);
  REQUIRE(wait_for(c, 30).value_or(-1) == 128 + SIGKILL);
  const Finished again = run_to_end(argv, {}, dir + "/again.txt", 240);
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  CHECK(read_file(dir + "/ep/final/model.safetensors") ==
        read_file(k + "/final/model.safetensors"));
  const auto ref = read_metrics(dir + "/ep"), got = read_metrics(k);
  REQUIRE(got.size() == ref.size());
  for (size_t i = 0; i < ref.size(); ++i) CHECK(got[i]["loss"] == ref[i]["loss"]);
  std::filesystem::remove_all(dir);
}

TEST_CASE("strategy.expert_parallel and moe.grouped_mm are refused by key where they cannot apply",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  // Not dividing the world, the experts, or a dense model: exit 2 and a message naming the key.
  struct Bad {
    std::string model;
    int n;
    std::string set, says;
  };
  for (const Bad& b : std::vector<Bad>{
           {moe_fixture("qwen3_moe_tiny"), 2, "strategy.expert_parallel=3",
            "must divide the world size"},
           {moe_fixture("qwen3_moe_tiny"), 1, "strategy.expert_parallel=3",
            "must divide the world size"},
           {"", 2, "strategy.expert_parallel=2", "has no mixture-of-experts layers"}}) {
    INFO(b.set << " on " << (b.model.empty() ? "tiny-demo" : b.model));
    std::vector<std::string> train =
        b.model.empty() ? ft_train_argv({"--preset", "tiny-demo", "--output", dir + "/out"},
                                        {b.set, "train.max_steps=1"})
                        : moe_train(b.model, "", dir + "/out", {b.set});
    const Finished f = run_to_end(
        b.n == 1 ? train
                 : ft_launch_argv({"--nproc-per-node", std::to_string(b.n), "--master-port",
                                   std::to_string(free_port()), "--max-restarts", "0"},
                                  train),
        {}, dir + "/bad.txt", 120);
    CHECK(f.code != 0);
    CHECK_THAT(f.output, Catch::Contains("strategy.expert_parallel=") && Catch::Contains(b.says));
    CHECK_THAT(f.output, !Catch::Contains("terminate called"));
    std::filesystem::remove_all(dir + "/out");
  }
  // moe.grouped_mm=on where LibTorch's grouped GEMM cannot run: refused before the run starts (no
  // output folder), saying why and what to set.
  const Finished f = run_to_end(moe_train(moe_fixture("qwen3_moe_tiny"), "", dir + "/out",
                                          {"moe.grouped_mm=on", "precision.mode=fp64"}),
                                {}, dir + "/bad.txt", 120);
  CHECK(f.code != 0);
  CHECK_THAT(f.output, Catch::Contains("moe.grouped_mm=on: LibTorch's grouped GEMM") &&
                           Catch::Contains("fp32, bf16 or fp16") &&
                           Catch::Contains("set moe.grouped_mm=auto"));
  CHECK_FALSE(std::filesystem::exists(dir + "/out"));
  std::filesystem::remove_all(dir);
}

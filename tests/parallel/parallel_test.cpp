// The distributed strategies end to end: real `ft launch` jobs of `ft train` workers on loopback
// (Gloo), compared with the world-size-1 run of the same preset, data and seed at the same global
// batch; the runtime's own memory and communication accounting read back from
// metrics.rank<k>.jsonl.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <ATen/CPUGeneratorImpl.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "support/numerics.h"
#include "support/runs.h"
#include "support/subprocess.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace ft::test;

namespace {

// The job tests' small model (runs.h: 2 layers, hidden 64, and why Adam's eps is 1e-6), 20 steps.
const std::vector<std::string> kBase = with(small_run_sets(), {"train.max_steps=20"});

struct Job {
  std::string dir;  // the run's --output
  int code = -1;
  std::string output;
};

// `ft launch LAUNCH_ARGS -- ft train --preset tiny-demo --output DIR` with the base settings, then
// `sets`. With a `model` directory, `--model MODEL` and the base settings but tiny-demo's model
// shape (config.json gives it).
std::vector<std::string> train_argv(const std::vector<std::string>& launch_args,
                                    const std::string& dir, const std::vector<std::string>& sets,
                                    const std::string& model = "") {
  std::vector<std::string> args = {"--preset", "tiny-demo", "--output", dir}, base;
  if (!model.empty()) args.insert(args.end(), {"--model", model});
  for (const auto& b : kBase)
    if (model.empty() || b.rfind("model.", 0) != 0) base.push_back(b);
  return ft_launch_argv(launch_args, ft_train_argv(args, with(base, sets)));
}

// `ft launch --nproc-per-node N -- ft train --preset tiny-demo --set ... --output DIR` (and
// `--model MODEL` when given).
Job run_job(int nproc, const std::vector<std::string>& sets,
            const std::map<std::string, std::string>& env = {}, const std::string& model = "") {
  Job j;
  j.dir = make_temp_dir() + "/run";
  const Finished f = run_to_end(train_argv({"--nproc-per-node", std::to_string(nproc),
                                            "--master-port", std::to_string(free_port())},
                                           j.dir, sets, model),
                                env, make_temp_dir() + "/out.txt", 150);
  j.code = f.code;
  j.output = f.output;
  return j;
}

// A job that must have succeeded; when it did not, the end of its output (the launcher's summary
// of the failure) is in the message.
void require_ok(const Job& j) {
  INFO(output_tail(j.output));
  REQUIRE(j.code == 0);
}

// Loss trajectories within `tol` relative, step by step, and every saved tensor within `tol`
// (relative to the tensor's largest value).
void check_same_run(const Job& ref, const Job& got, const std::string& weights_file,
                    double tol = 1e-5) {
  INFO(output_tail(got.output));
  require_ok(ref);
  require_ok(got);
  auto a = read_metrics(ref.dir), b = read_metrics(got.dir);
  REQUIRE(a.size() == 20);
  REQUIRE(b.size() == a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(b[i]["tokens"] == a[i]["tokens"]);
    const double la = a[i]["loss"], lb = b[i]["loss"];
    CHECK(std::abs(la - lb) / la <= tol);
  }
  auto fa = ft::io::SafetensorsFile::open(ref.dir + "/final/" + weights_file);
  auto fb = ft::io::SafetensorsFile::open(got.dir + "/final/" + weights_file);
  REQUIRE(fa.names() == fb.names());
  for (const auto& n : fa.names()) {
    INFO(n);
    CHECK(rel_error(fb.tensor(n), fa.tensor(n)) <= tol);
  }
  // Training moved the weights at all (so the comparison means something).
  CHECK(a.back()["loss"].get<double>() < a.front()["loss"].get<double>() - 0.1);
}

json last_rank_record(const Job& j, int rank) {
  auto v = read_jsonl(j.dir + "/metrics.rank" + std::to_string(rank) + ".jsonl");
  REQUIRE(!v.empty());
  return v.back();
}

}  // namespace

TEST_CASE("every strategy on 2 ranks follows the 1-rank run (fp32, same global batch)",
          "[multiproc]") {
  Job ref = run_job(1, {"train.micro_batch=8"});
  const std::vector<std::vector<std::string>> variants = {
      {"strategy.kind=ddp"},
      {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
      // Norms and attention projections stay whole, MLP projections are split.
      {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=5000",
       "strategy.zero3.prefetch_bucket_size=10000", "strategy.zero3.reduce_bucket_size=20000"},
      {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"},
      {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP",
       "strategy.fsdp.forward_prefetch=true", "strategy.fsdp.backward_prefetch=BACKWARD_POST"},
      {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=NO_SHARD"},
      // Recomputing a layer in backward needs it gathered again, from the same hooks.
      {"strategy.kind=fsdp", "train.activation_checkpointing=full"},
      {"strategy.kind=zero3", "train.activation_checkpointing=every_n",
       "strategy.zero3.param_persistence_threshold=0"},
      // Waiting for every collective as soon as it is issued changes timing only.
      {"strategy.kind=ddp", "strategy.overlap_comm=false"},
      {"strategy.kind=zero3", "strategy.overlap_comm=false",
       "strategy.zero3.param_persistence_threshold=5000"},
      {"strategy.kind=fsdp", "strategy.overlap_comm=false", "strategy.fsdp.forward_prefetch=true"}};
  for (const auto& v : variants) {
    DYNAMIC_SECTION(v[0] << " " << (v.size() > 1 ? v[1] : "")) {
      check_same_run(ref, run_job(2, with(v, {"train.micro_batch=4"})), "model.safetensors");
    }
  }
}

// The whole path of a model directory of another family: each rank reads its shards of the
// family's tensors from the files (Qwen3's q_norm/k_norm; Gemma 3's sandwich norms and tied head),
// trains, and the final model is written back under the same names. The fixtures of
// tests/model/fixtures (FAMILIES.md); 64 tokens per row, past Gemma 3's window of 5. (Every
// strategy at 2 and 3 ranks on these models: engine_inproc_test.cpp.)
TEST_CASE("Qwen3 and Gemma 3 model directories: zero3, fsdp and ddp follow the 1-rank run",
          "[multiproc]") {
  for (const char* family : {"qwen3_headdim", "gemma3_local_global"}) {
    const std::string model = std::string(FT_TEST_DIR) + "/model/fixtures/" + family;
    Job ref = run_job(1, {"train.micro_batch=6"}, {}, model);
    for (const auto& [nproc, v] : std::vector<std::pair<int, std::vector<std::string>>>{
             {2, {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=1500"}},
             {3, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}},
             {3, {"strategy.kind=ddp"}}}) {
      INFO(family << ", " << nproc << " ranks: " << v[0]);
      const std::string micro = "train.micro_batch=" + std::to_string(6 / nproc);
      check_same_run(ref, run_job(nproc, with(v, {micro}), {}, model), "model.safetensors");
    }
  }
}

TEST_CASE("in fp64 the sharded strategies equal the 1-rank run to rounding", "[multiproc]") {
  // Same algebra, different summation order only: fp64 leaves nothing but 1e-12-level rounding.
  Job ref = run_job(1, {"train.micro_batch=8", "precision.mode=fp64"});
  for (const auto& v : std::vector<std::vector<std::string>>{
           {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=5000"},
           {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}}) {
    INFO(v[0]);
    check_same_run(ref, run_job(2, with(v, {"train.micro_batch=4", "precision.mode=fp64"})),
                   "model.safetensors", 1e-9);
  }
}

TEST_CASE("every strategy on 4 ranks, and with accumulation, follows the 1-rank run",
          "[multiproc]") {
  Job ref = run_job(1, {"train.micro_batch=8"});
  SECTION("4 ranks") {
    for (const auto& v : std::vector<std::vector<std::string>>{
             {"strategy.kind=ddp"},
             {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=5000"},
             {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"},
             {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP"}}) {
      INFO(v[0]);
      check_same_run(ref, run_job(4, with(v, {"train.micro_batch=2"})), "model.safetensors");
    }
  }
  SECTION("2 ranks x 2 micro-batches of 2") {
    for (const auto& v : std::vector<std::vector<std::string>>{
             {"strategy.kind=ddp"},
             {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
             {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}}) {
      INFO(v[0]);
      check_same_run(ref, run_job(2, with(v, {"train.micro_batch=2", "train.grad_accum=2"})),
                     "model.safetensors");
    }
  }
}

TEST_CASE("LoRA under every strategy follows the 1-rank run", "[multiproc]") {
  const std::vector<std::string> lora = {"lora.enabled=true", "lora.r=4", "lora.alpha=8",
                                         "lora.dropout=0", "train.lr=3e-3"};
  Job ref = run_job(1, with(lora, {"train.micro_batch=8"}));
  for (const auto& v : std::vector<std::vector<std::string>>{
           {"strategy.kind=ddp"},
           {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
           {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}}) {
    INFO(v[0]);
    check_same_run(ref, run_job(2, with(with(lora, v), {"train.micro_batch=4"})),
                   "adapter_model.safetensors");
  }
}

// QLoRA (issue 33): the fp32 fixture quantized to NF4 as it is read (each rank quantizes the
// blocks of its shards only), its packed weights sharded under zero3 (no persistence threshold)
// and fsdp, replicated under ddp.
TEST_CASE("QLoRA on an NF4 base: zero3 and fsdp at 2 and 3 ranks, and ddp, follow the 1-rank run",
          "[multiproc]") {
  const std::string model = std::string(FT_TEST_DIR) + "/model/fixtures/qlora/llama_base";
  const std::vector<std::string> qlora = {
      "lora.enabled=true",       "lora.r=4",       "lora.alpha=8",
      "lora.dropout=0",          "train.lr=3e-3",  "lora.quantize_base=nf4",
      "lora.double_quant=false", "data.seq_len=32"};
  Job ref = run_job(1, with(qlora, {"train.micro_batch=6"}), {}, model);
  CHECK_THAT(ref.output, Catch::Contains("on the base quantized to NF4"));
  for (const auto& [nproc, v] : std::vector<std::pair<int, std::vector<std::string>>>{
           {2, {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"}},
           {3, {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"}},
           {2, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}},
           {3, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}},
           {2, {"strategy.kind=ddp"}}}) {
    INFO(nproc << " ranks: " << v[0]);
    const std::string micro = "train.micro_batch=" + std::to_string(6 / nproc);
    check_same_run(ref, run_job(nproc, with(with(qlora, v), {micro}), {}, model),
                   "adapter_model.safetensors");
  }
}

TEST_CASE("on 4 ranks zero3 and FULL_SHARD hold a quarter of ddp's state plus one unit",
          "[multiproc]") {
  const std::vector<std::string> small = {"train.max_steps=2", "train.micro_batch=2"};
  Job ddp = run_job(4, with(small, {"strategy.kind=ddp"}));
  require_ok(ddp);
  // Parameters of the run's model: tied 320x64 embedding, 2 layers, final norm.
  const int64_t h = 64, inter = 176, kv = 32;  // 4 heads of 16, 2 of them for keys/values
  const int64_t layer = 2 * h + h * h * 2 + h * kv * 2 + 3 * h * inter;
  const int64_t n = 320 * h + 2 * layer + h;
  json d = last_rank_record(ddp, 0)["memory"];
  // ddp: every rank holds everything: fp32 weights, fp32 gradients, two fp32 Adam moments.
  CHECK(d["param_bytes"] == 4 * n);
  CHECK(d["grad_bytes"] == 4 * n);
  CHECK(d["optimizer_bytes"].get<int64_t>() >= 8 * n);
  CHECK(d["optimizer_bytes"].get<int64_t>() <= 8 * n + 64);  // + the step counters
  const int64_t ddp_total = d["param_bytes"].get<int64_t>() + d["grad_bytes"].get<int64_t>() +
                            d["optimizer_bytes"].get<int64_t>();
  for (const auto& v : std::vector<std::vector<std::string>>{
           {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
           {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}}) {
    INFO(v[0]);
    Job j = run_job(4, with(small, v));
    INFO(output_tail(j.output));
    require_ok(j);
    for (int r = 0; r < 4; ++r) {
      json m = last_rank_record(j, r)["memory"];
      const int64_t total = m["param_bytes"].get<int64_t>() + m["grad_bytes"].get<int64_t>() +
                            m["optimizer_bytes"].get<int64_t>();
      const int64_t unit = m["largest_unit_bytes"];
      INFO("rank " << r << ": " << total << " bytes, ddp " << ddp_total << ", unit " << unit);
      // The largest unit is a layer (bigger than the root's embedding + norm here), each of its
      // two flat tensors padded to a multiple of 4.
      REQUIRE(layer > 320 * h + h);
      CHECK(unit >= 4 * layer);
      CHECK(unit <= 4 * (layer + 8));
      CHECK(total <= ddp_total / 4 + unit);
      // And the shards really are a quarter (padding aside).
      CHECK(m["param_bytes"].get<int64_t>() <= 4 * (n / 4 + 16));
    }
  }
}

// Offload on CPU: host and device are the same memory, so nothing is saved, but the code path is
// the GPU one (separate host copies, reductions landing in host accumulators, the optimizer over
// host masters, copies back after the update); FT_ALLOW_CPU_OFFLOAD=1 lets a test run it. The
// results must be exactly those without offload, and the accounting must put every offloaded
// byte on the host.
TEST_CASE("offload: the same run bit for bit, and the state accounted in host memory",
          "[multiproc]") {
  const std::map<std::string, std::string> allow = {{"FT_ALLOW_CPU_OFFLOAD", "1"}};
  const std::vector<std::string> base = {"train.max_steps=3", "train.micro_batch=2",
                                         "train.grad_accum=2"};
  auto bytes = [](const json& m, const char* k) { return m[k].get<int64_t>(); };
  auto same_weights = [](const Job& a, const Job& b) {
    auto fa = ft::io::SafetensorsFile::open(a.dir + "/final/model.safetensors");
    auto fb = ft::io::SafetensorsFile::open(b.dir + "/final/model.safetensors");
    REQUIRE(fa.names() == fb.names());
    for (const auto& n : fa.names()) {
      INFO(n);
      CHECK(at::equal(fa.tensor(n), fb.tensor(n)));
    }
  };
  auto same_losses = [](const Job& a, const Job& b) {
    auto ma = read_metrics(a.dir), mb = read_metrics(b.dir);
    REQUIRE(ma.size() == 3);
    REQUIRE(mb.size() == ma.size());
    for (size_t i = 0; i < ma.size(); ++i) CHECK(ma[i]["loss"] == mb[i]["loss"]);
  };
  struct Variant {
    std::vector<std::string> plain, offload;
    bool params, optimizer;
  };
  for (const auto& v : std::vector<Variant>{
           // Everything sharded (no persistent parameters): all state on the host.
           {{"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
            {"strategy.zero3.offload_optimizer=true", "strategy.zero3.offload_param=true"},
            true,
            true},
           // Optimizer only, in bf16 with persistent small parameters (replicated groups too):
           // bf16 shards on the device, fp32 masters, gradients and moments on the host.
           {{"strategy.kind=zero3", "precision.mode=bf16",
             "strategy.zero3.param_persistence_threshold=5000"},
            {"strategy.zero3.offload_optimizer=true"},
            false,
            true},
           // Parameters only: shards on the host, masters (fp32 = the shards otherwise) on the
           // device.
           {{"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
            {"strategy.zero3.offload_param=true"},
            true,
            false},
           {{"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"},
            {"strategy.fsdp.cpu_offload=true"},
            true,
            true},
           // fp16: the loss scaler's tensors follow the gradients to the host.
           {{"strategy.kind=fsdp", "precision.mode=fp16"},
            {"strategy.fsdp.cpu_offload=true"},
            true,
            true}}) {
    DYNAMIC_SECTION(v.plain[0] << " " << v.plain[1] << " + " << v.offload[0]) {
      Job plain = run_job(2, with(base, v.plain));
      Job off = run_job(2, with(with(base, v.plain), v.offload), allow);
      require_ok(plain);
      require_ok(off);
      INFO(output_tail(off.output));
      CHECK(off.output.find("in host memory") != std::string::npos);  // the plan says so
      same_losses(plain, off);
      same_weights(plain, off);
      for (int r = 0; r < 2; ++r) {
        INFO("rank " << r);
        json p = last_rank_record(plain, r)["memory"], o = last_rank_record(off, r)["memory"];
        CHECK(bytes(p, "host_param_bytes") == 0);
        CHECK(bytes(p, "host_grad_bytes") == 0);
        CHECK(bytes(p, "host_optimizer_bytes") == 0);
        CHECK(bytes(o, "grad_bytes") == bytes(p, "grad_bytes"));
        CHECK(bytes(o, "optimizer_bytes") == bytes(p, "optimizer_bytes"));
        CHECK(bytes(o, "host_optimizer_bytes") == (v.optimizer ? bytes(o, "optimizer_bytes") : 0));
        CHECK(bytes(o, "host_grad_bytes") == (v.optimizer ? bytes(o, "grad_bytes") : 0));
        const bool fp32 = v.plain[1].find("bf16") == std::string::npos &&
                          v.plain[1].find("fp16") == std::string::npos;
        if (v.params && v.optimizer) {
          // Shards, masters (one tensor in fp32) and accumulators all on the host.
          CHECK(bytes(o, "param_bytes") == bytes(p, "param_bytes"));
          CHECK(bytes(o, "host_param_bytes") == bytes(o, "param_bytes"));
        } else if (v.optimizer) {
          // bf16 shards stay on the device; only the fp32 masters (2/3 of the bytes) moved.
          CHECK(!fp32);
          CHECK(bytes(o, "param_bytes") == bytes(p, "param_bytes"));
          CHECK(3 * bytes(o, "host_param_bytes") == 2 * bytes(o, "param_bytes"));
        } else {
          // fp32 shards on the host, their masters now a separate copy on the device.
          CHECK(fp32);
          CHECK(bytes(o, "param_bytes") == 2 * bytes(p, "param_bytes"));
          CHECK(2 * bytes(o, "host_param_bytes") == bytes(o, "param_bytes"));
        }
      }
    }
  }
}

// The offloaded optimizer at world size 1 and 2, with and without gradient accumulation, fp32 and
// bf16 (whose compute copies the host AdamW writes in its own pass): the same bits as the same
// job without offload (issue 32).
namespace {
// zero3 in bf16 with the optimizer offloaded and small parameters replicated (both kinds of group).
const std::vector<std::string> kOffloadedBf16 = {
    "train.micro_batch=2", "precision.mode=bf16", "strategy.kind=zero3",
    "strategy.zero3.param_persistence_threshold=5000", "strategy.zero3.offload_optimizer=true"};

// Both jobs ended well, wrote the same final model and logged the same losses over `steps`
// steps; their metrics records.
std::pair<std::vector<json>, std::vector<json>> same_run(const Job& x, const Job& y, size_t steps) {
  require_ok(x);
  require_ok(y);
  CHECK(read_file(x.dir + "/final/model.safetensors") ==
        read_file(y.dir + "/final/model.safetensors"));
  auto a = read_metrics(x.dir), b = read_metrics(y.dir);
  REQUIRE(a.size() == steps);
  REQUIRE(b.size() == steps);
  for (size_t i = 0; i < steps; ++i) CHECK(a[i]["loss"] == b[i]["loss"]);
  return {std::move(a), std::move(b)};
}

// A step's record of the host update that ran beside it (time.delayed_update or
// time.overlapped_update): how long it ran, what the step waited for, the rest hidden.
void check_host_update(const json& u) {
  CHECK(u["update_s"].get<double>() > 0);
  CHECK(u["waited_s"].get<double>() >= 0);
  CHECK(u["hidden_s"].get<double>() ==
        Approx(std::max(0.0, u["update_s"].get<double>() - u["waited_s"].get<double>())));
}
}  // namespace

TEST_CASE("offload at 1 and 2 ranks, with and without accumulation: the same bits", "[multiproc]") {
  const std::map<std::string, std::string> allow = {{"FT_ALLOW_CPU_OFFLOAD", "1"}};
  for (const int nproc : {1, 2})
    for (const int accum : {1, 2})
      for (const std::string precision : {"fp32", "bf16"}) {
        DYNAMIC_SECTION(nproc << " rank(s), grad_accum " << accum << ", " << precision) {
          const std::vector<std::string> sets = {"train.max_steps=3",
                                                 "train.micro_batch=2",
                                                 "train.grad_accum=" + std::to_string(accum),
                                                 "precision.mode=" + precision,
                                                 "strategy.kind=zero3",
                                                 "strategy.zero3.param_persistence_threshold=5000"};
          Job plain = run_job(nproc, sets);
          Job off = run_job(nproc, with(sets, {"strategy.zero3.offload_optimizer=true"}), allow);
          const auto [a, b] = same_run(plain, off, 3);
          CHECK(b.back()["memory"]["host_optimizer_bytes"].get<int64_t>() > 0);  // rank 0's
          // The host update ran beside the next step's forward (strategy.overlap_host_step, on
          // by default), which waited for it unit by unit: reported from step 2 on.
          for (size_t i = 0; i < b.size(); ++i) {
            INFO("step " << i + 1);
            CHECK_FALSE(a[i]["time"].contains("overlapped_update"));
            // Every master's clip norm was taken by the engine's host thread as its gradient
            // became final (after the replicated ones' all-reduce at 2 ranks), none after.
            CHECK_FALSE(a[i]["time"].contains("grad_norm"));
            const json& n = b[i]["time"]["grad_norm"];
            CHECK(n["masters"].get<int>() >= 2);
            CHECK(n["beside_backward"] == n["masters"]);
            // (Of those, the ones done before the backward ended: a count, which depends on
            // timing; engine_inproc_test shows that they come.)
            CHECK(n["before_backward_end"].get<int>() >= 0);
            CHECK(n["before_backward_end"].get<int>() <= n["masters"].get<int>());
            CHECK(n["after_backward_s"].get<double>() >= 0);
            REQUIRE(b[i]["time"].contains("overlapped_update") == (i >= 1));
            if (i == 0) continue;
            check_host_update(b[i]["time"]["overlapped_update"]);
            // (Clipping on: the update waited for the norm of the whole gradient.)
            CHECK(b[i]["time"]["overlapped_update"]["during_backward"] == false);
          }
        }
      }
}

// strategy.overlap_host_step=false: the whole host update before the next step, as before the
// overlapped one existed: the same bits as the overlapped run (and so as the run without
// offload), with a checkpoint in between (a point where the overlapped update is waited for), and
// no overlapped_update record.
TEST_CASE("offload without the overlapped update: the same bits, no record", "[multiproc]") {
  const std::map<std::string, std::string> allow = {{"FT_ALLOW_CPU_OFFLOAD", "1"}};
  const std::vector<std::string> sets =
      with(kOffloadedBf16,
           {"train.max_steps=4", "strategy.zero3.offload_param=true", "output.save_every=2"});
  Job on = run_job(2, sets, allow);
  Job off = run_job(2, with(sets, {"strategy.overlap_host_step=false"}), allow);
  const auto [a, b] = same_run(on, off, 4);
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i]["time"].contains("overlapped_update") == (i >= 1));
    CHECK_FALSE(b[i]["time"].contains("overlapped_update"));
  }
}

// Clipping off (train.grad_clip 0): nothing waits for the whole gradient, so the overlapped update
// begins with the backward of the step's last micro-batch and takes each master as soon as the
// engine's host thread has its final gradient (and norm): at 1 and 2 ranks, with accumulation,
// the same bits as the same job without offload, every record from step 2 on saying so. A fault
// in that update ends the job with its error (in the backward or the next forward), no hang.
TEST_CASE("offload with clipping off: the update begins during the backward, the same bits",
          "[multiproc]") {
  const std::map<std::string, std::string> allow = {{"FT_ALLOW_CPU_OFFLOAD", "1"}};
  for (const int nproc : {1, 2})
    for (const int accum : {1, 2}) {
      DYNAMIC_SECTION(nproc << " rank(s), grad_accum " << accum) {
        const std::vector<std::string> sets =
            with(kOffloadedBf16, {"train.max_steps=3", "train.grad_clip=0",
                                  "train.grad_accum=" + std::to_string(accum),
                                  "strategy.zero3.offload_optimizer=false"});
        Job plain = run_job(nproc, sets);
        Job off = run_job(nproc, with(sets, {"strategy.zero3.offload_optimizer=true"}), allow);
        const auto [a, b] = same_run(plain, off, 3);
        for (size_t i = 0; i < b.size(); ++i) {
          INFO("step " << i + 1);
          const json& n = b[i]["time"]["grad_norm"];
          CHECK(n["beside_backward"] == n["masters"]);
          CHECK(a[i]["grad_norm"] == b[i]["grad_norm"]);
          REQUIRE(b[i]["time"].contains("overlapped_update") == (i >= 1));
          if (i == 0) continue;
          check_host_update(b[i]["time"]["overlapped_update"]);
          CHECK(b[i]["time"]["overlapped_update"]["during_backward"] == true);
        }
      }
    }
  const Job j = run_job(2, with(kOffloadedBf16, {"train.max_steps=4", "train.grad_clip=0"}),
                        {{"FT_ALLOW_CPU_OFFLOAD", "1"}, {"FT_FAULT_HOST_UPDATE", "2"}});
  INFO(output_tail(j.output));
  CHECK(j.code != 0);
  CHECK_THAT(j.output, Catch::Contains("the host optimizer update of step 2 failed"));
  CHECK(read_metrics(j.dir).size() <= 2);
}

// A host update that fails partway (FT_FAULT_HOST_UPDATE: step 2's, after its first master, on
// every rank): the next step's forward, waiting at its first unit, gets the error and the job ends
// with it, naming it; no hang, no step trained on half-updated parameters (2 records, not 3).
TEST_CASE("a failing overlapped host update ends the job with its error", "[multiproc]") {
  const Job j = run_job(2, with(kOffloadedBf16, {"train.max_steps=4"}),
                        {{"FT_ALLOW_CPU_OFFLOAD", "1"}, {"FT_FAULT_HOST_UPDATE", "2"}});
  INFO(output_tail(j.output));
  CHECK(j.code != 0);
  CHECK_THAT(j.output, Catch::Contains("the host optimizer update of step 2 failed"));
  CHECK(read_metrics(j.dir).size() == 2);
}

// ZeRO-Offload's delayed parameter update (strategy.zero3.delayed_update, issue 32): before its
// first delayed step a run is the plain offloaded run bit for bit; from then on each step computes
// its gradients with the parameters of the step before last, so its losses leave the plain run's
// one step later but stay close, and the end (which waits for the last update) is near the plain
// run's. A checkpoint is a point where the delay starts over: a job killed with SIGKILL resumes
// from it bit for bit. Refused without offload_optimizer, by key.
TEST_CASE("delayed update: the same run before it starts, one step stale after, resumable",
          "[multiproc]") {
  const std::map<std::string, std::string> allow = {{"FT_ALLOW_CPU_OFFLOAD", "1"}};
  const std::vector<std::string> base = with(
      kOffloadedBf16,
      {"train.max_steps=8", "train.grad_accum=2", "output.save_every=3", "output.keep_last=10"});
  Job plain = run_job(2, base, allow);
  Job late = run_job(
      2,
      with(base, {"strategy.zero3.delayed_update=true", "strategy.zero3.delayed_update_after=8"}),
      allow);
  const std::vector<std::string> delayed =
      with(base, {"strategy.zero3.delayed_update=true", "strategy.zero3.delayed_update_after=4"});
  Job early = run_job(2, delayed, allow);
  require_ok(plain);
  require_ok(late);
  require_ok(early);
  CHECK_THAT(early.output, Catch::Contains("delayed update after step 4"));
  CHECK(read_file(plain.dir + "/final/model.safetensors") ==
        read_file(late.dir + "/final/model.safetensors"));
  const auto p = read_metrics(plain.dir), d = read_metrics(early.dir);
  REQUIRE(p.size() == 8);
  REQUIRE(d.size() == 8);
  // Steps 1-5 compute their gradients with the same parameters (step 5's update is the first to
  // run late, during step 6); step 6 computes with step 4's parameters, not step 5's.
  for (size_t i = 0; i < 5; ++i) CHECK(d[i]["loss"] == p[i]["loss"]);
  CHECK(d[5]["loss"] != p[5]["loss"]);
  for (size_t i = 5; i < 8; ++i) {
    const double a = p[i]["loss"].get<double>(), b = d[i]["loss"].get<double>();
    CHECK(std::abs(a - b) / a < 0.05);
  }
  CHECK(read_file(plain.dir + "/final/model.safetensors") !=
        read_file(early.dir + "/final/model.safetensors"));
  // From step 6 on each step records the host update that ran beside it: its time, what the step
  // waited for, the rest hidden.
  for (size_t i = 0; i < 8; ++i) {
    INFO("step " << i + 1);
    const bool beside = i >= 5;
    REQUIRE(d[i]["time"].contains("delayed_update") == beside);
    if (!beside) continue;
    check_host_update(d[i]["time"]["delayed_update"]);
  }
  // SIGKILL after a random step past the first checkpoint (step 3), the same command again: the
  // same bytes as the uninterrupted delayed run.
  std::mt19937 gen(std::random_device{}());
  const size_t kill_after = 4 + gen() % 3;
  INFO("SIGKILL after " << kill_after << " steps");
  const std::string k = make_temp_dir() + "/run";
  const auto argv = train_argv(
      {"--nproc-per-node", "2", "--master-port", std::to_string(free_port())}, k, delayed);
  Child c = start(argv, allow, k + ".txt");
  wait_for_steps(k, kill_after, std::chrono::steady_clock::now() + std::chrono::seconds(120));
  ::kill(c.pid, SIGKILL);
  REQUIRE(wait_for(c, 30).value_or(-1) == 128 + SIGKILL);
  const Finished again = run_to_end(argv, allow, k + ".again.txt", 150);
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains("resuming from"));
  CHECK(read_file(early.dir + "/final/model.safetensors") ==
        read_file(k + "/final/model.safetensors"));
  // Without the offloaded optimizer it has nothing to delay: refused by key.
  const Finished bad = run_to_end(
      ft_train_argv({"--preset", "tiny-demo", "--output", make_temp_dir() + "/bad"},
                    with(kBase, {"strategy.kind=zero3", "strategy.zero3.delayed_update=true"})),
      {}, make_temp_dir() + "/bad.txt", 60);
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("strategy.zero3.delayed_update delays the host optimizer "
                                         "step of strategy.zero3.offload_optimizer, which is off"));
}

TEST_CASE("sharded load: a rank's peak host memory stays below model/world size + one tensor",
          "[multiproc]") {
  // A 17M-parameter fp32 model (68 MB) written as several safetensors shards with an index.
  const std::string model = make_temp_dir() + "/model";
  const int64_t h = 512, inter = 1408, vocab = 4096, layers = 4;
  {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    ft::io::NamedTensors t;
    auto add = [&](const std::string& name, std::vector<int64_t> shape) {
      t.emplace_back(name, at::randn(shape, gen) * 0.02);
    };
    add("model.embed_tokens.weight", {vocab, h});
    for (int64_t l = 0; l < layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const char* w : {"q_proj", "k_proj", "v_proj", "o_proj"})
        add(p + "self_attn." + w + ".weight", {h, h});
      add(p + "mlp.gate_proj.weight", {inter, h});
      add(p + "mlp.up_proj.weight", {inter, h});
      add(p + "mlp.down_proj.weight", {h, inter});
      t.emplace_back(p + "input_layernorm.weight", at::ones({h}));
      t.emplace_back(p + "post_attention_layernorm.weight", at::ones({h}));
    }
    t.emplace_back("model.norm.weight", at::ones({h}));
    add("lm_head.weight", {vocab, h});
    REQUIRE(ft::io::write_sharded(model, t, 16 << 20).size() >= 5);  // + the index
    std::ofstream(model + "/config.json") << json{
        {"architectures", {"LlamaForCausalLM"}},
        {"model_type", "llama"},
        {"hidden_size", h},
        {"intermediate_size", inter},
        {"num_hidden_layers", layers},
        {"num_attention_heads", 8},
        {"num_key_value_heads", 8},
        {"vocab_size", vocab},
        {"max_position_embeddings", 256},
        {"rms_norm_eps", 1e-5},
        {"tie_word_embeddings", false}}.dump();
  }
  const int64_t model_bytes =
      4 * (2 * vocab * h + layers * (4 * h * h + 3 * h * inter + 2 * h) + h);
  const int64_t largest_tensor = 4 * vocab * h;

  auto load = [&](int nproc, const std::vector<std::string>& sets) {
    Job j;
    j.dir = make_temp_dir() + "/run";
    const Finished f = run_to_end(
        ft_launch_argv(
            {"--nproc-per-node", std::to_string(nproc), "--master-port",
             std::to_string(free_port())},
            ft_train_argv({"--preset", "tiny-demo", "--model", model, "--output", j.dir},
                          with(sets, {"precision.mode=fp32", "train.max_steps=1", "data.seq_len=64",
                                      "train.micro_batch=" + std::to_string(4 / nproc)}))),
        {}, make_temp_dir() + "/out.txt", 150);
    j.code = f.code;
    j.output = f.output;
    INFO(output_tail(j.output));
    require_ok(j);
    return j;
  };
  auto record = [](const Job& j, int r) {
    std::ifstream in(j.dir + "/load.rank" + std::to_string(r) + ".json");
    REQUIRE(in.good());
    json rec = json::parse(in);
    REQUIRE(rec["peak_reset"] == true);
    REQUIRE(rec["source"] == "files");
    return rec;
  };
  // The measurement can fail: ddp holds the whole model on every rank.
  Job ddp = load(2, {"strategy.kind=ddp"});
  for (int r = 0; r < 2; ++r) {
    json rec = record(ddp, r);
    INFO("ddp rank " << r << ": " << rec.dump());
    CHECK(rec["bytes_read"] == model_bytes);
    CHECK(rec["peak_delta_bytes"].get<int64_t>() >= model_bytes * 9 / 10);
  }
  const double ddp_loss = read_metrics(ddp.dir).at(0)["loss"];
  for (const auto& [nproc, sets] : std::vector<std::pair<int, std::vector<std::string>>>{
           {2, {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"}},
           {4, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}}}) {
    Job j = load(nproc, sets);
    int64_t read_total = 0;
    for (int r = 0; r < nproc; ++r) {
      json rec = record(j, r);
      INFO(sets[0] << " on " << nproc << " ranks, rank " << r << ": " << rec.dump());
      read_total += rec["bytes_read"].get<int64_t>();
      CHECK(rec["bytes_read"].get<int64_t>() <= model_bytes / nproc + 1024);  // + padding
      CHECK(rec["peak_delta_bytes"].get<int64_t>() > 0);
      CHECK(rec["peak_delta_bytes"].get<int64_t>() < model_bytes / nproc + largest_tensor);
    }
    CHECK(read_total == model_bytes);  // every byte read once, by one rank
    // The final model is written one tensor at a time: rank 0 never holds the whole of it (it
    // receives each tensor's pieces, converts and writes it, then lets it go).
    std::ifstream fin(j.dir + "/final_save.json");
    REQUIRE(fin.good());
    const json fs_rec = json::parse(fin);
    INFO("final save: " << fs_rec.dump());
    CHECK(fs_rec["bytes"] == model_bytes);
    REQUIRE(fs_rec["peak_reset"] == true);
    CHECK(fs_rec["peak_delta_bytes"].get<int64_t>() < model_bytes / 2);
    // Loaded right: the first step's loss (before any update) equals ddp's.
    const double loss = read_metrics(j.dir).at(0)["loss"];
    CHECK(std::abs(loss - ddp_loss) <= 1e-5 * ddp_loss);
  }
}

TEST_CASE("collectives: ddp once per step whatever the accumulation, FULL_SHARD gathers twice",
          "[multiproc]") {
  auto comm = [](const Job& j) { return last_rank_record(j, 1)["comm"]; };
  Job a1 = run_job(2, {"train.max_steps=2", "train.micro_batch=4", "strategy.kind=ddp"});
  Job a4 = run_job(
      2, {"train.max_steps=2", "train.micro_batch=1", "train.grad_accum=4", "strategy.kind=ddp"});
  INFO(output_tail(a1.output) << "\n" << output_tail(a4.output));
  require_ok(a1);
  require_ok(a4);
  // One 25 MiB bucket, split by weight decay into two flat tensors: two all-reduces per step.
  CHECK(comm(a1)["all_reduces"] == 2);
  CHECK(comm(a4)["all_reduces"] == 2);
  CHECK(comm(a4)["all_reduce_bytes"] == comm(a1)["all_reduce_bytes"]);
  CHECK(comm(a1)["all_gathers"] == 0);

  const std::vector<std::string> two_micro = {"train.max_steps=2", "train.micro_batch=2",
                                              "train.grad_accum=2", "strategy.kind=fsdp"};
  Job full = run_job(2, with(two_micro, {"strategy.fsdp.sharding_strategy=FULL_SHARD"}));
  Job grad_op = run_job(2, with(two_micro, {"strategy.fsdp.sharding_strategy=SHARD_GRAD_OP"}));
  INFO(output_tail(full.output) << "\n" << output_tail(grad_op.output));
  require_ok(full);
  require_ok(grad_op);
  // Units: the root (2 flat tensors: decayed embedding, undecayed norm) and 2 layers (2 each).
  // Per micro-batch FULL_SHARD gathers the root once and each layer in forward and backward;
  // SHARD_GRAD_OP gathers each layer once.
  CHECK(comm(full)["all_gathers"] == 2 * (2 + 2 * 2 * 2));
  CHECK(comm(grad_op)["all_gathers"] == 2 * (2 + 2 * 2));
  // Gradients are reduce-scattered every micro-batch, one per unit.
  CHECK(comm(full)["reduce_scatters"] == 2 * 3);
  CHECK(comm(full)["all_reduces"] == 0);

  // Without overlap the same collectives are issued (each waited for at once, so the time spent
  // waiting is all of the communication).
  Job serial = run_job(2, with(two_micro, {"strategy.fsdp.sharding_strategy=FULL_SHARD",
                                           "strategy.overlap_comm=false"}));
  INFO(output_tail(serial.output));
  require_ok(serial);
  for (const char* k : {"all_gathers", "all_gather_bytes", "reduce_scatters",
                        "reduce_scatter_bytes", "all_reduces", "scalar_collectives"})
    CHECK(comm(serial)[k] == comm(full)[k]);
  CHECK(comm(serial)["wait_s"].get<double>() > 0);
}

namespace {
// Two `ft launch` nodes x 2 workers on loopback running fsdp HYBRID_SHARD with `sets`.
Job run_hybrid(const std::vector<std::string>& sets,
               const std::map<std::string, std::string>& env = {}) {
  Job j;
  j.dir = make_temp_dir() + "/run";
  const std::string port = std::to_string(free_port());
  std::vector<Child> nodes;
  for (int node = 0; node < 2; ++node)
    nodes.push_back(start(
        train_argv(
            {"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", port},
            j.dir,
            with(sets, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=HYBRID_SHARD"})),
        env, make_temp_dir() + "/node.txt"));
  j.code = 0;
  for (auto& c : nodes) {
    auto rc = wait_for(c, 150);
    if (!rc) kill_and_reap(c);
    j.output += c.output();
    if (rc.value_or(-1) != 0) j.code = rc.value_or(-1);
  }
  return j;
}
}  // namespace

TEST_CASE("two launchers x 2 workers with HYBRID_SHARD: shards inside a node, replicas across",
          "[multiproc]") {
  Job ref = run_job(1, {"train.micro_batch=8"});
  Job hy = run_hybrid({"train.micro_batch=2"});
  check_same_run(ref, hy, "model.safetensors");
  // Every rank holds half of the model (sharded over its node's 2 ranks, not over all 4) and
  // all-reduces its shard's gradient with the other node's replica.
  json r0 = last_rank_record(hy, 0), r3 = last_rank_record(hy, 3);
  CHECK(r0["memory"]["param_bytes"] == r3["memory"]["param_bytes"]);
  Job ddp = run_job(1, {"train.max_steps=1"});
  require_ok(ddp);
  const int64_t whole = read_metrics(ddp.dir).back()["memory"]["param_bytes"];
  CHECK(r0["memory"]["param_bytes"].get<int64_t>() >= whole / 2);
  CHECK(r0["memory"]["param_bytes"].get<int64_t>() <= whole / 2 + 64);
  CHECK(r3["comm"]["all_reduces"].get<int64_t>() > 0);
  CHECK(r3["comm"]["reduce_scatters"].get<int64_t>() > 0);
}

// HYBRID_SHARD with the optimizer offloaded (fsdp cpu_offload) on two launchers x 2 workers: a
// sharded gradient is final only after the replicas' all-reduce, where the engine's host thread
// takes its norm; with clipping on and off (the update during the backward) the same bits as the
// same job without offload, every norm taken beside the backward.
TEST_CASE("HYBRID_SHARD with cpu_offload, clipping on and off: the same bits", "[multiproc]") {
  const std::map<std::string, std::string> allow = {{"FT_ALLOW_CPU_OFFLOAD", "1"}};
  auto hybrid = [&](const std::vector<std::string>& sets) {
    return run_hybrid(with(sets, {"train.max_steps=3", "train.micro_batch=2", "train.grad_accum=2",
                                  "precision.mode=bf16"}),
                      allow);
  };
  for (const std::string clip : {"1.0", "0"}) {
    DYNAMIC_SECTION("train.grad_clip " << clip) {
      const std::vector<std::string> sets = {"train.grad_clip=" + clip};
      const auto [a, b] =
          same_run(hybrid(sets), hybrid(with(sets, {"strategy.fsdp.cpu_offload=true"})), 3);
      for (size_t i = 0; i < b.size(); ++i) {
        INFO("step " << i + 1);
        const json& n = b[i]["time"]["grad_norm"];
        CHECK(n["beside_backward"] == n["masters"]);
        if (i >= 1) CHECK(b[i]["time"]["overlapped_update"]["during_backward"] == (clip == "0"));
      }
    }
  }
}

TEST_CASE("strategy settings that do not apply are refused before anything is written",
          "[multiproc]") {
  struct Case {
    std::vector<std::string> sets;
    std::string says;
    std::map<std::string, std::string> env = {};
  };
  for (const auto& c : std::vector<Case>{
           {{"strategy.kind=ddp", "strategy.zero3.offload_param=true"},
            "is a zero3 knob but strategy.kind is ddp"},
           {{"strategy.kind=zero3", "strategy.fsdp.forward_prefetch=true"},
            "is a fsdp knob but strategy.kind is zero3"},
           {{"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=HYBRID_SHARD"},
            "HYBRID_SHARD shards inside a node and replicates across nodes"},
           {{"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true"}, "this run is on CPU"},
           {{"strategy.kind=fsdp", "strategy.fsdp.cpu_offload=true"}, "this run is on CPU"},
           // (Allowed on CPU for tests, a single rank still has no shards to offload.)
           {{"strategy.kind=zero3", "strategy.zero3.offload_param=true"},
            "keeps parameter shards in host memory, but this job (1 rank(s), zero3) splits nothing",
            {{"FT_ALLOW_CPU_OFFLOAD", "1"}}},
           {{"strategy.kind=fsdp", "strategy.fsdp.param_dtype=bf16"},
            "differs from precision.mode=fp32"}}) {
    INFO(c.sets[1]);
    const std::string dir = make_temp_dir() + "/run";
    Child ch = start(ft_train_argv({"--preset", "tiny-demo", "--output", dir}, with(kBase, c.sets)),
                     c.env, make_temp_dir() + "/out.txt");
    auto rc = wait_for(ch, 60);
    INFO(output_tail(ch.output()));
    CHECK(rc == 2);
    CHECK(ch.output().find(c.says) != std::string::npos);
    CHECK(!fs::exists(dir));
  }
}

// The planner in one process: model-state bytes against DeepSpeed's published estimator, the time
// it takes, and the errors bad input gets; the one malloc arena its CPU retention term assumes.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "config/settings.h"
#include "core/error.h"
#include "core/host_alloc.h"
#include "plan/plan.h"
#include "plan/resources.h"
#include "support/subprocess.h"

using namespace ft;

namespace {

plan::Plan gpu_plan(const std::string& preset, std::vector<std::string> sets, int nnodes,
                    int nproc) {
  plan::PlanInputs in;
  in.settings = config::resolve_settings(preset, sets);
  in.layout = {nnodes, nproc, true};
  in.budget.gpu_bytes = int64_t{80} << 30;
  in.budget.host_bytes = int64_t{768} << 30;
  return plan::make_plan(in);
}

int64_t item(const plan::Plan& p, const std::string& key) {
  for (const auto& i : p.device)
    if (i.key == key) return i.bytes;
  for (const auto& i : p.host)
    if (i.key == key) return i.bytes;
  FAIL("no item " << key);
  return 0;
}

}  // namespace

// DeepSpeed, deepspeed/runtime/zero/stage3.py, estimate_zero3_model_states_mem_needs:
//   no offload:            gpu = largest_layer_memory + int(18 * total_params / total_gpus)
//   cpu_offload (optim.):  gpu = largest_layer_memory + int(2 * total_params / total_gpus)
//                          cpu = total_params * 16 * gpus_factor * additional_buffer_factor
// (largest_layer_memory = 4 * largest_layer_params, gpus_factor = 1 / num_nodes). ft's model state
// is the same per-parameter arithmetic without DeepSpeed's 1.5 host slack; ft keeps zero3's small
// persistent parameters whole on every rank and pads shards, which the bound below allows for.
TEST_CASE("zero3 model-state bytes for 7B and 70B agree with DeepSpeed's estimator", "[unit]") {
  for (const std::string preset : {"full-7b", "full-70b"}) {
    const int nodes = 2, gpus = 8, G = nodes * gpus;
    INFO(preset);
    const plan::Plan off = gpu_plan(preset, {"strategy.kind=zero3"}, nodes, gpus);
    const plan::Plan on = gpu_plan(
        preset, {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true"}, nodes, gpus);
    const double P = static_cast<double>(off.parameters);
    REQUIRE(off.trained_parameters == off.parameters);
    // Without offload: 2 (bf16 shard) + 4 (fp32 master) + 4 (fp32 gradient) + 8 (Adam) bytes.
    const double ds_gpu = std::floor(18 * P / G);
    const double ft_gpu =
        static_cast<double>(off.param_bytes + off.grad_bytes + off.optimizer_bytes);
    CHECK(std::abs(ft_gpu - ds_gpu) / ds_gpu < 1e-3);
    CHECK(ft_gpu >= ds_gpu);  // persistent parameters and padding only ever add
    // Optimizer offloaded: 2 bytes per parameter per GPU on the device, 16 per parameter per node
    // in host memory.
    const double ds_gpu_off = std::floor(2 * P / G);
    CHECK(std::abs(static_cast<double>(item(on, "parameters")) - ds_gpu_off) / ds_gpu_off < 1e-3);
    CHECK(item(on, "masters") + item(on, "gradients") + item(on, "optimizer_state") == 0);
    const double ds_cpu = P * 16 / nodes;  // additional_buffer_factor 1: ft states its own slack
    CHECK(std::abs(static_cast<double>(item(on, "offloaded")) - ds_cpu) / ds_cpu < 1e-3);
  }
}

// With the optimizer offloaded the plan gives the host's part of each step: AdamW over the rank's
// trained elements at the measured time per parameter divided by the threads a rank gets, and on
// a GPU the gradients' additions on the host and their copies down every micro-batch and the
// values' copy up; against the step's
// model FLOPs. None without offload.
TEST_CASE("the offloaded optimizer's part of each step, per rank", "[unit]") {
  plan::PlanInputs in;
  in.settings = config::resolve_settings(
      "full-7b", {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true"});
  in.layout = {1, 8, true};
  in.budget.host_adamw_ns = 0.5;
  in.budget.host_cores = 16;  // 2 threads per rank
  const plan::Plan p = plan::make_plan(in);
  REQUIRE(p.offload_step.size() == 3);
  const double n = static_cast<double>(p.grad_bytes) / 4;  // this rank's trained elements
  REQUIRE(n > 0);
  CHECK(p.offload_step[0].key == "host_update");
  CHECK_THAT(p.offload_step[0].from, Catch::Contains("/ 2 thread(s)"));
  const double update = n * 0.5e-9 / 2;
  const int64_t micro = in.settings.train.grad_accum;
  const double copies = (static_cast<double>(micro) * n * 4 + n * 2) / 25e9;
  const double adds = (static_cast<double>(micro) * n * 0.25e-9 + n * 0.15e-9) / 2;  // + norm
  CHECK(p.offload_step[1].key == "host_adds");
  CHECK(p.offload_step_s == Approx(update + adds + copies).epsilon(1e-9));
  CHECK(p.offload_step[2].bytes == static_cast<int64_t>(micro * n * 4 + n * 2));
  // 6 N per token at least (full fine-tuning), over the rank's tokens of the step.
  const double tokens =
      static_cast<double>(in.settings.train.micro_batch * in.settings.data.seq_len * micro);
  CHECK(p.step_flops > 6.0 * static_cast<double>(p.parameters) * tokens * 0.9);
  CHECK_THAT(plan::plan_text(p),
             Catch::Contains("offloaded optimizer, per rank per step: about") &&
                 Catch::Contains("it equals the compute on a device achieving"));
  // The overlapped update by default (strategy.overlap_host_step), and said when it is off.
  CHECK(p.offload_overlapped);
  CHECK_THAT(plan::plan_text(p), Catch::Contains("beside the next step's forward (overlapped"));
  CHECK_FALSE(p.offload_during_backward);  // (clipping on)
  in.settings = config::resolve_settings(
      "full-7b",
      {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true", "train.grad_clip=0"});
  const plan::Plan noclip = plan::make_plan(in);
  CHECK(noclip.offload_during_backward);
  CHECK_THAT(plan::plan_text(noclip), Catch::Contains("beside the backward and the next step's"));
  in.settings = config::resolve_settings(
      "full-7b", {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true",
                  "strategy.overlap_host_step=false"});
  const plan::Plan apart = plan::make_plan(in);
  CHECK_FALSE(apart.offload_overlapped);
  CHECK(apart.offload_step_s == Approx(p.offload_step_s).epsilon(1e-9));
  CHECK_THAT(plan::plan_text(apart), Catch::Contains("not overlapped with the device's"));
  // With the node's memory bandwidth known, each host pass takes the longer of its time on the
  // rank's threads and its bytes through memory shared by the node's 8 ranks.
  in.settings = config::resolve_settings(
      "full-7b", {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true"});
  in.budget.host_memory_bps = 20e9;
  in.budget.host_memory_from = "test";
  const plan::Plan slow = plan::make_plan(in);
  const double bytes_update = static_cast<double>(slow.offload_step[0].bytes);
  const double bytes_adds = static_cast<double>(slow.offload_step[1].bytes);
  CHECK(bytes_update == Approx(n * 34));  // fp32 p, g, m, v read; p, m, v, g written; bf16 out
  CHECK(bytes_adds == Approx(micro * n * 12 + n * 4));
  const double mem_update = bytes_update * 8 / 20e9, mem_adds = bytes_adds * 8 / 20e9;
  REQUIRE(mem_update > update);
  CHECK(slow.offload_step_s == Approx(mem_update + mem_adds + copies).epsilon(1e-9));
  CHECK_THAT(slow.offload_step[0].from,
             Catch::Contains("(test) shared by 8 ranks") && Catch::Contains("memory-bound"));
  in.budget.host_memory_bps = 1e15;  // a memory no pass waits for: the threads' time again
  const plan::Plan fast = plan::make_plan(in);
  CHECK(fast.offload_step_s == Approx(p.offload_step_s).epsilon(1e-9));
  CHECK_THAT(fast.offload_step[0].from, Catch::Contains("compute-bound"));
  in.budget.host_memory_bps = 0;
  // One rank holds its gradients whole: they come down as the backward made them, in bf16.
  in.layout = {1, 1, true};
  const plan::Plan one = plan::make_plan(in);
  const double n1 = static_cast<double>(one.grad_bytes) / 4;
  CHECK(one.offload_step[2].bytes == static_cast<int64_t>(micro * n1 * 2 + n1 * 2));
  CHECK(one.offload_step[1].bytes == static_cast<int64_t>(micro * n1 * 10 + n1 * 4));
  in.layout = {1, 8, true};
  // The delayed update: a second host gradient buffer, the update's part overlapped.
  in.settings = config::resolve_settings(
      "full-7b", {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true",
                  "strategy.zero3.delayed_update=true"});
  const plan::Plan d = plan::make_plan(in);
  CHECK(d.grad_bytes == 2 * p.grad_bytes);
  CHECK(d.offload_step_s == Approx(p.offload_step_s).epsilon(1e-9));
  CHECK(d.offload_delayed);
  CHECK_FALSE(d.offload_overlapped);
  CHECK_THAT(plan::plan_text(d), Catch::Contains("overlapped with the next step (delayed update)"));
  // Without offload: no such section.
  in.settings = config::resolve_settings("full-7b", {"strategy.kind=zero3"});
  const plan::Plan q = plan::make_plan(in);
  CHECK(q.offload_step.empty());
  CHECK_THAT(plan::plan_text(q), !Catch::Contains("offloaded optimizer"));
}

// Offloaded parameter shards on GPUs (fsdp cpu_offload, zero3 offload_param): each gather first
// copies the rank's shard up, every micro-batch, and the layers' again in backward where the
// forward released them (FULL_SHARD; not SHARD_GRAD_OP, whose units stay gathered). With only the
// parameters offloaded the section has that item alone.
TEST_CASE("offloaded parameter shards: their copies up before each gather, per rank", "[unit]") {
  plan::PlanInputs in;
  in.layout = {1, 8, true};
  auto plan_of = [&](const std::vector<std::string>& sets) {
    in.settings = config::resolve_settings("full-7b", sets);
    return plan::make_plan(in);
  };
  auto item = [](const plan::Plan& p, const std::string& key) -> const plan::Item* {
    for (const auto& i : p.offload_step)
      if (i.key == key) return &i;
    return nullptr;
  };
  const plan::Plan kept = plan_of({"strategy.kind=fsdp", "strategy.fsdp.cpu_offload=true",
                                   "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP"});
  const plan::Plan full = plan_of({"strategy.kind=fsdp", "strategy.fsdp.cpu_offload=true",
                                   "strategy.fsdp.sharding_strategy=FULL_SHARD"});
  const int64_t micro = in.settings.train.grad_accum;
  const plan::Item* k = item(kept, "param_shards_up");
  const plan::Item* f = item(full, "param_shards_up");
  REQUIRE(k != nullptr);
  REQUIRE(f != nullptr);
  // SHARD_GRAD_OP: the rank's bf16 shard of every parameter (fsdp keeps none whole), once per
  // micro-batch.
  const double shard = 2.0 * static_cast<double>(kept.parameters) / 8;
  CHECK(std::abs(static_cast<double>(k->bytes) / static_cast<double>(micro) - shard) / shard <
        1e-3);
  CHECK_THAT(k->from, !Catch::Contains("again in backward"));
  // FULL_SHARD: the layers' shards again in backward, the root's not.
  CHECK(f->bytes > k->bytes);
  CHECK(f->bytes < 2 * k->bytes);
  CHECK_THAT(f->from, Catch::Contains("again in backward"));
  CHECK(full.offload_step_s > kept.offload_step_s);
  CHECK_FALSE(full.offload_params_only);
  CHECK(item(full, "host_update") != nullptr);
  // zero3 with only the parameters offloaded: their copies alone, said so.
  const plan::Plan params = plan_of({"strategy.kind=zero3", "strategy.zero3.offload_param=true",
                                     "strategy.zero3.param_persistence_threshold=0"});
  REQUIRE(params.offload_step.size() == 1);
  CHECK(params.offload_step[0].key == "param_shards_up");
  CHECK(params.offload_params_only);
  CHECK(params.offload_step_s ==
        Approx(static_cast<double>(params.offload_step[0].bytes) / 25e9).epsilon(1e-9));
  CHECK_THAT(plan::plan_text(params),
             Catch::Contains("offloaded parameter shards, per rank per step: about") &&
                 !Catch::Contains("offloaded optimizer"));
  CHECK(plan::plan_json(params)["offload_step"]["parameters_only"] == true);
}

TEST_CASE("ft plan of full-70b takes well under a second", "[unit]") {
  const auto t0 = std::chrono::steady_clock::now();
  const plan::Plan p = gpu_plan("full-70b", {}, 2, 8);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 1.0);
  CHECK(p.parameters > 70'000'000'000);
  CHECK(p.rank == 0);
  CHECK_THAT(p.rank_why, Catch::Contains("final save"));
}

TEST_CASE("a plan that does not fit says by how much and re-plans each suggestion", "[unit]") {
  plan::PlanInputs in;
  in.settings = config::resolve_settings("full-7b", {"strategy.kind=ddp"});
  in.layout = {1, 4, true};
  in.budget.gpu_bytes = int64_t{24} << 30;
  in.budget.host_bytes = int64_t{256} << 30;
  const plan::Plan p = plan::make_plan(in);
  REQUIRE_FALSE(p.fits());
  REQUIRE(p.shortfall() != nullptr);
  CHECK(p.shortfall()->resource == "GPU memory");
  CHECK(p.shortfall()->need > p.shortfall()->have);
  bool sharded = false, lora = false, fitting = false;
  for (const auto& s : p.suggestions) {
    CHECK(s.device_bytes > 0);
    // Each suggestion is its own plan: smaller than the original where it changes the state.
    if (s.what.find("FULL_SHARD") != std::string::npos) {
      sharded = true;
      CHECK(s.device_bytes < p.device_peak);
    }
    if (s.what.find("LoRA") != std::string::npos) {
      lora = true;
      CHECK(s.fits);
    }
    fitting = fitting || s.fits;
  }
  CHECK(sharded);
  CHECK(lora);
  CHECK(fitting);
  const std::string v = plan::verdict(p);
  CHECK_THAT(v, Catch::Contains("GPU memory") && Catch::Contains("short") &&
                    Catch::Contains("to make it fit"));
  // The same object as JSON.
  const auto j = plan::plan_json(p);
  CHECK(j["fits"] == false);
  CHECK(j["rank"]["peak_bytes"] == p.device_peak);
  CHECK(j["suggestions"].size() == p.suggestions.size());
}

// Issue 51's case: LoRA on a 70B model over 8 GPUs of 40 GiB under ddp without activation
// checkpointing (327 GiB a GPU). Neither checkpointing (151 GiB) nor fsdp (211 GiB) fits alone;
// together they do (35 GiB), and that pair is what the plan suggests and the refusal names, with
// the figures of its own plan.
TEST_CASE("when no single change fits, the smallest combination that fits is suggested", "[unit]") {
  const std::vector<std::string> job = {"strategy.kind=ddp", "train.activation_checkpointing=none"};
  plan::PlanInputs in;
  in.settings = config::resolve_settings("lora-70b", job);
  in.layout = {1, 8, true};
  in.budget.gpu_bytes = int64_t{40} << 30;
  in.budget.host_bytes = int64_t{768} << 30;
  const auto t0 = std::chrono::steady_clock::now();
  const plan::Plan p = plan::make_plan(in);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE_FALSE(p.fits());
  const plan::Suggestion* both = nullptr;
  for (const auto& g : p.suggestions) {
    INFO(g.what);
    if (g.changes == 1) CHECK_FALSE(g.fits);  // each change alone, still short
    if (g.changes == 2 && !both) both = &g;
    CHECK(g.changes <= 2);  // a pair fits: no triple is tried
  }
  REQUIRE(both != nullptr);
  CHECK(both->fits);
  CHECK(both->what == "activation checkpointing of every layer + fsdp FULL_SHARD instead of ddp");
  CHECK(both->sets == std::vector<std::string>{"train.activation_checkpointing=full",
                                               "strategy.kind=fsdp",
                                               "strategy.fsdp.sharding_strategy=FULL_SHARD"});
  // Its figures are those of the job with both changes.
  std::vector<std::string> with_both = job;
  with_both.insert(with_both.end(), both->sets.begin(), both->sets.end());
  in.settings = config::resolve_settings("lora-70b", with_both);
  const plan::Plan q = plan::make_plan(in);
  CHECK(q.fits());
  CHECK(both->device_bytes == q.device_peak);
  CHECK_THAT(plan::verdict(p),
             Catch::Contains("to make it fit: activation checkpointing of every layer + fsdp "
                             "FULL_SHARD instead of ddp (--set train.activation_checkpointing=full "
                             "--set strategy.kind=fsdp --set "
                             "strategy.fsdp.sharding_strategy=FULL_SHARD)"));
  CHECK(plan::plan_json(p)["suggestions"].back()["changes"].get<int>() >= 0);
  CHECK(s < 5.0);  // the combinations keep a refusal quick
}

// Issue 33's case: LoRA on a 70B model does not fit 4 GPUs of 24 GB; the plan suggests QLoRA
// (with fsdp's shards in host memory, it fits), and the qlora-70b preset (NF4 base, sequences of
// 2048, nothing offloaded) fits, its projections counted at 0.5 B per
// parameter plus a 4 B absmax per 64 and one dequantized in flight.
TEST_CASE("QLoRA: LoRA-70B on 4 x 24 GB is suggested an NF4 base, and qlora-70b fits", "[unit]") {
  plan::PlanInputs in;
  in.settings = config::resolve_settings("lora-70b", {});
  in.layout = {1, 4, true};
  in.budget.gpu_bytes = int64_t{24} << 30;
  in.budget.host_bytes = int64_t{256} << 30;
  const plan::Plan p = plan::make_plan(in);
  REQUIRE_FALSE(p.fits());
  CHECK(p.nf4_parameters == 0);
  // At 4096 tokens a sequence the NF4 base alone leaves it 2.6 GiB over; with fsdp's shards in
  // host memory too it fits.
  bool suggested = false, offloaded = false;
  for (const auto& s : p.suggestions) {
    if (s.what.find("NF4") == std::string::npos) continue;
    if (s.what.find("cpu_offload") == std::string::npos) {
      suggested = true;
      CHECK(s.sets == std::vector<std::string>{"lora.quantize_base=nf4"});
      CHECK(s.device_bytes < p.device_peak - (int64_t{20} << 30));  // 3/4 of 35 GiB of base gone
      CHECK_FALSE(s.fits);
    } else {
      offloaded = true;
      CHECK(s.sets ==
            std::vector<std::string>{"lora.quantize_base=nf4", "strategy.fsdp.cpu_offload=true"});
      CHECK(s.fits);
    }
  }
  CHECK(suggested);
  CHECK(offloaded);

  in.settings = config::resolve_settings("qlora-70b", {});
  const plan::Plan q = plan::make_plan(in);
  CHECK(q.fits());
  // Every projection of the 80 layers: q, k, v, o and the three MLP ones.
  const int64_t h = 8192, kv = 1024, inter = 28672;
  const int64_t per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter;
  CHECK(q.nf4_parameters == 80 * per_layer);
  CHECK(q.nf4_bytes == 80 * per_layer / 2 + 80 * per_layer / 64 * 4);
  CHECK(q.parameters == p.parameters);
  CHECK(q.trained_parameters == p.trained_parameters);
  bool dequantized = false;
  for (const auto& i : q.device) {
    if (i.key == "nf4_dequantized") {
      dequantized = true;
      CHECK(i.bytes == h * inter * 2);  // the largest projection in bf16
    }
    if (i.key == "parameters") CHECK_THAT(i.from, Catch::Contains("in NF4"));
  }
  CHECK(dequantized);
  CHECK(plan::plan_json(q)["nf4_parameters"] == q.nf4_parameters);
}

TEST_CASE("sizes: units, and a clear error for anything else", "[unit]") {
  CHECK(plan::parse_size("80GiB", "--gpu-memory") == int64_t{80} << 30);
  CHECK(plan::parse_size("768 GB", "--host-memory") == int64_t{768} * 1000 * 1000 * 1000);
  CHECK(plan::parse_size("1.5TiB", "--host-memory") == int64_t{3} << 39);
  CHECK(plan::parse_size("512M", "--x") == int64_t{512} << 20);
  for (const std::string bad : {"80XB", "-8GiB", "0", "GiB", "", "1e30TiB", "nan", "80 GBs"}) {
    INFO(bad);
    try {
      plan::parse_size(bad, "--gpu-memory");
      FAIL("accepted");
    } catch (const ConfigError& e) {
      CHECK_THAT(e.what(), Catch::Contains("--gpu-memory"));
    }
  }
}

TEST_CASE("a config.json without the fields the plan needs is refused, naming the file", "[unit]") {
  const std::string dir = test::make_temp_dir();
  std::ofstream(dir + "/config.json") << R"({"model_type": "llama", "vocab_size": 1000})";
  plan::PlanInputs in;
  in.settings = config::resolve_settings("tiny-demo", {});
  in.model_dir = dir;
  try {
    plan::make_plan(in);
    FAIL("planned");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains(dir + "/config.json"));
  }
}

// Issue 51: planning before the download. A directory with config.json alone plans as the same
// directory with its weights does, the files' bytes estimated from the shapes, and says so.
TEST_CASE("a model directory holding only config.json is planned from its shapes", "[unit]") {
  const std::string fixture = test::test_dir() + "/model/fixtures/mistral_gqa";
  const std::string dir = test::make_temp_dir();
  std::filesystem::copy_file(fixture + "/config.json", dir + "/config.json");
  plan::PlanInputs in;
  in.settings = config::resolve_settings("tiny-demo", {"data.seq_len=32"});
  in.model_dir = fixture;
  const plan::Plan full = plan::make_plan(in);
  in.model_dir = dir;
  const plan::Plan bare = plan::make_plan(in);
  CHECK_FALSE(full.model_files_estimated);
  CHECK(bare.model_files_estimated);
  CHECK_THAT(bare.model_from, Catch::Contains(dir + "/config.json alone") &&
                                  Catch::Contains("no weight files") && Catch::Contains("float32"));
  CHECK_THAT(plan::plan_text(bare), Catch::Contains("config.json alone (no weight files in"));
  CHECK(plan::plan_json(bare)["model_files_estimated"] == true);
  CHECK(bare.parameters == full.parameters);
  CHECK(bare.device_peak == full.device_peak);
  CHECK(bare.host_peak == full.host_peak);
  // Reading the files at start-up: the parameters x 4 B (fp32, as config.json says), against the
  // fixture's file with its header.
  auto read_bytes = [](const plan::Plan& p) -> int64_t {
    for (const auto& i : p.startup)
      if (i.key == "read") return i.bytes;
    return -1;
  };
  CHECK(read_bytes(bare) == bare.parameters * 4);
  CHECK(std::abs(read_bytes(bare) - read_bytes(full)) < read_bytes(full) / 20);
  // A bf16 config: half the bytes.
  std::ifstream src(fixture + "/config.json");
  std::string text((std::istreambuf_iterator<char>(src)), std::istreambuf_iterator<char>());
  text.replace(text.find("\"float32\""), 9, "\"bfloat16\"");
  std::ofstream(dir + "/config.json") << text;
  const plan::Plan half = plan::make_plan(in);
  CHECK(read_bytes(half) == bare.parameters * 2);
  CHECK_THAT(half.model_from, Catch::Contains("bfloat16"));
}

#if defined(__GLIBC__)
namespace {

// glibc's heaps (arenas) in this process, from malloc_info's report.
int malloc_heaps() {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  malloc_info(0, f);
  std::fclose(f);
  const std::string xml(buf, len);
  std::free(buf);
  int n = 0;
  for (size_t at = xml.find("<heap nr="); at != std::string::npos;
       at = xml.find("<heap nr=", at + 1))
    ++n;
  return n;
}

// In a child process: optionally limit the arenas, then 8 threads that each hold a block while
// the others allocate. Exit status: the heaps that appeared (capped at 100).
int new_heaps_in_child(bool limit, const char* env) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (env)
      setenv("MALLOC_ARENA_MAX", env, 1);
    else
      unsetenv("MALLOC_ARENA_MAX");
    if (limit) {
      const std::string got = ft::core::limit_malloc_arenas();
      if (got != (env ? env : "1")) _exit(101);
    }
    const int before = malloc_heaps();
    std::vector<std::thread> threads;
    for (int i = 0; i < 8; ++i)
      threads.emplace_back([] {
        void* p = std::malloc(1 << 20);
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        std::free(p);
      });
    for (auto& t : threads) t.join();
    _exit(std::min(100, malloc_heaps() - before));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

TEST_CASE("a worker's malloc uses one arena unless MALLOC_ARENA_MAX says otherwise", "[unit]") {
  // glibc's default: threads get heaps of their own (what the plan's retention term does not
  // assume); after limit_malloc_arenas(), none appear.
  CHECK(new_heaps_in_child(false, nullptr) > 0);
  CHECK(new_heaps_in_child(true, nullptr) == 0);
  // The user's setting is left to glibc, and said.
  CHECK(new_heaps_in_child(true, "3") != 101);
}

namespace {

// In a child process: optionally keep_freed_heap(), then three rounds of a step's pattern: 96
// blocks of 1 MiB allocated, written and freed (more than the 64 MiB trim threshold that glibc's
// self-adjusting one reaches at most; this test process may have raised it already). Exit status:
// 1 if the third round faulted (almost) no pages in, 0 if it faulted them in again, 101 if
// keep_freed_heap() did not do what was asked of it.
int freed_heap_kept_in_child(bool keep, const char* env) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (env)
      setenv("MALLOC_TRIM_THRESHOLD_", env, 1);
    else
      unsetenv("MALLOC_TRIM_THRESHOLD_");
    unsetenv("MALLOC_MMAP_THRESHOLD_");
    if (keep && ft::core::keep_freed_heap() != (env == nullptr)) _exit(101);
    auto faults = [] {
      rusage u{};
      getrusage(RUSAGE_SELF, &u);
      return u.ru_minflt;
    };
    long third = 0;
    for (int round = 0; round < 3; ++round) {
      const long before = faults();
      std::vector<void*> blocks;
      for (int i = 0; i < 96; ++i) {
        blocks.push_back(std::malloc(1 << 20));
        std::memset(blocks.back(), 1, 1 << 20);
      }
      for (void* p : blocks) std::free(p);
      third = faults() - before;
    }
    _exit(third < 1000 ? 1 : 0);  // 96 MiB faulted in again is 24,576 pages
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

TEST_CASE("a worker keeps its freed heap instead of faulting it in again every step", "[unit]") {
  CHECK(freed_heap_kept_in_child(false, nullptr) == 0);  // glibc's default gives 96 MiB back
  CHECK(freed_heap_kept_in_child(true, nullptr) == 1);
  // The user's MALLOC_TRIM_THRESHOLD_ is left to glibc (keep_freed_heap() says it did nothing).
  CHECK(freed_heap_kept_in_child(true, "1") != 101);
}

// core::HostBlockCache (the fused loss's per-step blocks): a block freed comes back to the next
// request of its size without faulting its pages in again; a request of another size frees what is
// kept first; at most max_blocks are kept; release() frees them; a tensor may outlive the cache.
TEST_CASE("kept host blocks: reused unfaulted, freed on another size, bounded, released") {
  const int64_t n = int64_t{64} << 18;  // 64 MiB of fp32: above glibc's largest mmap threshold
  ft::core::HostBlockCache cache(2);
  // Under 32 MiB: plain at::empty, nothing kept.
  cache.empty({1024}, at::kFloat);
  CHECK(cache.kept_blocks() == 0);
  CHECK(cache.allocated() == 0);
  const auto faults = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
  };
  cache.empty({n}, at::kFloat).fill_(1.0f);  // written, freed: kept
  CHECK(cache.kept_blocks() == 1);
  CHECK(cache.kept_bytes() == static_cast<size_t>(n) * 4);
  const long before = faults();
  {
    at::Tensor t = cache.empty({n}, at::kFloat);
    CHECK(cache.kept_blocks() == 0);
    t.fill_(2.0f);
  }
  CHECK(faults() - before < 1000);  // 64 MiB faulted in again would be 16,384 pages
  CHECK(cache.reused() == 1);
  CHECK(cache.allocated() == 1);
  // Another size: the kept block is freed before the new one is taken.
  {
    at::Tensor t = cache.empty({n / 2}, at::kFloat);
    CHECK(cache.kept_blocks() == 0);
    CHECK(cache.allocated() == 2);
  }
  // At most two kept.
  {
    std::vector<at::Tensor> ts;
    for (int i = 0; i < 3; ++i) ts.push_back(cache.empty({n / 2}, at::kFloat));
  }
  CHECK(cache.kept_blocks() == 2);
  cache.release();
  CHECK(cache.kept_blocks() == 0);
  CHECK(cache.kept_bytes() == 0);
  // A tensor outlives its cache: its block goes back to the C library when it is freed.
  at::Tensor survivor;
  {
    ft::core::HostBlockCache scoped(4, /*min_bytes=*/0);
    survivor = scoped.empty({4, 1024}, at::kDouble);
    survivor.fill_(3.0);
  }
  CHECK(survivor.sum().item<double>() == 3.0 * 4 * 1024);
  survivor = at::Tensor();
}

// core's step pool (LibTorch's CPU allocator in a worker): a block of 1 MiB or more allocated
// inside a step is kept when freed, whoever frees it and whenever, and comes back to the next
// request of its size without a page faulted in; one allocated outside a step is unmapped when
// freed; smaller requests never reach it; release_step_pool() unmaps what is kept.
TEST_CASE("the step pool keeps a step's blocks by size and finds them again unfaulted", "[unit]") {
  ft::core::install_step_pool();
  ft::core::release_step_pool();
  const auto faults = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
  };
  const auto stats = [] { return ft::core::step_pool_stats(); };
  const int64_t n = int64_t{16} << 18;  // 16 MiB of fp32
  const size_t bytes = static_cast<size_t>(n) * 4;
  const size_t live0 = stats().live_bytes;
  // Small requests: glibc, not the pool.
  const size_t mapped0 = stats().mapped;
  { at::Tensor small = at::empty({1000}, at::kFloat); }
  CHECK(stats().mapped == mapped0);
  // Outside a step: mapped, and unmapped when freed.
  {
    at::Tensor t = at::empty({n}, at::kFloat);
    CHECK(stats().mapped == mapped0 + 1);
    CHECK(stats().live_bytes == live0 + bytes);
  }
  CHECK(stats().live_bytes == live0);
  CHECK(stats().idle_bytes == 0);
  // Inside a step: two blocks of one size and one of another, all kept when freed.
  void* first = nullptr;
  {
    const ft::core::StepPoolScope step;
    at::Tensor a = at::empty({n}, at::kFloat), b = at::empty({n}, at::kFloat);
    at::Tensor c = at::empty({n / 2}, at::kFloat);
    a.fill_(1.0f);
    b.fill_(1.0f);
    first = a.data_ptr();
  }
  CHECK(stats().idle_bytes == 2 * bytes + bytes / 2);
  // The next step finds them again, in any order, without faulting their pages in.
  {
    const ft::core::StepPoolScope step;
    const size_t mapped = stats().mapped, reused = stats().reused;
    const long before = faults();
    at::Tensor a = at::empty({n}, at::kFloat), b = at::empty({n}, at::kFloat);
    a.fill_(2.0f);
    b.fill_(2.0f);
    CHECK(faults() - before < 500);  // 32 MiB faulted in again would be 8,192 pages
    CHECK(stats().mapped == mapped);
    CHECK(stats().reused == reused + 2);
    CHECK((a.data_ptr() == first || b.data_ptr() == first));
    CHECK(stats().idle_bytes == bytes / 2);
    // A size with no kept block of its own is mapped anew (the half-size block stays as it is).
    at::Tensor d = at::empty({n / 4}, at::kFloat);
    CHECK(stats().mapped == mapped + 1);
    CHECK(stats().idle_bytes == bytes / 2);
  }
  // A step's block freed after the step, from another thread: kept all the same.
  at::Tensor late;
  {
    const ft::core::StepPoolScope step;
    late = at::empty({n}, at::kFloat);
  }
  const size_t idle = stats().idle_bytes;
  std::thread([t = std::move(late)]() mutable { t = at::Tensor(); }).join();
  CHECK(stats().idle_bytes == idle + bytes);
  // A block from outside a step freed inside one: unmapped, not kept.
  at::Tensor outside = at::empty({n * 2}, at::kFloat);
  {
    const ft::core::StepPoolScope step;
    outside = at::Tensor();
  }
  CHECK(stats().idle_bytes == idle + bytes);
  CHECK(stats().peak_bytes >= stats().live_bytes + stats().idle_bytes);
  ft::core::release_step_pool();
  CHECK(stats().idle_bytes == 0);
  CHECK(stats().live_bytes == live0);
}
#endif

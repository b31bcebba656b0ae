// `ft plan` against real runs on loopback: the model-state bytes of every rank equal the runtime's
// own accounting exactly (every strategy and sharding strategy at world sizes 1, 2 and 4, full and
// LoRA, fp32 and bf16, with and without activation checkpointing), the predicted peak resident
// memory of each rank is within 15% of the one measured, and a job that cannot fit is refused in
// seconds with nothing written.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
using nlohmann::json;

namespace {

bool exists(const std::string& p) { return ::access(p.c_str(), F_OK) == 0; }

std::vector<std::string> set_args(const std::vector<std::string>& sets) {
  std::vector<std::string> a;
  for (const auto& s : sets) a.insert(a.end(), {"--set", s});
  return a;
}

// `model`: a model directory (--model), "" for tiny-demo's own shape.
json plan_json(const std::vector<std::string>& sets, int nnodes, int nproc,
               const std::string& model = "") {
  std::vector<std::string> argv = {ft_bin(),
                                   "plan",
                                   "--preset",
                                   "tiny-demo",
                                   "--json",
                                   "--nnodes",
                                   std::to_string(nnodes),
                                   "--nproc-per-node",
                                   std::to_string(nproc)};
  if (!model.empty()) argv.insert(argv.end(), {"--model", model});
  const auto a = set_args(sets);
  argv.insert(argv.end(), a.begin(), a.end());
  const Finished f = run_to_end(argv, {}, make_temp_dir() + "/plan.txt", 30);
  INFO(output_tail(f.output));
  REQUIRE(f.code >= 0);
  return json::parse(f.output);
}

// A real job of `nnodes` launchers x `nproc` workers (one plain ft train for 1 x 1); each rank's
// records of its steps.
std::vector<std::vector<json>> run_job(const std::vector<std::string>& sets, int nnodes, int nproc,
                                       const std::string& model = "") {
  const std::string dir = make_temp_dir() + "/run";
  std::vector<std::string> train = {"--preset", "tiny-demo", "--output", dir};
  if (!model.empty()) train.insert(train.end(), {"--model", model});
  if (nnodes * nproc == 1) {
    const Finished f = run_to_end(ft_train_argv(train, sets), {}, make_temp_dir() + "/o.txt", 200);
    INFO(output_tail(f.output));
    REQUIRE(f.code == 0);
    return {read_metrics(dir)};
  }
  const std::string port = std::to_string(free_port());
  std::vector<Child> nodes;
  for (int n = 0; n < nnodes; ++n)
    nodes.push_back(
        start(ft_launch_argv({"--nnodes", std::to_string(nnodes), "--node-rank", std::to_string(n),
                              "--nproc-per-node", std::to_string(nproc), "--master-addr",
                              "127.0.0.1", "--master-port", port},
                             ft_train_argv(train, sets)),
              {}, make_temp_dir() + "/node.txt"));
  for (auto& c : nodes) {
    const auto rc = wait_for(c, 240);
    if (!rc) kill_and_reap(c);
    INFO(output_tail(c.output()));
    REQUIRE(rc.value_or(-1) == 0);
  }
  std::vector<std::vector<json>> ranks;
  for (int r = 0; r < nnodes * nproc; ++r)
    ranks.push_back(read_jsonl(dir + "/metrics.rank" + std::to_string(r) + ".jsonl"));
  return ranks;
}

// Every rank's last record of its model state equals the plan's figures exactly.
void check_ranks_match(const std::vector<std::vector<json>>& ranks, const json& plan) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    INFO("rank " << r);
    REQUIRE_FALSE(ranks[r].empty());
    const json& mem = ranks[r].back()["memory"];
    CHECK(mem["param_bytes"] == plan["rank"]["param_bytes"]);
    CHECK(mem["grad_bytes"] == plan["rank"]["grad_bytes"]);
    CHECK(mem["optimizer_bytes"] == plan["rank"]["optimizer_bytes"]);
  }
}

struct Layout {
  std::string name;
  std::vector<std::string> sets;
  int nnodes = 1, nproc = 1;
};

const std::vector<Layout> kStrategies = {
    {"ddp", {"strategy.kind=ddp"}},
    {"zero3", {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=100"}},
    {"fsdp FULL_SHARD", {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}},
    {"fsdp SHARD_GRAD_OP", {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP"}},
    {"fsdp NO_SHARD", {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=NO_SHARD"}},
};

// Full and LoRA x fp32 and bf16, activation checkpointing on for half of them: the model state
// of every rank as `ft plan` gives it and as the run accounts it.
void check_state_exact(const Layout& l) {
  int variant = 0;
  for (const bool lora : {false, true})
    for (const std::string precision : {"fp32", "bf16"}) {
      std::vector<std::string> sets = with(small_run_sets(), l.sets);
      sets = with(sets, {"precision.mode=" + precision, "train.max_steps=1", "hardware.device=cpu",
                         std::string("train.activation_checkpointing=") +
                             (variant++ % 2 ? "full" : "none")});
      if (lora) sets = with(sets, {"lora.enabled=true", "lora.r=4"});
      INFO(l.name << " on " << l.nnodes << " x " << l.nproc << ", lora " << lora << ", "
                  << precision);
      const json plan = plan_json(sets, l.nnodes, l.nproc);
      const auto ranks = run_job(sets, l.nnodes, l.nproc);
      REQUIRE(ranks.size() == static_cast<size_t>(l.nnodes * l.nproc));
      check_ranks_match(ranks, plan);
    }
}

}  // namespace

// Expert parallelism: a rank holds only its experts, whole (replicated over the ranks holding the
// same ones) or, under zero3 and fsdp with more than one such rank, split over them; the plan
// counts them from the same units as the engine.
TEST_CASE("plan state bytes equal the run's under expert parallelism (EP 2 at 2 and 4 ranks)",
          "[multiproc]") {
  const std::string model = std::string(FT_TEST_DIR) + "/model/fixtures/moe/qwen3_moe_tiny";
  struct Case {
    int nproc;
    std::vector<std::string> sets;
    std::string holds;
  };
  const std::string whole = "experts, whole, replicated over the ";
  for (const Case& c : std::vector<Case>{
           {2, {"strategy.kind=ddp"}, whole + "1 rank(s)"},
           {2, {"strategy.kind=zero3"}, whole + "1 rank(s)"},
           {4, {"strategy.kind=ddp"}, whole + "2 rank(s)"},
           // (the fixture's experts are under zero3's default persistence threshold)
           {4, {"strategy.kind=zero3"}, whole + "2 rank(s) holding the same ones (below the"},
           {4,
            {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
            "experts, split over the 2 ranks holding the same ones"},
           {4, {"strategy.kind=fsdp"}, "experts, split over the 2 ranks holding the same ones"}}) {
    const std::vector<std::string> sets =
        with(c.sets, {"strategy.expert_parallel=2", "data.seq_len=32", "train.micro_batch=1",
                      "train.max_steps=1", "hardware.device=cpu", "precision.mode=fp32"});
    INFO(c.sets.back() << " on " << c.nproc << " ranks");
    const json plan = plan_json(sets, 1, c.nproc, model);
    // It says what a rank holds of the experts.
    CHECK_THAT(
        plan["strategy"].get<std::string>(),
        Catch::Contains("expert_parallel 2: each rank holds 4 of each MoE layer's 8 " + c.holds));
    // Whole experts: fewer bytes than the same job without expert parallelism (the other half of
    // the experts is not here). Split ones: a quarter of every expert on each of the 4 ranks, as
    // without expert parallelism, but for the padding of other groups.
    const json all = plan_json(with(sets, {"strategy.expert_parallel=1"}), 1, c.nproc, model);
    const int64_t ep = plan["rank"]["param_bytes"].get<int64_t>(),
                  no_ep = all["rank"]["param_bytes"].get<int64_t>();
    if (c.holds.rfind("experts, split", 0) == 0)
      CHECK(std::abs(ep - no_ep) <= 64);
    else
      CHECK(ep < no_ep);
    const auto ranks = run_job(sets, 1, c.nproc, model);
    check_ranks_match(ranks, plan);
    bool a2a = false;
    for (const auto& k : plan["comm_per_step"]) a2a = a2a || k["key"] == "all_to_all";
    CHECK(a2a);
  }
}

// LoRA on the experts with a trained router under EP 2: every rank holds all experts' adapters
// and the routers as trained tensors, which the plan lays out as the run does.
TEST_CASE("plan state bytes equal the run's with expert adapters and trained routers under EP 2",
          "[multiproc]") {
  const std::string model = std::string(FT_TEST_DIR) + "/model/fixtures/moe/qwen3_moe_tiny";
  for (const std::string kind : {"ddp", "zero3"}) {
    const std::vector<std::string> sets = {
        "strategy.kind=" + kind,
        "strategy.expert_parallel=2",
        "data.seq_len=32",
        "train.micro_batch=1",
        "train.max_steps=1",
        "hardware.device=cpu",
        "precision.mode=fp32",
        "lora.enabled=true",
        "lora.dropout=0",
        R"(lora.target_parameters=["mlp.experts.gate_up_proj","mlp.experts.down_proj"])",
        "lora.train_router=true"};
    INFO(kind);
    const json plan = plan_json(sets, 1, 2, model);
    // More trained state than attention adapters alone.
    const json attention = plan_json(
        with(sets, {"lora.target_parameters=[]", "lora.train_router=false"}), 1, 2, model);
    CHECK(plan["rank"]["optimizer_bytes"].get<int64_t>() >
          attention["rank"]["optimizer_bytes"].get<int64_t>());
    check_ranks_match(run_job(sets, 1, 2, model), plan);
  }
}

TEST_CASE("plan state bytes equal the run's at world size 1", "[multiproc]") {
  check_state_exact({"ddp", {"strategy.kind=ddp"}, 1, 1});
}

// QLoRA (issue 33): the projections' NF4 blobs counted as the engine holds them (bf16 and fp32
// elements of the same bytes), sharded or replicated.
TEST_CASE("plan state bytes equal the run's for QLoRA at 1 and 2 ranks", "[multiproc]") {
  for (const Layout& l :
       {Layout{"ddp", {"strategy.kind=ddp"}, 1, 1}, Layout{"ddp", {"strategy.kind=ddp"}, 1, 2},
        Layout{
            "zero3", {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"}, 1, 2},
        Layout{"fsdp", {"strategy.kind=fsdp"}, 1, 2}})
    for (const std::string precision : {"fp32", "bf16"}) {
      INFO(l.name << " on " << l.nproc << " ranks, " << precision);
      const std::vector<std::string> sets =
          with(with(small_run_sets(), l.sets),
               {"precision.mode=" + precision, "train.max_steps=1", "hardware.device=cpu",
                "lora.enabled=true", "lora.r=4", "lora.quantize_base=nf4"});
      const json plan = plan_json(sets, l.nnodes, l.nproc);
      CHECK(plan["nf4_parameters"].get<int64_t>() > 0);
      check_ranks_match(run_job(sets, l.nnodes, l.nproc), plan);
    }
}

TEST_CASE("plan state bytes equal the run's at world size 2, every strategy", "[multiproc]") {
  for (Layout l : kStrategies) {
    l.nproc = 2;
    check_state_exact(l);
  }
}

TEST_CASE("plan state bytes equal the run's at world size 4, every strategy", "[multiproc]") {
  for (Layout l : kStrategies) {
    l.nproc = 4;
    check_state_exact(l);
  }
  check_state_exact({"fsdp HYBRID_SHARD",
                     {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=HYBRID_SHARD"},
                     2,
                     2});
}

// A model big enough that its state and activations, not the process, dominate (20M parameters,
// 1024 tokens per micro-batch): each rank's peak resident memory over the steps against the plan.
// The jobs are split over two test cases (about 100 s each on 2 cores), so that each stays well
// inside CTest's limit beside another test.
namespace {

struct PeakCase {
  std::string name;
  std::vector<std::string> sets;
  int nproc;
};

void check_peaks_within_15_percent(const std::vector<PeakCase>& cases) {
  const std::vector<std::string> model = {
      "model.vocab_size=8000",      "model.hidden_size=512", "model.intermediate_size=1408",
      "model.num_layers=4",         "model.num_heads=8",     "model.num_kv_heads=4",
      "model.tie_embeddings=false", "data.seq_len=256",      "train.micro_batch=4",
      "train.max_steps=3",          "hardware.device=cpu",   "precision.mode=fp32"};
  for (const auto& c : cases) {
    INFO(c.name);
    const auto sets = with(model, c.sets);
    const json plan = plan_json(sets, 1, c.nproc);
    const double predicted = plan["rank"]["step_peak_bytes"].get<double>();
    const auto ranks = run_job(sets, 1, c.nproc);
    for (size_t r = 0; r < ranks.size(); ++r) {
      double measured = 0;
      for (const auto& rec : ranks[r])
        measured = std::max(measured, rec["memory"]["peak_rss_bytes"].get<double>());
      INFO("rank " << r << ": predicted " << predicted / (1 << 20) << " MiB, measured "
                   << measured / (1 << 20) << " MiB");
      CHECK(std::abs(predicted - measured) / measured < 0.15);
    }
  }
}

}  // namespace

TEST_CASE("predicted peak host memory of each rank is within 15% of the measured peak",
          "[multiproc]") {
  check_peaks_within_15_percent({
      {"ddp, 1 rank", {"strategy.kind=ddp"}, 1},
      {"LoRA with activation checkpointing, 1 rank",
       {"lora.enabled=true", "lora.dropout=0.0", "train.activation_checkpointing=full"},
       1},
      {"zero3, 2 ranks", {"strategy.kind=zero3"}, 2},
      {"fsdp FULL_SHARD LoRA, 2 ranks",
       {"strategy.kind=fsdp", "lora.enabled=true", "lora.dropout=0.0"},
       2},
      {"fsdp SHARD_GRAD_OP with activation checkpointing, 2 ranks",
       {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP",
        "train.activation_checkpointing=full"},
       2},
      {"ddp with activation checkpointing, 4 ranks",
       {"strategy.kind=ddp", "train.activation_checkpointing=full"},
       4},
  });
}

TEST_CASE(
    "predicted peak host memory is within 15% of the measured peak in the matrix's hardest rows",
    "[multiproc]") {
  check_peaks_within_15_percent({
      // The matrix's hardest rows (bench/plan_accuracy.py): a sharded full fine-tune under
      // activation checkpointing in bf16 (predicted 16% low before one malloc arena), and sharded
      // LoRA under checkpointing (frozen units' freed blocks, mostly reused).
      {"fsdp FULL_SHARD bf16 with activation checkpointing, 2 ranks",
       {"strategy.kind=fsdp", "precision.mode=bf16", "train.activation_checkpointing=full"},
       2},
      {"fsdp SHARD_GRAD_OP LoRA with activation checkpointing, 2 ranks",
       {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP", "lora.enabled=true",
        "lora.dropout=0.0", "train.activation_checkpointing=full"},
       2},
      {"zero3 LoRA with activation checkpointing, 4 ranks",
       {"strategy.kind=zero3", "lora.enabled=true", "lora.dropout=0.0",
        "train.activation_checkpointing=full"},
       4},
  });
}

// The step pool (core/host_alloc.h) holds a rank's per-step blocks by size, so its resident set
// does not depend on how its threads' allocations interleaved: before, glibc's heap gave this case
// 428-488 MiB a rank over three identical runs, and kept growing at step 8.
TEST_CASE("a sharded CPU job's peak host memory is the same from run to run", "[multiproc]") {
  const std::vector<std::string> sets = {"model.vocab_size=8000",
                                         "model.hidden_size=512",
                                         "model.intermediate_size=1408",
                                         "model.num_layers=4",
                                         "model.num_heads=8",
                                         "model.num_kv_heads=4",
                                         "model.tie_embeddings=false",
                                         "data.seq_len=256",
                                         "train.micro_batch=4",
                                         "train.max_steps=6",
                                         "hardware.device=cpu",
                                         "precision.mode=fp32",
                                         "strategy.kind=fsdp",
                                         "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP",
                                         "lora.enabled=true",
                                         "lora.dropout=0.0",
                                         "train.activation_checkpointing=full"};
  std::vector<double> peaks;
  for (int run = 0; run < 2; ++run) {
    const auto ranks = run_job(sets, 1, 2);
    REQUIRE(ranks.size() == 2);
    for (const auto& records : ranks) {
      REQUIRE(records.size() == 6);
      double peak = 0;
      for (const auto& rec : records) {
        const json& m = rec["memory"];
        peak = std::max(peak, m["peak_rss_bytes"].get<double>());
        // The pool's blocks are part of the resident set, and most of it here.
        CHECK(m["host_pool_peak_bytes"].get<double>() > 0.5 * m["peak_rss_bytes"].get<double>());
        CHECK(m["host_pool_peak_bytes"].get<double>() < m["peak_rss_bytes"].get<double>());
      }
      // No growth after the first steps: the last step's peak is the second's, within 2%. (The
      // blocks below the pool's 1 MiB still come from glibc's heap: a 1% bound failed in 4 of
      // 26 runs on 2026-12-06, at 1.07-1.21% more at step 6 than at step 2, before and after
      // that day's engine change; without the pool, runs spread over 14%.)
      CHECK(records[5]["memory"]["peak_rss_bytes"].get<double>() <
            1.02 * records[1]["memory"]["peak_rss_bytes"].get<double>());
      peaks.push_back(peak);
    }
  }
  const auto [lo, hi] = std::minmax_element(peaks.begin(), peaks.end());
  INFO("peaks (MiB): " << peaks[0] / (1 << 20) << " " << peaks[1] / (1 << 20) << " "
                       << peaks[2] / (1 << 20) << " " << peaks[3] / (1 << 20));
  CHECK(*hi / *lo < 1.02);
}

TEST_CASE("ft train of full-70b on a machine that cannot hold it is refused in seconds",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string out = dir + "/run";
  const auto t0 = std::chrono::steady_clock::now();
  // The optimizer offload is a GPU setting: without it the CPU job is what is planned.
  const Finished f = run_to_end(ft_train_argv({"--preset", "full-70b", "--output", out},
                                              {"strategy.zero3.offload_optimizer=false",
                                               "data.format=synthetic", "train.max_steps=1"}),
                                {}, dir + "/out.txt", 60);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(output_tail(f.output));
  CHECK(f.code == 2);
  CHECK(s < 5);
  struct rusage ru {};
  ::getrusage(RUSAGE_CHILDREN, &ru);
  CHECK(ru.ru_maxrss < 1024 * 1024);  // KiB: under 1 GiB
  CHECK_FALSE(exists(out));
  // Names the node, the resource, needed against available, and what to do.
  CHECK_THAT(f.output, Catch::Contains("node 0") && Catch::Contains("host memory") &&
                           Catch::Contains("is available") && Catch::Contains("short") &&
                           Catch::Contains("hardware.preflight=warn"));
  CHECK(f.output.find("DefaultCPUAllocator") == std::string::npos);
}

TEST_CASE("every ft launch prints the verdict and refuses before starting workers", "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string out = dir + "/run";
  const Finished f =
      run_to_end({ft_bin(), "launch", "--standalone", "--nproc-per-node", "2", "--preset",
                  "full-70b", "--output", out, "--set", "strategy.zero3.offload_optimizer=false",
                  "--set", "data.format=synthetic", "--set", "train.max_steps=1"},
                 {}, dir + "/out.txt", 60);
  INFO(output_tail(f.output));
  CHECK(f.code == 2);
  CHECK_THAT(f.output, Catch::Contains("preflight") && Catch::Contains("host memory"));
  CHECK(f.output.find("[rank") == std::string::npos);  // no worker started
  CHECK_FALSE(exists(out));
}

// With the optimizer offloaded the plan takes each host pass's bytes through the node's memory,
// shared by its ranks. ft launch measures the bandwidth before it starts its workers (beside each
// other they could not) and hands it to them; a lone ft train measures it itself.
TEST_CASE("the offloaded host step's memory bandwidth: measured by ft launch for its workers",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::map<std::string, std::string> allow = {{"FT_ALLOW_CPU_OFFLOAD", "1"}};
  const std::vector<std::string> sets = {"--set", "train.max_steps=1",
                                         "--set", "strategy.kind=zero3",
                                         "--set", "strategy.zero3.offload_optimizer=true"};
  auto update_from = [](const std::string& out) {
    std::ifstream in(out + "/plan.json");
    REQUIRE(in.good());
    const json p = json::parse(in);
    REQUIRE(p["offload_step"]["items"][0]["key"] == "host_update");
    return p["offload_step"]["items"][0]["from"].get<std::string>();
  };
  std::vector<std::string> launch = {ft_bin(),           "launch",   "--standalone",
                                     "--nproc-per-node", "2",        "--preset",
                                     "tiny-demo",        "--output", dir + "/launched"};
  launch.insert(launch.end(), sets.begin(), sets.end());
  const Finished l = run_to_end(launch, allow, dir + "/l.txt", 120);
  INFO(output_tail(l.output));
  REQUIRE(l.code == 0);
  CHECK_THAT(update_from(dir + "/launched"),
             Catch::Contains("through the node's memory at") &&
                 Catch::Contains("(measured by this node's ft launch) shared by 2 ranks"));
  std::vector<std::string> alone = {ft_bin(),    "train",    "--preset",
                                    "tiny-demo", "--output", dir + "/alone"};
  alone.insert(alone.end(), sets.begin(), sets.end());
  const Finished a = run_to_end(alone, allow, dir + "/a.txt", 120);
  INFO(output_tail(a.output));
  REQUIRE(a.code == 0);
  CHECK_THAT(update_from(dir + "/alone"), Catch::Contains("through the node's memory at") &&
                                              Catch::Contains("(measured on this machine)"));
  // A figure that is not one is refused by the workers' preflight, naming it.
  const Finished bad = run_to_end(
      tiny_job_argv(
          2, dir + "/bad",
          {"train.max_steps=1", "strategy.kind=zero3", "strategy.zero3.offload_optimizer=true"}),
      {{"FT_ALLOW_CPU_OFFLOAD", "1"}, {"FT_HOST_MEMORY_BPS", "fast"}}, dir + "/b.txt", 120);
  CHECK(bad.code != 0);
  CHECK_THAT(bad.output, Catch::Contains("FT_HOST_MEMORY_BPS=fast: not a positive number"));
}

TEST_CASE("a job that fits says so, and start-up says what it loads", "[multiproc]") {
  const std::string dir = make_temp_dir();
  const Finished f = run_to_end(
      ft_train_argv({"--preset", "tiny-demo", "--output", dir + "/run"}, {"train.max_steps=1"}), {},
      dir + "/out.txt", 60);
  INFO(output_tail(f.output));
  REQUIRE(f.code == 0);
  CHECK_THAT(f.output, Catch::Contains("preflight on node 0: fits"));
  CHECK_THAT(f.output, Catch::Contains("loading 20 tensors from the seeded random init"));
  // warn and off run the same job; off prints no verdict.
  const Finished off = run_to_end(ft_train_argv({"--preset", "tiny-demo", "--output", dir + "/off"},
                                                {"train.max_steps=1", "hardware.preflight=off"}),
                                  {}, dir + "/off.txt", 60);
  REQUIRE(off.code == 0);
  CHECK(off.output.find("preflight") == std::string::npos);
}

TEST_CASE("ft plan prints every section, --json the same as one object, and bad input is refused",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const Finished text =
      run_to_end({ft_bin(), "plan", "--preset", "full-70b", "--nnodes", "2", "--nproc-per-node",
                  "8", "--gpu-memory", "80GiB", "--host-memory", "768GiB"},
                 {}, dir + "/t.txt", 30);
  INFO(output_tail(text.output));
  CHECK(text.code == 0);
  for (const char* s :
       {"per rank, on its GPU", "rank 0 needs most", "fp32 masters", "optimizer state",
        "gathered units", "activations", "logits", "communication buckets", "per node, host memory",
        "offloaded state", "disk", "communication per rank", "time to the first step", "fits."})
    CHECK_THAT(text.output, Catch::Contains(s));
  // The offloaded optimizer's host passes: this machine's memory bandwidth shared by the node's
  // 8 ranks, or the node given.
  CHECK_THAT(text.output, Catch::Contains("(measured on this machine) shared by 8 ranks"));
  // Planned here for 2 nodes elsewhere: the node figures not given are this machine's, and said
  // so with the options that give the nodes' own (issue 51).
  CHECK_THAT(text.output,
             Catch::Contains("note: this plan is for 2 node(s) of 8 GPU(s) but runs here: each "
                             "node's cores (") &&
                 Catch::Contains("are this machine's; give the nodes' own with --host-cores and "
                                 "--host-bandwidth"));
  const Finished given =
      run_to_end({ft_bin(), "plan", "--preset", "full-70b", "--nnodes", "2", "--nproc-per-node",
                  "8", "--gpu-memory", "80GiB", "--host-memory", "768GiB", "--host-bandwidth",
                  "300GB", "--host-cores", "96"},
                 {}, dir + "/g.txt", 30);
  INFO(output_tail(given.output));
  CHECK(given.code == 0);
  CHECK_THAT(given.output,
             Catch::Contains("/ 12 thread(s) (--host-cores: 96 cores / 8 ranks)") &&
                 Catch::Contains("at 279.4 GiB/s (--host-bandwidth) shared by 8 ranks") &&
                 Catch::Contains("memory-bound"));
  CHECK(given.output.find("note:") == std::string::npos);  // every node figure given
  const Finished js = run_to_end({ft_bin(), "plan", "--preset", "lora-7b", "--nproc-per-node", "4",
                                  "--gpu-memory", "24GiB", "--host-memory", "64GiB", "--json"},
                                 {}, dir + "/j.txt", 30);
  const json j = json::parse(js.output);
  CHECK(j["layout"]["nproc_per_node"] == 4);
  CHECK(j["rank"]["items"].size() >= 10);
  CHECK(j["checks"][0]["resource"] == "GPU memory");
  CHECK((js.code == 0) == j["fits"].get<bool>());
  struct Bad {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {{"--gpu-memory", "80XB"}, "--gpu-memory 80XB: not a size"},
      {{"--host-memory", "-5GiB"}, "--host-memory -5GiB"},
      {{"--disk-throughput", "fastGB"}, "--disk-throughput fastGB: not a size"},
      {{"--host-bandwidth", "fast"}, "--host-bandwidth fast: not a size"},
      {{"--model", dir + "/nowhere"}, "config.json"},
      {{"--set", "train.micro_batch=0"}, "train.micro_batch"},
      {{"--data", dir + "/missing.jsonl"}, "missing.jsonl: no such file"},
  };
  // (A range is CLI11's to check, with its own exit status, as --nnodes 0.)
  const Finished cores = run_to_end(
      {ft_bin(), "plan", "--preset", "tiny-demo", "--host-cores", "0"}, {}, dir + "/c.txt", 30);
  CHECK(cores.code != 0);
  CHECK_THAT(cores.output, Catch::Contains("--host-cores: Value 0 not in range"));
  for (const auto& b : bad) {
    std::vector<std::string> argv = {ft_bin(), "plan", "--preset", "tiny-demo"};
    argv.insert(argv.end(), b.args.begin(), b.args.end());
    const Finished f = run_to_end(argv, {}, dir + "/b.txt", 30);
    INFO(output_tail(f.output));
    CHECK(f.code == 2);
    CHECK_THAT(f.output, Catch::Contains(b.says));
    CHECK(f.output.find("terminate") == std::string::npos);
  }
}

TEST_CASE("an ft train command pastes into ft plan, and its disk need counts a SIGTERM checkpoint",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  std::ofstream(dir + "/d.jsonl") << "{\"text\": \"hello\"}\n";
  // Every option of ft train (the one table), as a user copies the command.
  const Finished f = run_to_end(
      {ft_bin(), "plan", "--preset", "tiny-demo", "--data", dir + "/d.jsonl", "--tokenizer",
       dir + "/tokenizer.json", "--data-cache", dir + "/cache", "--output", dir + "/run",
       "--resume", "auto", "--set", "data.format=auto", "--json"},
      {}, dir + "/p.txt", 30);
  INFO(output_tail(f.output));
  REQUIRE(f.code == 0);
  const json j = json::parse(f.output);
  // tiny-demo schedules no checkpoint, yet a SIGTERM writes one: the need is one checkpoint plus
  // the final model.
  int64_t one = 0, kept = 0, final_bytes = 0;
  for (const auto& i : j["disk"]["items"]) {
    if (i["key"] == "checkpoint") one = i["bytes"].get<int64_t>();
    if (i["key"] == "checkpoints") kept = i["bytes"].get<int64_t>();
    if (i["key"] == "final") final_bytes = i["bytes"].get<int64_t>();
  }
  CHECK(one > 0);
  CHECK(kept == one);
  CHECK(j["disk"]["need_bytes"].get<int64_t>() == one + final_bytes);
  CHECK_FALSE(exists(dir + "/run"));  // a plan writes nothing
}

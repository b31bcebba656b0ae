// The multi-rank gpu test (issue 34): several NCCL ranks on ONE GPU, each `ft launch` "node" with
// its own NCCL_HOSTID so NCCL takes them for separate hosts and connects them over its socket
// transport on loopback (docs/launcher.md, "Testing a multi-node setup on one GPU"). Every sharding
// strategy's GPU path at 2 and 4 ranks against the 1-rank run (losses step by step and the final
// weights), HYBRID_SHARD 2 x 2, offload at 2 ranks bit for bit against the same job without it,
// LoRA, bf16, a node's launcher killed with SIGKILL mid-run, resumed on the same layout (bit
// for bit) and on one rank, and a mixture-of-experts model with expert parallelism. Needs a visible
// GPU, else prints SKIP and exits 77.
//   test_cuda_gpu_ranks [GROUP...]   groups: fp32 offload lora bf16 resume moe (default: all)
// FT_GPU_CHECK_DEVICE=cpu runs the same jobs on the CPU over Gloo (a dry run of this test where no
// GPU is lent). Exits 0 when every check held, 1 otherwise; prints each comparison's largest
// relative differences.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/device.h"
#include "io/safetensors.h"
#include "support/numerics.h"
#include "support/runs.h"
#include "support/subprocess.h"

namespace {

using ft::test::with;
int failures = 0;
bool on_gpu = true;
int max_restarts = 0;  // the launchers'; the resume group's job must survive a lost node

void expect(bool ok, const std::string& what) {
  fmt::print("{} {}\n", ok ? "ok  " : "FAIL", what);
  std::fflush(stdout);
  if (!ok) ++failures;
}

// The environment of one "machine": the GPU, and a host id of its own for NCCL.
std::map<std::string, std::string> node_env(int node) {
  std::map<std::string, std::string> env = {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}};
  if (!on_gpu) {
    env["FT_ALLOW_CPU_OFFLOAD"] = "1";  // offload's code path on the CPU, as the CPU tests run it
    return env;
  }
  env.insert({{"CUDA_VISIBLE_DEVICES", "0"},
              {"NCCL_HOSTID", fmt::format("ft-gpu-check-node{}", node)},
              {"NCCL_NET", "Socket"},
              {"NCCL_SOCKET_IFNAME", "=lo"},
              {"NCCL_IB_DISABLE", "1"}});
  return env;
}

// A job: `nodes` launchers with `per_node` workers each (1 x 1: `ft train` alone).
struct Layout {
  // (A constructor, so {2, 1} leaves the model empty without -Wmissing-field-initializers.)
  Layout(int n = 1, int p = 1, std::string m = {}) : nodes(n), per_node(p), model(std::move(m)) {}
  int nodes = 1, per_node = 1;
  std::string model;  // --model (empty: tiny-demo's own shape)
  int world() const { return nodes * per_node; }
};

struct Job {
  std::string dir;  // its --output
  int code = -1;
  std::string output;
};

const std::vector<std::string>& base_sets() {
  static const std::vector<std::string> b =
      with(ft::test::small_run_sets(), {"train.max_steps=20", "train.log_every=1"});
  return b;
}

std::vector<std::string> device_sets() {
  return {on_gpu ? "hardware.device=cuda" : "hardware.device=cpu"};
}

// `ft train` of tiny-demo into `dir`. With several workers on one node each gets a host id of
// its own and LOCAL_RANK 0 (so all use cuda:0); the job's layout (LOCAL_WORLD_SIZE, node groups)
// is the launcher's.
std::vector<std::string> worker_argv(const Layout& l, const std::string& dir,
                                     const std::vector<std::string>& sets) {
  std::vector<std::string> args = {"--preset", "tiny-demo", "--output", dir};
  if (!l.model.empty()) args = with(args, {"--model", l.model});
  // A --model brings its own shape: the base sets' model.* keys are left out.
  std::vector<std::string> base;
  for (const auto& b : base_sets())
    if (l.model.empty() || b.rfind("model.", 0) != 0) base.push_back(b);
  std::vector<std::string> train =
      ft::test::ft_train_argv(args, with(with(base, device_sets()), sets));
  if (l.per_node == 1) return train;
  std::vector<std::string> sh = {
      "/bin/sh", "-c", "LOCAL_RANK=0 NCCL_HOSTID=ft-gpu-check-rank$RANK exec \"$0\" \"$@\""};
  return with(sh, train);
}

std::vector<std::string> node_argv(const Layout& l, int node, int port, const std::string& dir,
                                   const std::vector<std::string>& sets) {
  const std::vector<std::string> worker = worker_argv(l, dir, sets);
  if (l.world() == 1) return worker;
  return ft::test::ft_launch_argv(
      {"--nnodes", std::to_string(l.nodes), "--node-rank", std::to_string(node), "--nproc-per-node",
       std::to_string(l.per_node), "--master-addr", "127.0.0.1", "--master-port",
       std::to_string(port), "--max-restarts", std::to_string(max_restarts), "--heartbeat-timeout",
       "5", "--term-grace", "3", "--rdzv-timeout", "60"},
      worker);
}

ft::test::Child start_node(const Layout& l, int node, int port, const std::string& dir,
                           const std::vector<std::string>& sets,
                           const std::map<std::string, std::string>& extra_env = {}) {
  auto env = node_env(node);
  for (const auto& [k, v] : extra_env) env[k] = v;
  static int started = 0;
  return ft::test::start(node_argv(l, node, port, dir, sets), env,
                         fmt::format("{}.node{}.{}.log", dir, node, ++started));
}

std::vector<ft::test::Child> start_nodes(const Layout& l, const std::string& dir,
                                         const std::vector<std::string>& sets,
                                         const std::map<std::string, std::string>& extra_env) {
  const int port = ft::test::free_port();
  std::vector<ft::test::Child> nodes;
  for (int n = 0; n < l.nodes; ++n) nodes.push_back(start_node(l, n, port, dir, sets, extra_env));
  return nodes;
}

Job finish(std::vector<ft::test::Child>& nodes, const std::string& dir, double timeout_s) {
  Job j;
  j.dir = dir;
  j.code = 0;
  for (auto& c : nodes) {
    const auto rc = ft::test::wait_for(c, timeout_s);
    if (!rc) ft::test::kill_and_reap(c);
    j.output += c.output();
    if (rc.value_or(-1) != 0 && j.code == 0) j.code = rc.value_or(-1);
  }
  return j;
}

Job run(const Layout& l, const std::vector<std::string>& sets,
        const std::map<std::string, std::string>& extra_env = {}, std::string dir = "") {
  if (dir.empty()) dir = ft::test::make_temp_dir() + "/run";
  auto nodes = start_nodes(l, dir, sets, extra_env);
  return finish(nodes, dir, 240);
}

std::string describe(const Layout& l, const std::vector<std::string>& sets) {
  std::string s = fmt::format("{} node(s) x {}", l.nodes, l.per_node);
  for (const auto& v : sets)
    if (v.rfind("train.micro_batch", 0) != 0) s += " " + v;
  return s;
}

bool ran(const Job& j, const std::string& what) {
  expect(j.code == 0, what + ": exits 0");
  if (j.code != 0)
    fmt::print("--- its output (last 60 lines) ---\n{}\n", ft::test::output_tail(j.output));
  return j.code == 0;
}

// The largest relative difference of the losses, step by step, and of every tensor of `weights`
// in final/; both runs logged the same steps.
struct Diff {
  double loss = 1e300, weights = 1e300;
  bool same_bits = false;
};

Diff compare(const Job& ref, const Job& got, const std::string& weights) {
  Diff d;
  const auto a = ft::test::read_metrics(ref.dir), b = ft::test::read_metrics(got.dir);
  if (a.empty() || a.size() != b.size()) return d;
  d.loss = 0;
  d.same_bits = true;
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i]["loss"], lb = b[i]["loss"];
    d.loss = std::max(d.loss, std::abs(la - lb) / std::abs(la));
    d.same_bits = d.same_bits && la == lb;
  }
  const std::string fa = ref.dir + "/final/" + weights, fb = got.dir + "/final/" + weights;
  d.same_bits = d.same_bits && ft::test::read_file(fa) == ft::test::read_file(fb);
  auto sa = ft::io::SafetensorsFile::open(fa), sb = ft::io::SafetensorsFile::open(fb);
  if (sa.names() != sb.names()) return d;
  d.weights = 0;
  for (const auto& n : sa.names())
    d.weights = std::max(d.weights, ft::test::rel_error(sb.tensor(n), sa.tensor(n)));
  return d;
}

// Tolerances of a comparison: fp32's are the CPU tests' (1e-5). In bf16 another split of the
// batch rounds differently and Adam turns that into weight differences of a few percent of the
// largest weight (the CPU: losses 5e-5, weights 1e-2, LoRA adapters 5e-2 after 20 steps).
struct Tol {
  double loss, weights;
};
constexpr Tol kFp32{1e-5, 1e-5}, kBf16{1e-3, 1e-1};

// `got` follows `ref` within `tol` (losses and weights), and training moved the loss at all.
void check_follows(const Job& ref, const Job& got, const std::string& what, Tol tol,
                   const std::string& weights = "model.safetensors") {
  if (!ran(got, what)) return;
  const Diff d = compare(ref, got, weights);
  expect(d.loss <= tol.loss && d.weights <= tol.weights,
         fmt::format("{}: follows the 1-rank run (losses {:.2e} <= {:g}, weights {:.2e} <= {:g})",
                     what, d.loss, tol.loss, d.weights, tol.weights));
  const auto m = ft::test::read_metrics(got.dir);
  expect(!m.empty() && m.back()["loss"].get<double>() < m.front()["loss"].get<double>() - 0.1,
         what + ": the loss fell");
}

void check_same_bits(const Job& a, const Job& b, const std::string& what,
                     const std::string& weights = "model.safetensors") {
  if (!ran(a, what + " (without)") || !ran(b, what)) return;
  const Diff d = compare(a, b, weights);
  expect(d.same_bits, fmt::format("{}: the same losses and final model, bit for bit (losses "
                                  "{:.2e}, weights {:.2e})",
                                  what, d.loss, d.weights));
}

// NCCL's INIT lines of a job run with NCCL_DEBUG=INFO: it saw `nodes` hosts.
void check_nccl_nodes(const Job& j, int nodes) {
  if (!on_gpu) return;
  const std::string want = fmt::format("nNodes {}", nodes);
  expect(j.output.find(want) != std::string::npos,
         fmt::format("NCCL connected {} ranks as {} hosts ('{}' in its INIT lines)", nodes, nodes,
                     want));
}

const std::map<std::string, std::string> kNcclInfo = {{"NCCL_DEBUG", "INFO"},
                                                      {"NCCL_DEBUG_SUBSYS", "INIT"}};

// Every strategy at 2 and 4 ranks and HYBRID_SHARD 2 x 2 against one rank, in fp32 (the CPU
// tests' tolerance, 1e-5).
void group_fp32() {
  const std::vector<std::string> fp32 = {"precision.mode=fp32"};
  const Job ref = run({1, 1}, with(fp32, {"train.micro_batch=8"}));
  if (!ran(ref, "fp32, 1 rank")) return;
  struct Case {
    Layout l;
    std::vector<std::string> sets;
  };
  const std::vector<Case> cases = {
      {{2, 1}, {"strategy.kind=ddp"}},
      {{2, 1}, {"strategy.kind=ddp", "train.grad_accum=2"}},
      {{2, 1}, {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"}},
      {{2, 1}, {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=5000"}},
      {{2, 1}, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}},
      {{2, 1}, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP"}},
      {{2, 1}, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=NO_SHARD"}},
      {{2, 1}, {"strategy.kind=fsdp", "train.activation_checkpointing=full"}},
      {{4, 1}, {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"}},
      {{4, 1}, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}},
      {{2, 2}, {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=HYBRID_SHARD"}}};
  bool first2 = true, first4 = true;
  for (const Case& c : cases) {
    const int accum = c.sets.size() > 1 && c.sets[1] == "train.grad_accum=2" ? 2 : 1;
    const std::string mb = fmt::format("train.micro_batch={}", 8 / c.l.world() / accum);
    const bool info = (c.l.world() == 2 && first2) || (c.l.world() == 4 && first4);
    const Job j =
        run(c.l, with(with(fp32, c.sets), {mb}), info ? kNcclInfo : decltype(kNcclInfo){});
    check_follows(ref, j, "fp32, " + describe(c.l, c.sets), kFp32);
    if (info && j.code == 0) check_nccl_nodes(j, c.l.nodes);
    (c.l.world() == 2 ? first2 : first4) = false;
  }
}

// An offloaded job's gradient norms over its steps (metrics' time.grad_norm): how many the host
// thread took, and how many of those before the backward had ended (each reduction's output comes
// down on a side stream as soon as the reduction is issued). Printed, not checked: on a GPU the
// host queues a small model's backward faster than the reductions run.
void note_norms(const Job& j, const std::string& what) {
  int masters = 0, beside = 0, before_end = 0;
  for (const auto& r : ft::test::read_metrics(j.dir)) {
    if (!r.contains("time") || !r["time"].contains("grad_norm")) continue;
    const auto& n = r["time"]["grad_norm"];
    masters += n.value("masters", 0);
    beside += n.value("beside_backward", 0);
    before_end += n.value("before_backward_end", 0);
  }
  fmt::print("note {}: {} of {} gradient norms taken beside the backward, {} before its end\n",
             what, beside, masters, before_end);
}

// Offload at 2 ranks (bf16): the same job without it, bit for bit, and with clipping off (the
// update during the backward). offload_param and fsdp cpu_offload could not be checked on one
// rank (nothing to split).
void group_offload() {
  const std::vector<std::string> bf16 = {"precision.mode=bf16", "train.micro_batch=4"};
  // (A reduce-scatter per unit: each one's output comes down while the backward goes on.)
  const std::vector<std::string> z3 = {"strategy.kind=zero3",
                                       "strategy.zero3.param_persistence_threshold=0",
                                       "strategy.zero3.reduce_bucket_size=1"};
  const std::vector<std::string> fsdp = {"strategy.kind=fsdp"};
  const Job plain_z3 = run({2, 1}, with(bf16, z3));
  const Job off_z3 = run({2, 1}, with(with(bf16, z3), {"strategy.zero3.offload_optimizer=true"}));
  check_same_bits(plain_z3, off_z3, "bf16, 2 ranks, zero3 offload_optimizer");
  if (off_z3.code == 0) note_norms(off_z3, "bf16, 2 ranks, zero3 offload_optimizer");
  check_same_bits(plain_z3,
                  run({2, 1}, with(with(bf16, z3), {"strategy.zero3.offload_optimizer=true",
                                                    "strategy.zero3.offload_param=true"})),
                  "bf16, 2 ranks, zero3 offload_optimizer + offload_param");
  const Job plain_fsdp = run({2, 1}, with(bf16, fsdp));
  check_same_bits(plain_fsdp,
                  run({2, 1}, with(with(bf16, fsdp), {"strategy.fsdp.cpu_offload=true"})),
                  "bf16, 2 ranks, fsdp cpu_offload");
  // Clipping off: the host update begins during the backward, each unit's parameters going up
  // from the update's thread while the backward's kernels run.
  const std::vector<std::string> noclip = with(with(bf16, z3), {"train.grad_clip=0"});
  check_same_bits(run({2, 1}, noclip),
                  run({2, 1}, with(noclip, {"strategy.zero3.offload_optimizer=true"})),
                  "bf16, 2 ranks, zero3 offload_optimizer, grad_clip 0 (update during backward)");
}

void group_lora() {
  const std::vector<std::string> lora = {
      "precision.mode=fp32", "lora.enabled=true", "lora.r=4",
      "lora.alpha=8",        "lora.dropout=0",    "train.lr=3e-3"};
  const Job ref = run({1, 1}, with(lora, {"train.micro_batch=8"}));
  if (!ran(ref, "LoRA fp32, 1 rank")) return;
  for (const auto& v : std::vector<std::vector<std::string>>{
           {"strategy.kind=ddp"},
           {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
           {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}}) {
    check_follows(ref, run({2, 1}, with(with(lora, v), {"train.micro_batch=4"})),
                  "LoRA fp32, " + describe({2, 1}, v), kFp32, "adapter_model.safetensors");
  }
  // QLoRA (issue 33): the base's projections in NF4, dequantized on the GPU by
  // cuda/kernels.cu, their packed bytes sharded and gathered over NCCL under zero3.
  const std::vector<std::string> qlora = with(lora, {"lora.quantize_base=nf4"});
  const Job qref = run({1, 1}, with(qlora, {"train.micro_batch=8"}));
  if (!ran(qref, "QLoRA fp32, 1 rank")) return;
  const std::vector<std::string> z = {"strategy.kind=zero3",
                                      "strategy.zero3.param_persistence_threshold=0"};
  check_follows(qref, run({2, 1}, with(with(qlora, z), {"train.micro_batch=4"})),
                "QLoRA fp32, " + describe({2, 1}, z), kFp32, "adapter_model.safetensors");
}

// bf16 compute (fp32 masters), with bf16's tolerance (Tol); the figures are printed.
void group_bf16() {
  const std::vector<std::string> bf16 = {"precision.mode=bf16"};
  const Job ref = run({1, 1}, with(bf16, {"train.micro_batch=8"}));
  if (!ran(ref, "bf16, 1 rank")) return;
  for (const auto& v : std::vector<std::vector<std::string>>{
           {"strategy.kind=ddp"},
           {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
           {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"}}) {
    check_follows(ref, run({2, 1}, with(with(bf16, v), {"train.micro_batch=4"})),
                  "bf16, " + describe({2, 1}, v), kBf16);
  }
  const Job lora_ref = run({1, 1}, with(bf16, {"train.micro_batch=8", "lora.enabled=true",
                                               "lora.dropout=0", "train.lr=3e-3"}));
  if (ran(lora_ref, "LoRA bf16, 1 rank"))
    check_follows(
        lora_ref,
        run({2, 1}, with(bf16, {"train.micro_batch=4", "lora.enabled=true", "lora.dropout=0",
                                "train.lr=3e-3", "strategy.kind=fsdp"})),
        "LoRA bf16, 2 node(s) x 1 fsdp", kBf16, "adapter_model.safetensors");
}

// A mixture-of-experts fixture (tests/model/fixtures/moe) as the jobs' --model.
std::string moe_fixture(const std::string& name) {
  return std::string(FT_TEST_DIR) + "/model/fixtures/moe/" + name;
}

// bf16 on the GPU, where moe.grouped_mm's auto runs the experts as LibTorch's grouped GEMM: at 1
// rank against one product per expert (moe.grouped_mm=off), and under EP 2 across 2 "nodes" (fsdp)
// against the 1-rank run, within bf16's tolerances.
void group_moe_grouped_mm(const std::string& model) {
  const std::vector<std::string> bf16 = {"precision.mode=bf16", "moe.aux_loss_scope=global",
                                         "train.grad_accum=1"};
  // auto says on stderr when it falls back to one product per expert.
  auto grouped_ran = [](const Job& j, const std::string& what) {
    expect(j.output.find("moe.grouped_mm=auto: the experts run one product") == std::string::npos,
           what + ": the grouped GEMM ran (no fallback warning)");
  };
  const Job grouped = run({1, 1, model}, with(bf16, {"train.micro_batch=8"}));
  if (!ran(grouped, "MoE bf16, grouped GEMM, 1 rank")) return;
  grouped_ran(grouped, "MoE bf16, 1 rank");
  check_follows(grouped,
                run({1, 1, model}, with(bf16, {"train.micro_batch=8", "moe.grouped_mm=off"})),
                "MoE bf16, one product per expert (moe.grouped_mm=off), 1 rank", kBf16);
  const Job ep =
      run({2, 1, model},
          with(bf16, {"train.micro_batch=4", "strategy.kind=fsdp", "strategy.expert_parallel=2"}));
  check_follows(grouped, ep, "MoE bf16, grouped GEMM, EP 2, 2 node(s) x 1 fsdp", kBf16);
  grouped_ran(ep, "MoE bf16, EP 2, fsdp");
}

// Mixture of experts over NCCL (issue 31): expert parallelism's all-to-all with EP 2 across two
// "nodes" and inside one (2 workers), under zero3 and fsdp, full and with LoRA on the experts and
// the routers trained. Losses follow the 1-rank run (1e-5, the aux loss counted over the global
// batch so that every split sees the same); the final weights follow 2 data-parallel ranks
// without EP, whose split of the batch is the same (the CPU test's 1e-4; adapters 1e-3: Adam
// magnifies the order of sums in their first tiny gradients).
void group_moe() {
  const std::string model = moe_fixture("mixtral_tiny");  // 4 experts: 2 on each EP rank
  const std::vector<std::string> base = {"precision.mode=fp32", "moe.aux_loss_scope=global",
                                         "train.grad_accum=1"};
  const std::vector<std::string> lora = {
      "lora.enabled=true", "lora.dropout=0", "train.lr=3e-3", "lora.train_router=true",
      R"(lora.target_parameters=["mlp.experts.gate_up_proj","mlp.experts.down_proj"])"};
  for (const bool adapters : {false, true}) {
    const std::vector<std::string> sets = adapters ? with(base, lora) : base;
    const std::string what = adapters ? "MoE LoRA (experts, router) fp32" : "MoE fp32";
    const std::string weights = adapters ? "adapter_model.safetensors" : "model.safetensors";
    const Job ref = run({1, 1, model}, with(sets, {"train.micro_batch=8"}));
    const Job dp = run({2, 1, model}, with(sets, {"train.micro_batch=4"}));
    if (!ran(ref, what + ", 1 rank") || !ran(dp, what + ", 2 ranks without EP")) continue;
    struct Case {
      Layout l;
      std::vector<std::string> sets;
    };
    for (const Case& c : std::vector<Case>{
             {{2, 1, model},
              {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"}},
             {{2, 1, model}, {"strategy.kind=fsdp"}},
             {{1, 2, model}, {"strategy.kind=fsdp"}},
             // World 4: the experts split over the 2 ranks holding them, gathered with their layer.
             {{2, 2, model}, {"strategy.kind=fsdp"}},
             {{4, 1, model},
              {"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"}}}) {
      const std::string label = what + ", EP 2, " + describe(c.l, c.sets);
      const Job j =
          run(c.l, with(with(sets, c.sets), {"train.micro_batch=" + std::to_string(8 / c.l.world()),
                                             "strategy.expert_parallel=2"}));
      if (!ran(j, label)) continue;
      const Diff to_one = compare(ref, j, weights), to_dp = compare(dp, j, weights);
      const double wtol = adapters ? 1e-3 : 1e-4;
      expect(to_one.loss <= kFp32.loss && to_dp.weights <= wtol,
             fmt::format("{}: losses follow the 1-rank run ({:.2e} <= {:g}), weights the 2 ranks "
                         "without EP ({:.2e} <= {:g})",
                         label, to_one.loss, kFp32.loss, to_dp.weights, wtol));
      const auto m = ft::test::read_metrics(j.dir);
      expect(!m.empty() && m.back()["moe"]["exchange"]["bytes_sent"].get<int64_t>() > 0,
             label + ": rows left the rank (moe.exchange)");
    }
  }
  group_moe_grouped_mm(model);
}

// Node 1's launcher killed with SIGKILL after a random number of steps; the same command again:
// the job resumes from its newest checkpoint and ends exactly as the uninterrupted job. A copy of
// the killed job's directory resumes on one rank (resharded) and ends within bf16's tolerance.
void group_resume() {
  const std::vector<std::string> sets = {"precision.mode=bf16",
                                         "train.max_steps=40",
                                         "output.save_every=4",
                                         "output.keep_last=3",
                                         "train.micro_batch=4",
                                         "strategy.kind=zero3",
                                         "strategy.zero3.param_persistence_threshold=0"};
  const Layout two{2, 1};
  max_restarts = 2;
  const Job ref = run(two, sets);
  if (!ran(ref, "resume: the uninterrupted 2-node job")) return;
  std::mt19937 gen(std::random_device{}());
  const size_t kill_after = 6 + gen() % 20;
  const std::string dir = ft::test::make_temp_dir() + "/run";
  const int port = ft::test::free_port();
  std::vector<ft::test::Child> nodes = {start_node(two, 0, port, dir, sets),
                                        start_node(two, 1, port, dir, sets)};
  ft::test::wait_for_steps(dir, kill_after,
                           std::chrono::steady_clock::now() + std::chrono::seconds(120));
  ::kill(nodes[1].pid, SIGKILL);
  expect(ft::test::wait_for(nodes[1], 30).value_or(-1) == 128 + SIGKILL,
         fmt::format("resume: node 1's launcher killed with SIGKILL after {} steps", kill_after));
  // Node 0 stops its worker and waits for node 1 in a new round; then a copy of what was saved.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (nodes[0].output().find("round 1: waiting for nodes") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  expect(nodes[0].output().find("round 1: waiting for nodes") != std::string::npos,
         "resume: node 0 lost node 1 and waits for it in a new round");
  const std::string copy = ft::test::make_temp_dir() + "/run";
  std::filesystem::copy(dir, copy, std::filesystem::copy_options::recursive);
  std::vector<ft::test::Child> job = {nodes[0], start_node(two, 1, port, dir, sets)};
  const Job resumed = finish(job, dir, 240);
  if (ran(resumed, "resume: node 1 started again, the job finished")) {
    expect(resumed.output.find("resuming from") != std::string::npos,
           "resume: it resumed from a checkpoint");
    check_same_bits(ref, resumed, "resume on the same layout (2 nodes)");
  }
  const Job one = run({1, 1}, with(sets, {"train.micro_batch=8"}), {}, copy);
  if (ran(one, "resume: the killed job's copy on 1 rank")) {
    expect(one.output.find("resuming from") != std::string::npos,
           "resume on 1 rank: it resumed from the 2-rank checkpoint");
    check_follows(ref, one, "resume on 1 rank (resharded)", kBf16);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* dev = std::getenv("FT_GPU_CHECK_DEVICE");
  on_gpu = !(dev && std::string(dev) == "cpu");
  if (on_gpu) {
    const ft::cuda::DeviceProbe p = ft::cuda::probe_devices();
    if (!p.cuda_compiled || p.visible_gpus == 0) {
      fmt::print(
          "SKIP: no GPU visible to the CUDA driver (this test needs one; "
          "FT_GPU_CHECK_DEVICE=cpu runs its jobs on the CPU)\n");
      return 77;
    }
  }
  std::set<std::string> groups(argv + 1, argv + argc);
  auto want = [&](const std::string& g) { return groups.empty() || groups.count(g) > 0; };
  try {
    if (want("fp32")) group_fp32();
    if (want("offload")) group_offload();
    if (want("lora")) group_lora();
    if (want("bf16")) group_bf16();
    if (want("resume")) group_resume();
    if (want("moe")) group_moe();
  } catch (const std::exception& e) {
    fmt::print("FAIL: {}\n", e.what());
    return 1;
  }
  fmt::print("{}\n", failures ? fmt::format("{} check(s) failed", failures) : "all checks held");
  return failures ? 1 : 0;
}

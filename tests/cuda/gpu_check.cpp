// The gpu test: needs one visible GPU, else prints SKIP and exits 77 (CTest shows it skipped). On
// cuda:0 it forms a world-size-1 NCCL process group (in-process store) and a subgroup, checks the
// collectives the engine uses (all-reduce SUM and MAX on fp64 scalars, all-gather and
// reduce-scatter into flat buffers) and the memory and seeding entry points, then runs `ft train`
// on the GPU in bf16 and checks its metrics; offloaded runs (zero3 offload_optimizer /
// offload_param, fsdp cpu_offload) against the same runs without offload, bit for bit; and a run
// killed with SIGKILL at a random step, resumed on the GPU, against an uninterrupted one; `ft
// doctor` and MFU on the GPU; the fused CUDA kernels against the unfused ops; MoE's experts as the
// grouped GEMM against one product per expert. Exits 0 when every check held, 1 otherwise.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/dist_env.h"
#include "comm/process_group.h"
#include "cuda/device.h"
#include "cuda/loader.h"
#include "model/fused_ops.h"
#include "model/moe.h"
#include "model/nf4.h"
#include "model/quantized_linear.h"
#include "support/runs.h"
#include "support/subprocess.h"

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  fmt::print("{} {}\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

void check_collectives() {
  ft::comm::DistEnv env;  // world size 1, no launcher: an in-process store
  ft::comm::ProcessGroupOptions o;
  o.device = c10::Device(c10::kCUDA, 0);
  ft::comm::ProcessGroup world(env, o);
  expect(std::string(world.backend_name()) == "NCCL", "the world group is NCCL");
  const auto opts = at::TensorOptions().device(o.device);

  std::vector<at::Tensor> t{at::full({1}, 2.5, opts.dtype(at::kDouble))};
  world.backend().allreduce(t)->wait();
  expect(t[0].item<double>() == 2.5, "all-reduce SUM of an fp64 scalar");
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  world.backend().allreduce(t, max)->wait();
  expect(t[0].item<double>() == 2.5, "all-reduce MAX");

  at::Tensor shard = at::arange(8, opts.dtype(at::kBFloat16));
  at::Tensor full = at::empty({8}, shard.options());
  world.backend()._allgather_base(full, shard)->wait();
  expect(full.equal(shard), "all-gather into a flat bf16 buffer");
  at::Tensor out = at::empty({8}, opts.dtype(at::kFloat));
  at::Tensor in = at::arange(8, opts.dtype(at::kFloat));
  world.backend()._reduce_scatter_base(out, in)->wait();
  expect(out.equal(in), "reduce-scatter of an fp32 buffer");

  auto sub = world.subgroup("check", {0});
  std::vector<at::Tensor> s{at::ones({4}, opts.dtype(at::kFloat))};
  sub->backend().allreduce(s)->wait();
  expect(s[0].sum().item<double>() == 4, "a subgroup on a prefix of the store");

  const ft::cuda::Api& api = ft::cuda::api();
  api.synchronize(0);
  const auto m = api.memory(0, /*reset_peak=*/true);
  expect(m.allocated_bytes > 0 && m.reserved_bytes >= m.allocated_bytes &&
             m.peak_allocated_bytes >= m.allocated_bytes,
         fmt::format("memory figures ({} allocated, {} reserved, {} peak)", m.allocated_bytes,
                     m.reserved_bytes, m.peak_allocated_bytes));
  api.manual_seed(7);
  at::Tensor a = at::rand({16}, opts);
  api.manual_seed(7);
  expect(a.equal(at::rand({16}, opts)), "manual_seed makes the CUDA generator repeat");
}

void check_train() {
  namespace fs = std::filesystem;
  const std::string dir = ft::test::make_temp_dir();
  const ft::test::Finished train = ft::test::run_to_end(
      {ft::test::ft_bin(), "train", "--preset", "tiny-demo", "--output", dir + "/run", "--set",
       "hardware.device=cuda", "--set", "precision.mode=bf16", "--set", "train.max_steps=5"},
      {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}}, dir + "/train.log", 300);
  const std::string& log = train.output;
  expect(train.code == 0, "ft train --set hardware.device=cuda bf16 exits 0");
  expect(log.find("ft train: device cuda:0") != std::string::npos, "it trained on cuda:0");
  const std::string metrics = ft::test::read_file(dir + "/run/metrics.jsonl");
  expect(metrics.find("\"cuda_peak_allocated_bytes\"") != std::string::npos,
         "metrics.jsonl reports GPU memory");
  expect(fs::exists(dir + "/run/final/model.safetensors"), "the final model is written");
  if (failures) fmt::print("--- ft train output ---\n{}\n", log);
}

// `ft eval` on the GPU against the CPU's loss (issue 34): the bitsandbytes-saved NF4 fixture with
// its PEFT adapter (QLoRA's CUDA dequantization inside), and its fp32 base, on pre-tokenized
// records.
void check_eval() {
  const std::string dir = ft::test::make_temp_dir(),
                    fx = std::string(FT_TEST_DIR) + "/model/fixtures/qlora/";
  {
    std::ofstream f(dir + "/eval.jsonl");
    for (int r = 0; r < 6; ++r) {
      f << "{\"input_ids\": [";
      for (int i = 0; i < 20 + 7 * r; ++i) f << (i ? ", " : "") << (r * 37 + i * 11) % 127 + 1;
      f << "]}\n";
    }
  }
  auto loss = [&](const std::vector<std::string>& model, const std::string& device) {
    std::vector<std::string> a = {ft::test::ft_bin(),
                                  "eval",
                                  "--data",
                                  dir + "/eval.jsonl",
                                  "--set",
                                  "data.format=tokenized",
                                  "--set",
                                  "hardware.device=" + device};
    a.insert(a.end(), model.begin(), model.end());
    const ft::test::Finished f = ft::test::run_to_end(a, {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}},
                                                      dir + "/eval-" + device + ".log", 120);
    const auto at = f.output.rfind("{\"");
    const auto j =
        nlohmann::json::parse(at == std::string::npos ? "" : f.output.substr(at), nullptr, false);
    if (f.code != 0 || j.is_discarded()) fmt::print("--- ft eval output ---\n{}\n", f.output);
    return std::make_pair(j.is_discarded() ? -1.0 : j.value("loss", -1.0),
                          j.is_discarded() ? std::string() : j.value("device", std::string()));
  };
  for (const auto& [what, model] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"fp32 model", {"--model", fx + "llama_base"}},
           {"NF4 model + PEFT adapter",
            {"--model", fx + "llama_nf4", "--adapter", fx + "llama_adapter"}}}) {
    const auto [cpu, on_cpu] = loss(model, "cpu");
    const auto [gpu, on_gpu] = loss(model, "cuda");
    expect(cpu > 0 && gpu > 0 && on_gpu == "cuda:0" && std::abs(gpu - cpu) <= 1e-5 * cpu,
           fmt::format("ft eval on the GPU equals the CPU's loss, {} ({:.8f} on {}, {:.8f} on {})",
                       what, gpu, on_gpu, cpu, on_cpu));
  }
}

// `ft doctor --preset tiny-demo` on one GPU (issue 15's GPU paths): the topology through NVML,
// host-to-device bandwidth, the bf16 matmul against the table's peak, the probe on the GPU, and
// the MFU `ft train` reports against the table.
void check_doctor() {
  const std::string dir = ft::test::make_temp_dir();
  const ft::test::Finished doc = ft::test::run_to_end(
      {ft::test::ft_bin(), "doctor", "--preset", "tiny-demo", "--set", "hardware.device=cuda",
       "--set", "precision.mode=bf16", "--json", dir + "/doctor.json"},
      {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}}, dir + "/doctor.log", 300);
  expect(doc.code == 0, "ft doctor on one GPU exits 0");
  const std::string j = ft::test::read_file(dir + "/doctor.json");
  expect(j.find("\"gpu_topology\"") != std::string::npos, "it shows the GPU topology (NVML)");
  const auto json = nlohmann::json::parse(j, nullptr, false);
  if (!json.is_discarded() && json.contains("devices")) {
    const auto& d = json["devices"][0];
    expect(d["h2d_bytes_per_s"].get<double>() > 5e9, "host to device above 5 GB/s");
    expect(d["matmul_flops_per_s"].get<double>() > 100e12, "bf16 matmul above 100 TFLOP/s");
  }
  expect(json.contains("prediction"), "the step-time model ran on the GPU");
  const ft::test::Finished train = ft::test::run_to_end(
      {ft::test::ft_bin(), "train", "--preset", "tiny-demo", "--output", dir + "/run", "--set",
       "hardware.device=cuda", "--set", "precision.mode=bf16", "--set", "train.max_steps=5"},
      {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}}, dir + "/train.log", 300);
  expect(train.output.find("MFU against") != std::string::npos &&
             train.output.find("table:") != std::string::npos,
         "ft train's MFU is against the table's peak for this GPU");
  if (failures) fmt::print("--- ft doctor output ---\n{}\n", doc.output);
}

// `ft train` of tiny-demo on cuda:0 in bf16 with the job tests' small model and `sets` after them.
std::vector<std::string> gpu_train(const std::string& out, const std::vector<std::string>& sets) {
  return ft::test::ft_train_argv(
      {"--preset", "tiny-demo", "--output", out},
      ft::test::with(ft::test::small_run_sets(),
                     ft::test::with({"hardware.device=cuda", "precision.mode=bf16"}, sets)));
}

const std::map<std::string, std::string> kNoLauncher = {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}};

ft::test::Finished run_gpu(const std::vector<std::string>& argv, const std::string& log) {
  return ft::test::run_to_end(argv, kNoLauncher, log, 300);
}

// Same losses (exactly) at every step and the same final model bytes.
// The fused CUDA kernels (cuda/kernels.h) against the unfused ops on the GPU: outputs and
// gradients, fp32 within 1e-5 and bf16 within 2e-2 relative (GPU expf and sums in another order
// than the CPU's).
void check_fused_kernels() {
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
           std::max(b.to(at::kDouble).abs().max().item<double>(), 1e-30);
  };
  auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const auto o = at::TensorOptions().device(at::kCUDA, 0).dtype(dtype);
    const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
    const std::string name = dtype == at::kFloat ? "fp32" : "bf16";
    const at::Tensor x0 = at::randn({300, 520}, o), d0 = at::randn({300, 520}, o);
    const at::Tensor w0 = at::randn({520}, o) * 0.5 + 1, gy = at::randn({300, 520}, o);
    {
      at::Tensor h = leaf(x0), d = leaf(d0), w = leaf(w0), hr = leaf(x0), dr = leaf(d0),
                 wr = leaf(w0);
      auto [s, y] = ft::model::fused_add_rms_norm(h, d, w, 1e-5);
      at::Tensor sr = hr + dr;
      at::Tensor yr = at::rms_norm(sr.to(at::kFloat), {520}, c10::nullopt, 1e-5).to(dtype) * wr;
      ((y * gy).sum() + s.sum()).backward();
      ((yr * gy).sum() + sr.sum()).backward();
      expect(
          rel(y, yr) <= tol && rel(h.grad(), hr.grad()) <= tol && rel(w.grad(), wr.grad()) <= tol,
          "fused residual add + RMSNorm on the GPU equals the unfused ops (" + name + ")");
    }
    {
      at::Tensor g = leaf(x0 * 3), u = leaf(d0), gr = leaf(x0 * 3), ur = leaf(d0);
      at::Tensor y = ft::model::fused_swiglu(g, u), yr = at::silu(gr) * ur;
      (y * gy).sum().backward();
      (yr * gy).sum().backward();
      expect(
          rel(y, yr) <= tol && rel(g.grad(), gr.grad()) <= tol && rel(u.grad(), ur.grad()) <= tol,
          "fused SwiGLU on the GPU equals silu(gate) * up (" + name + ")");
    }
    {
      const at::Tensor q0 = at::randn({2, 50, 4, 64}, o), ang = at::randn({2, 50, 32}, o) * 3;
      const at::Tensor emb = at::cat({ang, ang}, -1), cos = emb.cos(), sin = emb.sin();
      at::Tensor q = leaf(q0), qr = leaf(q0);
      at::Tensor y = ft::model::fused_rope(q, cos, sin);
      at::Tensor rh = at::cat({-qr.slice(-1, 32), qr.slice(-1, 0, 32)}, -1);
      at::Tensor yr = qr * cos.unsqueeze(2) + rh * sin.unsqueeze(2);
      (y * y.detach()).sum().backward();
      (yr * y.detach()).sum().backward();
      expect(
          rel(y, yr) <= tol && rel(q.grad(), qr.grad()) <= tol,
          "fused rotary embedding on the GPU equals x * cos + rotate_half(x) * sin (" + name + ")");
    }
  }
}

// QLoRA (issue 33): the CUDA NF4 kernel gives the host's values bit for bit (fp32, bf16, fp16),
// and an NF4 projection's forward and input gradient on the GPU follow the dense product.
void check_nf4() {
  const at::Tensor w = at::randn({300, 192}) * 0.05;  // 900 blocks, not a multiple of 256
  for (const bool dq : {false, true}) {
    const ft::model::Nf4Weight q = ft::model::quantize_nf4(w, dq);
    const ft::model::Nf4Shape s = ft::model::nf4_shape(q);
    const at::Tensor blob = ft::model::nf4_blob(q), on_gpu = blob.to(at::Device(at::kCUDA, 0));
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf})
      expect(at::equal(ft::model::dequantize_blob(on_gpu.view(dtype), s, dtype).cpu(),
                       ft::model::dequantize_blob(blob.view(dtype), s, dtype)),
             fmt::format("NF4 dequantized on the GPU equals the host's bits ({}, double quant {})",
                         c10::toString(dtype), dq));
    const at::Tensor x = at::randn({4, 33, 192}, at::Device(at::kCUDA, 0)).requires_grad_(true);
    const at::Tensor xr = x.detach().clone().requires_grad_(true);
    const at::Tensor dense = ft::model::dequantize_nf4(q, at::kFloat).to(x.device());
    const at::Tensor y = ft::model::nf4_linear(x, on_gpu.view(at::kFloat), s);
    const at::Tensor yr = at::linear(xr, dense);
    y.sum().backward();
    yr.sum().backward();
    const double err = ((y - yr).abs().max() / yr.abs().max()).item<double>() +
                       ((x.grad() - xr.grad()).abs().max() / xr.grad().abs().max()).item<double>();
    expect(err < 1e-5, fmt::format("NF4 projection on the GPU: forward and input gradient follow "
                                   "the dense product (relative {:.1e})",
                                   err));
  }
}

bool same_run(const std::string& a, const std::string& b, const std::string& what) {
  const auto ma = ft::test::read_metrics(a), mb = ft::test::read_metrics(b);
  bool ok = !ma.empty() && ma.size() == mb.size();
  for (size_t i = 0; ok && i < ma.size(); ++i) ok = ma[i]["loss"] == mb[i]["loss"];
  expect(ok, what + ": the same loss at every step (" + std::to_string(ma.size()) + " steps)");
  const bool same_model = ft::test::read_file(a + "/final/model.safetensors") ==
                          ft::test::read_file(b + "/final/model.safetensors");
  expect(same_model, what + ": the same final model, byte for byte");
  return ok && same_model;
}

double median_step_s(const std::string& dir) {
  std::vector<double> t;
  for (const auto& m : ft::test::read_metrics(dir)) t.push_back(m["step_time_s"].get<double>());
  if (t.empty()) return 0;
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Offload moves state to the host and runs the optimizer there; the results must not move.
void check_offload() {
  struct Variant {
    std::vector<std::string> plain, offload;
  };
  const std::vector<std::string> steps = {"train.max_steps=6", "train.log_every=1",
                                          "train.micro_batch=4", "train.grad_accum=2"};
  // On one GPU only the optimizer can be offloaded: offload_param and fsdp cpu_offload keep
  // parameter shards on the host, and one rank has nothing to split (they need 2 GPUs).
  for (const auto& v : std::vector<Variant>{
           {{"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"},
            {"strategy.zero3.offload_optimizer=true"}},
           {{"strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=5000"},
            {"strategy.zero3.offload_optimizer=true"}},
           {{"strategy.kind=zero3", "precision.mode=fp16"},
            {"strategy.zero3.offload_optimizer=true"}}}) {
    const std::string dir = ft::test::make_temp_dir();
    const std::string what = v.plain[1] + " + " + v.offload[0];
    const auto plain =
        run_gpu(gpu_train(dir + "/plain", ft::test::with(steps, v.plain)), dir + "/plain.log");
    const auto off =
        run_gpu(gpu_train(dir + "/off", ft::test::with(ft::test::with(steps, v.plain), v.offload)),
                dir + "/off.log");
    expect(plain.code == 0 && off.code == 0, what + ": both runs exit 0");
    if (plain.code != 0 || off.code != 0) {
      fmt::print("--- without offload ---\n{}\n--- with ---\n{}\n", plain.output, off.output);
      continue;
    }
    same_run(dir + "/plain", dir + "/off", what);
    fmt::print("     median step {:.4f} s without offload, {:.4f} s with\n",
               median_step_s(dir + "/plain"), median_step_s(dir + "/off"));
  }
}

// SIGKILL after a random number of steps, the same command again: it resumes from its newest
// checkpoint (GPU generator state included) and ends exactly as the uninterrupted run.
void check_resume() {
  const std::vector<std::string> sets = {"train.max_steps=60", "output.save_every=4",
                                         "output.keep_last=3", "train.log_every=1"};
  const std::string dir = ft::test::make_temp_dir();
  const auto ref = run_gpu(gpu_train(dir + "/ref", sets), dir + "/ref.log");
  expect(ref.code == 0, "resume: the uninterrupted run exits 0");
  if (ref.code != 0) {
    fmt::print("{}\n", ref.output);
    return;
  }
  std::mt19937 gen(std::random_device{}());
  const size_t kill_after = 4 + gen() % 27;  // after a checkpoint, long before the end
  const std::string out = dir + "/run";
  ft::test::Child c = ft::test::start(gpu_train(out, sets), kNoLauncher, dir + "/run.log");
  ft::test::wait_for_steps(out, kill_after,
                           std::chrono::steady_clock::now() + std::chrono::seconds(120));
  ::kill(c.pid, SIGKILL);
  expect(ft::test::wait_for(c, 30).value_or(-1) == 128 + SIGKILL,
         fmt::format("resume: killed with SIGKILL after {} steps", kill_after));
  const auto again = run_gpu(gpu_train(out, sets), dir + "/again.log");
  expect(again.code == 0 && again.output.find("resuming from") != std::string::npos,
         "resume: the same command resumes from a checkpoint and exits 0");
  if (again.code != 0) fmt::print("{}\n", again.output);
  same_run(dir + "/ref", out, "resume");
}

// One MoE block's forward and backward on the GPU: {out, dx, dgate_up, ddown}.
std::array<at::Tensor, 4> moe_pass(const ft::model::MoeWeights& w, const ft::model::MoeConfig& c,
                                   const at::Tensor& x, const at::Tensor& gy,
                                   ft::model::GroupedMm mode) {
  ft::model::MoeOptions o;
  o.grouped_mm = mode;
  const at::Tensor xi = x.detach().requires_grad_(true);
  const at::Tensor out = ft::model::moe_forward(w, c, xi, o);
  (out * gy).sum().backward();
  std::array<at::Tensor, 4> r{out.detach(), xi.grad(), w.gate_up.grad().clone(),
                              w.down.grad().clone()};
  w.gate_up.mutable_grad() = at::Tensor();
  w.down.mutable_grad() = at::Tensor();
  return r;
}

// MoE's experts as LibTorch's grouped GEMM on the GPU (moe.grouped_mm; issue 31): in bf16 (what
// auto takes there) and fp32 (on) against one product per expert, forward and backward, an
// expert no token chose with a zero gradient; then the time of both at a Mixtral-like layer.
void check_grouped_mm() {
  using ft::model::GroupedMm;
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
           std::max(b.to(at::kDouble).abs().max().item<double>(), 1e-30);
  };
  auto block = [](at::ScalarType dtype, int64_t E, int64_t H, int64_t I, int64_t tokens) {
    ft::model::MoeConfig c;
    c.num_experts = E;
    c.experts_per_token = 2;
    c.expert_intermediate = I;
    const auto o = at::TensorOptions().device(at::kCUDA, 0).dtype(dtype);
    ft::model::MoeWeights w;
    w.router = at::randn({E, H}, o);
    w.router[E - 1].fill_(-50);  // never chosen for the positive inputs
    w.gate_up = (at::randn({E, 2 * I, H}, o) * 0.05).requires_grad_(true);
    w.down = (at::randn({E, H, I}, o) * 0.05).requires_grad_(true);
    return std::tuple{c, w, at::randn({2, tokens / 2, H}, o).abs()};
  };
  for (const auto dtype : {at::kBFloat16, at::kFloat}) {
    const std::string name = dtype == at::kFloat ? "fp32, moe.grouped_mm=on" : "bf16, auto";
    const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
    auto [c, w, x] = block(dtype, 8, 256, 512, 600);
    const at::Tensor gy = at::randn(x.sizes(), x.options());
    const auto ref = moe_pass(w, c, x, gy, GroupedMm::kOff);
    const auto got = moe_pass(w, c, x, gy, dtype == at::kFloat ? GroupedMm::kOn : GroupedMm::kAuto);
    double worst = 0;
    for (size_t i = 0; i < 4; ++i) worst = std::max(worst, rel(got[i], ref[i]));
    expect(worst <= tol && got[2][7].abs().max().item<double>() == 0 &&
               got[3][7].abs().max().item<double>() == 0,
           fmt::format("MoE experts as the grouped GEMM on the GPU equal one product per expert "
                       "({}: {:.2e} <= {:g}; the unchosen expert's gradient zero)",
                       name, worst, tol));
  }
  // A Mixtral-like layer (8 experts, hidden 1024, intermediate 3584, top 2) over 8192 tokens;
  // .item() waits for the device.
  auto [c, w, x] = block(at::kBFloat16, 8, 1024, 3584, 8192);
  const at::Tensor gy = at::randn(x.sizes(), x.options());
  std::array<double, 2> ms{};
  for (int round = 0; round < 2; ++round)  // the first warms up
    for (const GroupedMm mode : {GroupedMm::kOff, GroupedMm::kAuto}) {
      const auto t0 = std::chrono::steady_clock::now();
      double sink = 0;
      for (int i = 0; i < 5; ++i) sink += moe_pass(w, c, x, gy, mode)[3].sum().item<double>();
      ms[mode == GroupedMm::kAuto ? 1 : 0] =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
          5;
      (void)sink;
    }
  fmt::print(
      "time MoE layer forward + backward, bf16, 8 x [1024 x 3584] experts, 8192 tokens: "
      "grouped GEMM {:.2f} ms, one product per expert {:.2f} ms\n",
      ms[1], ms[0]);
}

}  // namespace

// test_cuda_gpu [CHECK...]: collectives kernels grouped nf4 eval train offload resume doctor
// (default: all).
int main(int argc, char** argv) {
  const ft::cuda::DeviceProbe p = ft::cuda::probe_devices();
  if (!p.cuda_compiled || p.visible_gpus == 0) {
    fmt::print("SKIP: no GPU visible to the CUDA driver (this test needs one)\n");
    return 77;
  }
  const std::vector<std::string> only(argv + 1, argv + argc);
  auto want = [&](const std::string& c) {
    return only.empty() || std::find(only.begin(), only.end(), c) != only.end();
  };
  try {
    ft::cuda::use_device(0);
    if (want("collectives")) check_collectives();
    if (want("kernels")) check_fused_kernels();
    if (want("grouped")) check_grouped_mm();
    if (want("nf4")) check_nf4();
    if (want("eval")) check_eval();
    if (want("train")) check_train();
    if (want("offload")) check_offload();
    if (want("resume")) check_resume();
    if (want("doctor")) check_doctor();
  } catch (const std::exception& e) {
    fmt::print("FAIL: {}\n", e.what());
    return 1;
  }
  fmt::print("{}\n", failures ? fmt::format("{} check(s) failed", failures) : "all checks held");
  return failures ? 1 : 0;
}

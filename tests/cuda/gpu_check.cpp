// The gpu test: needs one visible GPU, else prints SKIP and exits 77 (CTest shows it skipped). On
// cuda:0 it forms a world-size-1 NCCL process group (in-process store) and a subgroup, checks the
// collectives the engine uses (all-reduce SUM and MAX on fp64 scalars, all-gather and
// reduce-scatter into flat buffers) and the memory and seeding entry points, then runs `ft train`
// on the GPU in bf16 and checks its metrics. Exits 0 when every check held, 1 otherwise.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <filesystem>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "cuda/device.h"
#include "cuda/loader.h"
#include "comm/dist_env.h"
#include "comm/process_group.h"
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

}  // namespace

int main() {
  const ft::cuda::DeviceProbe p = ft::cuda::probe_devices();
  if (!p.cuda_compiled || p.visible_gpus == 0) {
    fmt::print("SKIP: no GPU visible to the CUDA driver (this test needs one)\n");
    return 77;
  }
  try {
    ft::cuda::use_device(0);
    check_collectives();
    check_train();
  } catch (const std::exception& e) {
    fmt::print("FAIL: {}\n", e.what());
    return 1;
  }
  fmt::print("{}\n", failures ? fmt::format("{} check(s) failed", failures) : "all checks held");
  return failures ? 1 : 0;
}

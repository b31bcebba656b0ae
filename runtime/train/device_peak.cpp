#include "train/device_peak.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <chrono>
#include <sstream>
#include <vector>

#include "core/dtype.h"
#include "cuda/loader.h"

namespace ft::train {

namespace {

// Dense (no sparsity) bf16 = fp16 tensor-core peaks from the vendors' data sheets, TFLOP/s. A
// GPU matches an entry when its name has the entry's model word and, where given, its variant word.
struct KnownGpu {
  const char* model;
  const char* variant;  // "" = any
  double tflops;
};
constexpr KnownGpu kKnownGpus[] = {
    {"GH200", "", 989}, {"H100", "PCIe", 756}, {"H100", "NVL", 835}, {"H100", "", 989},
    {"H200", "", 989},  {"H800", "", 989},     {"B200", "", 2250},   {"B100", "", 1750},
    {"A100", "", 312},  {"A800", "", 312},     {"L40S", "", 362},    {"L40", "", 181},
    {"L4", "", 121},    {"A10", "", 125},      {"V100", "", 125},
};

// The words of a driver's device name ("NVIDIA A100-SXM4-80GB" -> NVIDIA, A100, SXM4, 80GB).
std::vector<std::string> words(const std::string& name) {
  std::vector<std::string> out;
  std::string w;
  for (char c : name + " ") {
    if (c == ' ' || c == '-' || c == '_') {
      if (!w.empty()) out.push_back(w);
      w.clear();
    } else {
      w += c;
    }
  }
  return out;
}

void synchronize(const at::Device& device) {
  if (device.is_cuda()) cuda::api().synchronize(device.index());
}

}  // namespace

double known_gpu_peak(const std::string& name, at::ScalarType dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return 0;
  const auto w = words(name);
  auto has = [&](const std::string& x) { return std::find(w.begin(), w.end(), x) != w.end(); };
  for (const auto& g : kKnownGpus) {
    if (!has(g.model) || (*g.variant && !has(g.variant))) continue;
    if (std::string(g.model) == "V100" && dtype == at::kBFloat16) return 0;  // no bf16 units
    return g.tflops * 1e12;
  }
  return 0;
}

PeakFlops measure_matmul(const at::Device& device, at::ScalarType dtype, int64_t n,
                         double min_seconds) {
  const at::NoGradGuard no_grad;
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  // (Constant operands: drawing them would move the default generator a run's dropout draws from.)
  const at::Tensor a = at::full({n, n}, 0.5, opts), b = at::full({n, n}, 0.25, opts);
  at::Tensor c = at::mm(a, b);  // warm-up: kernels chosen, memory allocated
  synchronize(device);
  // The best of 5 rounds: a round that another process interrupted does not lower the figure.
  using clock = std::chrono::steady_clock;
  double best = 0, seconds = 0;
  int64_t iters = 0;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = clock::now();
    double elapsed = 0;
    int64_t n_round = 0;
    while (elapsed < min_seconds / 5) {
      at::mm_out(c, a, b);
      synchronize(device);
      ++n_round;
      elapsed = std::chrono::duration<double>(clock::now() - t0).count();
    }
    best = std::max(best, static_cast<double>(n_round) / elapsed);
    iters += n_round;
    seconds += elapsed;
  }
  PeakFlops p;
  p.flops_per_s = 2.0 * static_cast<double>(n) * n * n * best;
  p.from = fmt::format("measured: the best of 5 rounds of {}^3 {} matmuls on {}{} ({} in {:.2f} s)",
                       n, dtype_name(dtype), device.str(),
                       device.is_cpu() ? fmt::format(", {} thread{}", at::get_num_threads(),
                                                     at::get_num_threads() == 1 ? "" : "s")
                                       : "",
                       iters, seconds);
  return p;
}

bool raise_peak(PeakFlops& peak, double achieved, int64_t step) {
  if (!(achieved > peak.flops_per_s)) return false;
  peak.from = fmt::format("step {}'s own rate, above the {:.3g} TFLOP/s {}", step,
                          peak.flops_per_s / 1e12, peak.from);
  peak.flops_per_s = achieved;
  return true;
}

PeakFlops device_peak(const at::Device& device, at::ScalarType dtype, const std::string& gpu_name) {
  if (device.is_cuda()) {
    if (const double peak = known_gpu_peak(gpu_name, dtype); peak > 0)
      return {peak, fmt::format("table: {}, dense {}", gpu_name, dtype_name(dtype))};
  }
  return measure_matmul(device, dtype, device.is_cuda() ? 4096 : 512, 0.15);
}

}  // namespace ft::train

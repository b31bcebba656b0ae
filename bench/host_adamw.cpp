// The host optimizer step of an offloaded job (issue 32), on fp32 buffers of N parameters: ft's
// AdamW (train/optimizer.h) as the trainer calls it (the clip's factor and the zeroing of the
// gradients folded into its pass), then with the bf16 copy the device gets back, written as a
// separate rounding pass (what an offloaded step did before) and inside the update's own pass
// (AdamW::Param::copy_out). Beside them a plain copy of 8 bytes per parameter (the memory's
// speed), and the accumulation of a bf16 gradient into the fp32 host accumulator that precedes
// the update (ATen's add_ against ft's add_into_host), and the clip's squared norm of that
// accumulator (host_sq_norm). One JSON line per variant: the median over
// the timed steps, in ns per parameter, and the bytes each variant moves per parameter.
// bench/host_adamw.sh runs it beside DeepSpeed's CPU Adam and torch's fused AdamW on buffers of the
// same size.
//   ft_bench_host_adamw [--params N] [--steps S] [--warmup W]   threads: OMP_NUM_THREADS
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "parallel/host_add.h"
#include "train/optimizer.h"

namespace {

double median_ns_per_param(const std::function<void()>& step, int warmup, int steps, int64_t n) {
  for (int i = 0; i < warmup; ++i) step();
  std::vector<double> t;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2] * 1e9 / static_cast<double>(n);
}

void report(const std::string& impl, double ns, int bytes, int64_t n) {
  std::printf("%s\n",
              fmt::format(R"({{"impl": "{}", "ns_per_param": {:.3f}, "bytes_per_param": {}, )"
                          R"("params": {}, "threads": {}}})",
                          impl, ns, bytes, n, at::get_num_threads())
                  .c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t{64} << 20;
  int steps = 10, warmup = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--params")
      n = std::atoll(argv[i + 1]);
    else if (a == "--steps")
      steps = std::atoi(argv[i + 1]);
    else if (a == "--warmup")
      warmup = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "ft_bench_host_adamw: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  at::manual_seed(0);
  at::Tensor p = at::randn({n}) * 0.02;
  at::Tensor g = at::randn({n}) * 1e-3;
  p.mutable_grad() = g;
  const at::Tensor out = at::empty({n}, at::kBFloat16);
  // A gradient that stays non-zero: the optimizer zeroes it, this refills it outside the timing
  // would cost a pass; instead the zeroing variants are timed over zeros after the first step,
  // which moves the same bytes (no branch depends on the values).
  {
    ft::train::AdamW opt({{p, true}}, {0.9, 0.999, 1e-8, 0.01});
    report("ft AdamW alone (as the anchors: no clip factor, no zeroing)",
           median_ns_per_param([&] { opt.step(1e-4); }, warmup, steps, n), 28, n);
    report("ft AdamW (clip factor and zeroing in the pass)",
           median_ns_per_param([&] { opt.step(1e-4, 0.5, true); }, warmup, steps, n), 32, n);
    report("ft AdamW + bf16 copy-out, a separate pass",
           median_ns_per_param(
               [&] {
                 opt.step(1e-4, 0.5, true);
                 out.copy_(p);
               },
               warmup, steps, n),
           38, n);
  }
  {
    ft::train::AdamW::Param q{p, true};
    q.copy_out = out;
    ft::train::AdamW opt({q}, {0.9, 0.999, 1e-8, 0.01});
    report("ft AdamW + bf16 copy-out in the same pass",
           median_ns_per_param([&] { opt.step(1e-4, 0.5, true); }, warmup, steps, n), 34, n);
  }
  const at::Tensor src = at::randn({n}), dst = at::empty({n});
  report("copy of 8 bytes (fp32 in, fp32 out)",
         median_ns_per_param([&] { dst.copy_(src); }, warmup, steps, n), 8, n);
  // The pass before the update: a bf16 gradient (a GPU's, come down) added into the fp32 host
  // accumulator, by ATen's add_ (its dtype-casting loop, what an offloaded step did before) and
  // by ft's add_into_host (the same bits).
  const at::Tensor acc = at::zeros({n}), grad16 = at::randn({n}).to(at::kBFloat16);
  report("accumulate a bf16 gradient into fp32: ATen add_",
         median_ns_per_param([&] { acc.add_(grad16); }, warmup, steps, n), 10, n);
  report("accumulate a bf16 gradient into fp32: ft add_into_host",
         median_ns_per_param([&] { ft::parallel::add_into_host(acc, grad16); }, warmup, steps, n),
         10, n);
  // The clip's squared norm of the fp32 accumulator (parallel::host_sq_norm): one read, which the
  // engine's host thread runs beside the backward as each offloaded gradient becomes final.
  double sink = 0;
  report("the clip's squared norm of an fp32 gradient: ft host_sq_norm",
         median_ns_per_param([&] { sink += ft::parallel::host_sq_norm(acc); }, warmup, steps, n), 4,
         n);
  return sink == -1.0;  // (keeps the norms computed)
}

// The host optimizer step of an offloaded job (issue 32), on fp32 buffers of N parameters: ft's
// AdamW (train/optimizer.h) alone, as the trainer calls it (the clip's factor and the zeroing of
// the gradients folded into its pass), and with the bf16 copy the device gets back, written as a
// separate rounding pass (what an offloaded step did before) or inside the update's own pass
// (AdamW::Param::copy_out); beside each, on the same parameter and gradient buffers in this
// process, torch's fused AdamW (at::_fused_adamw_, the kernel torch.optim.AdamW(fused=True) runs on
// the CPU) doing the same work: alone, after the clip's scaling pass, and with a bf16 copy_. Then
// a plain copy of 8 bytes per parameter (the memory's speed), the accumulation of a bf16 gradient
// into the fp32 host accumulator that precedes the update (ATen's add_ against ft's add_into_host)
// and the clip's squared norm of that accumulator (host_sq_norm).
//
// This machine's memory speed moves by up to 2x from one minute to the next (other tenants), so
// the variants are interleaved: each round runs every variant once, in an order rotated by one
// each round, and each comparison is the median over the rounds of the round's own ratio. One
// JSON line per variant (the median over the rounds, in ns per parameter, and the bytes it moves
// per parameter) and one per comparison. bench/host_adamw.sh runs it beside
// bench/host_adamw_ref.py (torch's fused AdamW against DeepSpeed's CPU Adam, interleaved the same
// way) and joins the two through torch's fused AdamW.
//   ft_bench_host_adamw [--params N] [--rounds R] [--warmup W]   threads: OMP_NUM_THREADS
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/host_add.h"
#include "train/optimizer.h"

namespace {

struct Variant {
  Variant(std::string name, int bytes, std::function<void()> step)
      : name(std::move(name)), bytes(bytes), step(std::move(step)) {}
  std::string name;
  int bytes;  // logical bytes read and written per parameter
  std::function<void()> step;
  std::vector<double> ns;  // per round, ns per parameter
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// Every variant once per round, the order rotated by one each round (so no variant always runs
// after the same one); the first `warmup` rounds are not recorded.
void run_rounds(std::vector<Variant>& vs, int warmup, int rounds, int64_t n) {
  const size_t k = vs.size();
  for (int r = 0; r < warmup + rounds; ++r) {
    for (size_t j = 0; j < k; ++j) {
      Variant& v = vs[(j + static_cast<size_t>(r)) % k];
      const auto t0 = std::chrono::steady_clock::now();
      v.step();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r >= warmup) v.ns.push_back(s * 1e9 / static_cast<double>(n));
    }
  }
}

void report(const Variant& v, int64_t n) {
  std::printf("%s\n",
              fmt::format(R"({{"impl": "{}", "ns_per_param": {:.3f}, "bytes_per_param": {}, )"
                          R"("params": {}, "threads": {}, "rounds": {}}})",
                          v.name, median(v.ns), v.bytes, n, at::get_num_threads(), v.ns.size())
                  .c_str());
}

// The median over the rounds of a's time over b's in the same round.
void compare(const Variant& a, const Variant& b) {
  std::vector<double> r;
  for (size_t i = 0; i < a.ns.size(); ++i) r.push_back(a.ns[i] / b.ns[i]);
  std::printf("%s\n", fmt::format(R"({{"ratio": "{}", "of": "{}", "to": "{}", "value": {:.3f}, )"
                                  R"("min": {:.3f}, "max": {:.3f}}})",
                                  a.name + " / " + b.name, a.name, b.name, median(r),
                                  *std::min_element(r.begin(), r.end()),
                                  *std::max_element(r.begin(), r.end()))
                          .c_str());
}

// torch.optim.AdamW(fused=True)'s step on the CPU: the step count incremented, then one fused
// kernel over parameter, gradient and both moments (torch/optim/adam.py, _fused_adam).
struct TorchFused {
  at::Tensor p, g, m, v, step = at::zeros({}, at::kFloat);
  void operator()() {
    step.add_(1);
    at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step}, 1e-4, 0.9, 0.999, 0.01, 1e-8,
                      /*amsgrad=*/false, /*maximize=*/false);
  }
};

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t{64} << 20;
  int rounds = 15, warmup = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--params")
      n = std::atoll(argv[i + 1]);
    else if (a == "--rounds")
      rounds = std::atoi(argv[i + 1]);
    else if (a == "--warmup")
      warmup = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "ft_bench_host_adamw: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (n < 1 || rounds < 1 || warmup < 0) {
    std::fprintf(stderr, "ft_bench_host_adamw: --params and --rounds must be positive\n");
    return 2;
  }
  at::manual_seed(0);
  // One parameter and one gradient buffer for every variant. The trainer's variants zero the
  // gradient as they read it, so after the first of them every variant reads zeros: the same
  // bytes (no branch depends on the values).
  at::Tensor p = at::randn({n}) * 0.02;
  at::Tensor g = at::randn({n}) * 1e-3;
  p.mutable_grad() = g;
  const at::Tensor out = at::empty({n}, at::kBFloat16);
  ft::train::AdamW opt({{p, true}}, {0.9, 0.999, 1e-8, 0.01});
  ft::train::AdamW::Param q{p, true};
  q.copy_out = out;
  ft::train::AdamW opt_out({q}, {0.9, 0.999, 1e-8, 0.01});
  TorchFused torch_fused{p, g, at::zeros({n}), at::zeros({n})};
  const at::Tensor src = at::randn({n}), dst = at::empty({n});
  // The pass before the update: a bf16 gradient (a GPU's, come down) added into the fp32 host
  // accumulator, by ATen's add_ (its dtype-casting loop, what an offloaded step did before) and
  // by ft's add_into_host (the same bits); then the clip's squared norm of that accumulator
  // (parallel::host_sq_norm), which the engine's host thread takes beside the backward.
  const at::Tensor acc = at::zeros({n}), grad16 = at::randn({n}).to(at::kBFloat16);
  double sink = 0;
  std::vector<Variant> vs = {
      {"ft AdamW alone (as the anchors: no clip factor, no zeroing)", 28, [&] { opt.step(1e-4); }},
      {"torch AdamW(fused=True)", 28, [&] { torch_fused(); }},
      {"ft AdamW (clip factor and zeroing in the pass)", 32, [&] { opt.step(1e-4, 0.5, true); }},
      {"torch AdamW(fused=True) + the clip's scaling pass", 36,
       [&] {
         g.mul_(0.5);
         torch_fused();
       }},
      {"ft AdamW + bf16 copy-out in the same pass", 34, [&] { opt_out.step(1e-4, 0.5, true); }},
      {"ft AdamW + bf16 copy-out, a separate pass", 38,
       [&] {
         opt.step(1e-4, 0.5, true);
         out.copy_(p);
       }},
      {"torch AdamW(fused=True) + bf16 copy_", 34,
       [&] {
         torch_fused();
         out.copy_(p);
       }},
      {"copy of 8 bytes (fp32 in, fp32 out)", 8, [&] { dst.copy_(src); }},
      {"accumulate a bf16 gradient into fp32: ATen add_", 10, [&] { acc.add_(grad16); }},
      {"accumulate a bf16 gradient into fp32: ft add_into_host", 10,
       [&] { ft::parallel::add_into_host(acc, grad16); }},
      {"the clip's squared norm of an fp32 gradient: ft host_sq_norm", 4,
       [&] { sink += ft::parallel::host_sq_norm(acc); }},
  };
  run_rounds(vs, warmup, rounds, n);
  for (const Variant& v : vs) report(v, n);
  compare(vs[0], vs[1]);  // alone against alone
  compare(vs[2], vs[3]);  // as the trainer runs it against torch with the clip's pass
  compare(vs[4], vs[6]);  // with the bf16 copy in its pass against torch + copy_
  std::fflush(stdout);
  return sink == -1.0;  // (keeps the norms computed)
}

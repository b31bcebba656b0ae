// Attention on the host, forward and backward in fp32: ft's blocked kernel (model/cpu_attention.h)
// against LibTorch's flash attention for the CPU (what at::scaled_dot_product_attention runs for
// these inputs, and what transformers' sdpa attention calls), on the same tensors, causal, with
// grouped-query heads. One JSON line per shape and kernel: the median milliseconds of the forward
// and of forward + backward over the timed repeats, their GFLOP/s (the causal half of the
// products: 4 B H Tq Tk hd / 2 forward, 2.5x that backward), and the largest difference from the
// other kernel's output and gradients relative to their largest element.
//   ft_bench_cpu_attention [--shape B,H,KV,T,hd]... [--repeats R]   threads: OMP_NUM_THREADS
#include "model/cpu_attention.h"

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

namespace {

struct Shape {
  int64_t B = 2, H = 8, KV = 4, T = 512, D = 64;
};

double median_ms(const std::function<void()>& f, int repeats) {
  f();
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

struct Result {
  at::Tensor out, dq, dk, dv;
};

// q [B, T, H, hd] etc.; the flash kernel takes [B, H, T, hd] views.
Result run_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& go, double scale, bool backward) {
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, true, c10::nullopt, scale);
  if (!backward) return {out.transpose(1, 2), {}, {}, {}};
  auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      go.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out, lse, 0.0,
      true, c10::nullopt, scale);
  return {out.transpose(1, 2), dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

Result run_ft(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& go,
              double scale, bool backward) {
  auto r = ft::model::cpu_attention_forward(q, k, v, at::Tensor(), true, scale);
  if (!backward) return {r.out, {}, {}, {}};
  auto [dq, dk, dv] =
      ft::model::cpu_attention_backward(go, q, k, v, r.out, r.stats, at::Tensor(), true, scale);
  return {r.out, dq, dk, dv};
}

void bench(const Shape& s, int repeats) {
  at::manual_seed(0);
  const at::Tensor q = at::randn({s.B, s.T, s.H, s.D}), k = at::randn({s.B, s.T, s.KV, s.D}),
                   v = at::randn({s.B, s.T, s.KV, s.D}), go = at::randn({s.B, s.T, s.H, s.D});
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  const double fwd_gflop = 4.0 * s.B * s.H * s.T * s.T * s.D / 2 / 1e9, all_gflop = 3.5 * fwd_gflop;
  const Result ref = run_flash(q, k, v, go, scale, true), mine = run_ft(q, k, v, go, scale, true);
  using Run = Result (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         double, bool);
  for (const auto& [name, run, other, self] :
       {std::tuple<const char*, Run, const Result*, const Result*>{"flash", run_flash, &mine, &ref},
        {"ft", run_ft, &ref, &mine}}) {
    const double fwd = median_ms([&] { run(q, k, v, go, scale, false); }, repeats);
    const double all = median_ms([&] { run(q, k, v, go, scale, true); }, repeats);
    std::printf("%s\n",
                fmt::format("{{\"kernel\": \"{}\", \"B\": {}, \"H\": {}, \"KV\": {}, \"T\": {}, "
                            "\"hd\": {}, \"threads\": {}, \"forward_ms\": {:.2f}, "
                            "\"forward_backward_ms\": {:.2f}, \"forward_gflops\": {:.1f}, "
                            "\"forward_backward_gflops\": {:.1f}, \"max_rel_diff\": "
                            "{{\"out\": {:.2e}, \"dq\": {:.2e}, \"dk\": {:.2e}, \"dv\": {:.2e}}}}}",
                            name, s.B, s.H, s.KV, s.T, s.D, at::get_num_threads(), fwd, all,
                            fwd_gflop / fwd * 1e3, all_gflop / all * 1e3,
                            rel_diff(self->out, other->out), rel_diff(self->dq, other->dq),
                            rel_diff(self->dk, other->dk), rel_diff(self->dv, other->dv))
                    .c_str());
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Shape> shapes;
  int repeats = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--shape" && i + 1 < argc) {
      Shape s;
      if (std::sscanf(argv[++i], "%ld,%ld,%ld,%ld,%ld", &s.B, &s.H, &s.KV, &s.T, &s.D) != 5) {
        std::fprintf(stderr, "--shape takes B,H,KV,T,hd, got %s\n", argv[i]);
        return 2;
      }
      shapes.push_back(s);
    } else {
      std::fprintf(stderr,
                   "usage: ft_bench_cpu_attention [--shape B,H,KV,T,hd]... [--repeats R]\n");
      return 2;
    }
  }
  if (shapes.empty()) shapes.push_back(Shape{});
  for (const Shape& s : shapes) bench(s, repeats);
  return 0;
}

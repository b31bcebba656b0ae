// ft's host attention (model/cpu_attention.h) against the same attention computed in fp64 by
// plain ops (scores, mask, softmax, values; autograd for the gradients) and against LibTorch's
// at::scaled_dot_product_attention in fp32: causal with queries that do not fill the last block,
// grouped-query heads, fewer queries than keys (the causal offset), an additive and a bool mask
// with a row that sees no key, and the same bits for 1 and 2 threads.
#include "model/cpu_attention.h"

#include <ATen/Parallel.h>

#include <limits>

#include "support/catch_torch.h"
#include "support/numerics.h"

using ft::test::rel_error;

namespace {

at::Tensor rand(at::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble));
}

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

// softmax(q k^T scale + bias) v in q's dtype with explicit ops; q [B, H, Tq, hd], k, v [B, KV,
// Tk, hd]; bias additive [B|1, 1, Tq, Tk] or undefined; causal: query i sees keys j <= i + Tk -
// Tq. A row that sees nothing gives zeros (as the kernel documents).
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& bias, bool causal, double scale) {
  const int64_t rep = q.size(1) / k.size(1), Tq = q.size(2), Tk = k.size(2);
  const at::Tensor kk = k.repeat_interleave(rep, 1), vv = v.repeat_interleave(rep, 1);
  at::Tensor s = at::matmul(q, kk.transpose(2, 3)) * scale;
  if (bias.defined()) s = s + bias.to(s.scalar_type());
  if (causal) {
    const at::Tensor seen = at::ones({Tq, Tk}, at::kBool).tril(Tk - Tq);
    s = s.masked_fill(seen.logical_not(), -std::numeric_limits<double>::infinity());
  }
  const at::Tensor none = at::isinf(s).all(-1, /*keepdim=*/true);
  const at::Tensor p = at::softmax(s.masked_fill(none, 0.0), -1).masked_fill(none, 0.0);
  return at::matmul(p, vv);
}

struct Case {
  int64_t B, H, KV, Tq, Tk, hd;
  bool causal;
};

// Output and the three gradients of the kernel (fp32) and of the reference (fp64).
void check_case(const Case& c, const at::Tensor& bias) {
  const at::Tensor q0 = rand({c.B, c.H, c.Tq, c.hd}, 1), k0 = rand({c.B, c.KV, c.Tk, c.hd}, 2);
  const at::Tensor v0 = rand({c.B, c.KV, c.Tk, c.hd}, 3), g0 = rand({c.B, c.H, c.Tq, c.hd}, 4);
  const double scale = 0.125;
  at::Tensor q = leaf(q0.to(at::kFloat)), k = leaf(k0.to(at::kFloat)), v = leaf(v0.to(at::kFloat));
  at::Tensor qr = leaf(q0), kr = leaf(k0), vr = leaf(v0);
  REQUIRE(ft::model::cpu_attention_supported(q, k, v, bias));
  const at::Tensor out = ft::model::cpu_attention(q, k, v, bias, c.causal, scale);
  at::Tensor additive = bias;
  if (bias.defined() && bias.scalar_type() == at::kBool)
    additive = at::zeros(bias.sizes(), at::kDouble)
                   .masked_fill(bias.logical_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor ref = reference(qr, kr, vr, additive, c.causal, scale);
  CHECK(out.sizes() == ref.sizes());
  CHECK(rel_error(out.to(at::kDouble), ref) <= 2e-6);
  (out * g0.to(at::kFloat)).sum().backward();
  (ref * g0).sum().backward();
  CHECK(rel_error(q.grad().to(at::kDouble), qr.grad()) <= 2e-6);
  CHECK(rel_error(k.grad().to(at::kDouble), kr.grad()) <= 2e-6);
  CHECK(rel_error(v.grad().to(at::kDouble), vr.grad()) <= 2e-6);
}

}  // namespace

TEST_CASE("host attention equals fp64 attention: output and gradients", "[unit]") {
  // 150 queries: two blocks of 64 and one of 22.
  SECTION("causal, grouped-query heads") { check_case({2, 4, 2, 150, 150, 16, true}, {}); }
  SECTION("causal, fewer queries than keys") { check_case({1, 2, 2, 40, 100, 8, true}, {}); }
  SECTION("no mask, one key-value head") { check_case({1, 3, 1, 70, 90, 12, false}, {}); }
  SECTION("additive mask per row, and a row that sees no key") {
    at::Tensor bias = rand({2, 1, 80, 80}, 5).to(at::kFloat);
    bias.index_put_({1, 0, 7}, -std::numeric_limits<float>::infinity());
    bias.index_put_({0, 0, at::indexing::Slice(), at::indexing::Slice(60)},
                    -std::numeric_limits<float>::infinity());
    check_case({2, 2, 1, 80, 80, 8, false}, bias);
  }
  SECTION("bool mask: two packed segments") {
    const at::Tensor seg = at::cat({at::zeros({30}, at::kLong), at::ones({50}, at::kLong)});
    const at::Tensor mask =
        seg.unsqueeze(1).eq(seg.unsqueeze(0)).logical_and(at::ones({80, 80}, at::kBool).tril());
    check_case({1, 2, 2, 80, 80, 8, false}, mask.view({1, 1, 80, 80}));
  }
}

TEST_CASE("host attention equals LibTorch's scaled_dot_product_attention in fp32", "[unit]") {
  const at::Tensor q0 = rand({2, 8, 200, 32}, 6).to(at::kFloat);
  const at::Tensor k0 = rand({2, 4, 200, 32}, 7).to(at::kFloat);
  const at::Tensor v0 = rand({2, 4, 200, 32}, 8).to(at::kFloat);
  const at::Tensor g = rand({2, 8, 200, 32}, 9).to(at::kFloat);
  at::Tensor q = leaf(q0), k = leaf(k0), v = leaf(v0), qr = leaf(q0), kr = leaf(k0), vr = leaf(v0);
  const at::Tensor out = ft::model::cpu_attention(q, k, v, {}, true, 0.2);
  const at::Tensor ref = at::scaled_dot_product_attention(qr, kr, vr, c10::nullopt, 0.0, true, 0.2,
                                                          /*enable_gqa=*/true);
  CHECK(rel_error(out, ref) <= 1e-6);
  (out * g).sum().backward();
  (ref * g).sum().backward();
  CHECK(rel_error(q.grad(), qr.grad()) <= 2e-6);
  CHECK(rel_error(k.grad(), kr.grad()) <= 2e-6);
  CHECK(rel_error(v.grad(), vr.grad()) <= 2e-6);
}

TEST_CASE("host attention: the same bits for 1 and 2 threads", "[unit]") {
  const int threads = at::get_num_threads();
  const at::Tensor q0 = rand({2, 4, 130, 16}, 10).to(at::kFloat);
  const at::Tensor k0 = rand({2, 2, 130, 16}, 11).to(at::kFloat);
  const at::Tensor v0 = rand({2, 2, 130, 16}, 12).to(at::kFloat);
  auto run = [&](int n) {
    at::set_num_threads(n);
    at::Tensor q = leaf(q0), k = leaf(k0), v = leaf(v0);
    const at::Tensor out = ft::model::cpu_attention(q, k, v, {}, true, 0.25);
    out.pow(2).sum().backward();
    return std::vector<at::Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
  };
  const auto one = run(1), two = run(2);
  at::set_num_threads(threads);
  for (size_t i = 0; i < one.size(); ++i) CHECK(at::equal(one[i], two[i]));
}

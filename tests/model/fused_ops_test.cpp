// The fused CPU kernels (model/fused_ops.h) against the unfused op sequences they replace
// (transformers' RMSNorm, silu(gate) * up, x * cos + rotate_half(x) * sin): forward and every
// gradient within 1e-6 (fp32) and 1e-12 (fp64) relative, bf16 within its rounding, the weight's
// gradient the same bits for 1 and 2 threads, and a whole model with every kernel on against
// every kernel off (the host attention of model/cpu_attention.h among them).
#include "model/fused_ops.h"

#include <ATen/Parallel.h>

#include "core/error.h"
#include "model/decoder.h"
#include "support/catch_torch.h"
#include "support/numerics.h"

using ft::test::rel_error;

namespace {

at::Tensor rand(at::IntArrayRef shape, at::ScalarType dtype, uint64_t seed, double scale = 1.0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return (at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble)) * scale).to(dtype);
}

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

// transformers' LlamaRMSNorm.
at::Tensor ref_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor h = x.to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return w * h.to(x.scalar_type());
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

double tol_of(at::ScalarType dtype) {
  return dtype == at::kDouble ? 1e-12 : dtype == at::kFloat ? 1e-6 : 2e-2;
}

}  // namespace

TEST_CASE("fused RMSNorm and residual add + RMSNorm equal the unfused ops: output and gradients",
          "[unit]") {
  // 37 rows (blocks that do not divide them), hidden 72 (not a multiple of 8).
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    INFO("dtype " << dtype);
    const double tol = tol_of(dtype);
    const at::Tensor x0 = rand({37, 72}, dtype, 1), d0 = rand({37, 72}, dtype, 2);
    const at::Tensor w0 = rand({72}, dtype, 3, 0.5) + 1;
    const at::Tensor gy = rand({37, 72}, dtype, 4), gs = rand({37, 72}, dtype, 5);
    {
      at::Tensor x = leaf(x0), w = leaf(w0), xr = leaf(x0), wr = leaf(w0);
      at::Tensor y = ft::model::fused_rms_norm(x, w, 1e-5);
      at::Tensor yr = ref_rms_norm(xr, wr, 1e-5);
      CHECK(y.scalar_type() == dtype);
      CHECK(rel_error(y, yr) <= tol);
      (y * gy).sum().backward();
      (yr * gy).sum().backward();
      CHECK(rel_error(x.grad(), xr.grad()) <= tol);
      CHECK(rel_error(w.grad(), wr.grad()) <= tol);
    }
    {
      at::Tensor h = leaf(x0), d = leaf(d0), w = leaf(w0);
      at::Tensor hr = leaf(x0), dr = leaf(d0), wr = leaf(w0);
      auto [s, y] = ft::model::fused_add_rms_norm(h, d, w, 1e-6);
      at::Tensor sr = hr + dr;
      at::Tensor yr = ref_rms_norm(sr, wr, 1e-6);
      CHECK(rel_error(s, sr) == 0);
      CHECK(rel_error(y, yr) <= tol);
      // Both outputs used downstream, as in a layer (the sum is the residual stream).
      ((y * gy).sum() + (s * gs).sum()).backward();
      ((yr * gy).sum() + (sr * gs).sum()).backward();
      CHECK(rel_error(h.grad(), hr.grad()) <= tol);
      CHECK(rel_error(d.grad(), dr.grad()) <= tol);
      CHECK(rel_error(w.grad(), wr.grad()) <= tol);
    }
  }
}

TEST_CASE("fused RMSNorm: the weight's gradient has the same bits for 1 and 2 threads", "[unit]") {
  const int threads = at::get_num_threads();
  const at::Tensor x0 = rand({1000, 64}, at::kFloat, 6), w0 = rand({64}, at::kFloat, 7);
  auto grad_w = [&](int n) {
    at::set_num_threads(n);
    at::Tensor x = leaf(x0), w = leaf(w0);
    ft::model::fused_rms_norm(x, w, 1e-5).pow(2).sum().backward();
    return std::make_pair(x.grad(), w.grad());
  };
  const auto one = grad_w(1), two = grad_w(2);
  at::set_num_threads(threads);
  CHECK(at::equal(one.first, two.first));
  CHECK(at::equal(one.second, two.second));
}

TEST_CASE("fused SwiGLU equals silu(gate) * up: output and both gradients", "[unit]") {
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    INFO("dtype " << dtype);
    const double tol = tol_of(dtype);
    const at::Tensor g0 = rand({3, 5, 41}, dtype, 8, 3.0), u0 = rand({3, 5, 41}, dtype, 9);
    const at::Tensor gy = rand({3, 5, 41}, dtype, 10);
    at::Tensor g = leaf(g0), u = leaf(u0), gr = leaf(g0), ur = leaf(u0);
    at::Tensor y = ft::model::fused_swiglu(g, u);
    at::Tensor yr = at::silu(gr) * ur;
    CHECK(rel_error(y, yr) <= tol);
    (y * gy).sum().backward();
    (yr * gy).sum().backward();
    CHECK(rel_error(g.grad(), gr.grad()) <= tol);
    CHECK(rel_error(u.grad(), ur.grad()) <= tol);
  }
}

TEST_CASE(
    "fused SwiGLU in fp32, vectorized with its own exp: every element over exp's whole range, "
    "the same bits for any thread count and chunk start",
    "[unit]") {
  // 200,003 gates from -120 to 120 (past both ends of fp32's exp), more than one parallel chunk.
  const int64_t n = 200003;
  const at::Tensor g0 = at::linspace(-120.0, 120.0, n, at::kFloat);
  const at::Tensor u0 = rand({n}, at::kFloat, 14) + 2;
  const at::Tensor gy = rand({n}, at::kFloat, 15);
  at::Tensor g = leaf(g0), u = leaf(u0), gr = leaf(g0), ur = leaf(u0);
  const at::Tensor y = ft::model::fused_swiglu(g, u);
  const at::Tensor yr = at::silu(gr) * ur;
  (y * gy).sum().backward();
  (yr * gy).sum().backward();
  // Element by element: within 1e-6 relative, or 1e-30 absolute where the value itself is that
  // small (silu of -120 is -1e-50 in exact arithmetic: 0 or a subnormal either way).
  auto close = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a - b).abs() <= b.abs() * 1e-6 + 1e-30).all().item<bool>();
  };
  CHECK(close(y.detach(), yr.detach()));
  CHECK(close(u.grad(), ur.grad()));
  // The gate's gradient, dy * up * sig * (1 + x (1 - sig)), crosses zero near x = -1.28, where its
  // two terms cancel: there 1e-6 is relative to the size of the terms, not of their sum (an ulp
  // of exp either way moves the sum more).
  const at::Tensor x64 = g0.to(at::kDouble), sig = at::sigmoid(x64);
  const at::Tensor terms = (gy * u0).to(at::kDouble).abs() * sig * (1 + (x64 * (1 - sig)).abs());
  CHECK(((g.grad() - gr.grad()).to(at::kDouble).abs() <= terms * 1e-6 + 1e-30).all().item<bool>());
  CHECK_FALSE(y.isnan().any().item<bool>());
  // The same bits from 1 and 2 threads, and for a view that starts 5 elements later (every
  // element moves to another lane of the vector loop or to the scalar tail).
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor y1 = ft::model::fused_swiglu(g0, u0);
  at::set_num_threads(2);
  const at::Tensor y2 = ft::model::fused_swiglu(g0, u0);
  at::set_num_threads(threads);
  CHECK(at::equal(y1, y.detach()));
  CHECK(at::equal(y2, y.detach()));
  const at::Tensor shifted = ft::model::fused_swiglu(g0.slice(0, 5), u0.slice(0, 5));
  CHECK(at::equal(shifted, y.detach().slice(0, 5)));
}

TEST_CASE("fused rotary embedding equals x * cos + rotate_half(x) * sin: output and gradient",
          "[unit]") {
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    INFO("dtype " << dtype);
    const double tol = tol_of(dtype);
    // [B, T, heads, hd] as the projection's output viewed, and a non-contiguous input too.
    const at::Tensor x0 = rand({2, 7, 3, 16}, dtype, 11);
    const at::Tensor ang = rand({2, 7, 8}, at::kDouble, 12, 3.0);
    const at::Tensor emb = at::cat({ang, ang}, -1);
    const at::Tensor cos = emb.cos().to(dtype), sin = emb.sin().to(dtype);
    const at::Tensor gy = rand({2, 7, 3, 16}, dtype, 13);
    for (const bool strided : {false, true}) {
      INFO("strided input " << strided);
      at::Tensor x = leaf(strided ? x0.transpose(1, 2).contiguous() : x0);
      at::Tensor xr = leaf(x0);
      const at::Tensor xin = strided ? x.transpose(1, 2) : x;
      at::Tensor y = ft::model::fused_rope(xin, cos, sin);
      at::Tensor yr = xr * cos.unsqueeze(2) + rotate_half(xr) * sin.unsqueeze(2);
      CHECK(rel_error(y, yr) <= tol);
      (y * gy).sum().backward();
      (yr * gy).sum().backward();
      const at::Tensor gx = strided ? x.grad().transpose(1, 2) : x.grad();
      CHECK(rel_error(gx, xr.grad()) <= tol);
    }
  }
}

TEST_CASE("fused kernels: bad shapes are refused with the shapes named", "[unit]") {
  const at::Tensor x = at::ones({2, 8}), w = at::ones({4});
  CHECK_THROWS_AS(ft::model::fused_rms_norm(x, w, 1e-5), ft::Error);
  CHECK_THROWS_AS(ft::model::fused_swiglu(x, at::ones({2, 7})), ft::Error);
  CHECK_THROWS_AS(
      ft::model::fused_rope(at::ones({1, 2, 3, 5}), at::ones({1, 2, 5}), at::ones({1, 2, 5})),
      ft::Error);
}

TEST_CASE("a model with every fused kernel equals the unfused model: loss and every gradient",
          "[unit]") {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const bool packed : {false, true}) {
      INFO("dtype " << dtype << ", packed " << packed);
      ft::model::ModelConfig c;
      c.vocab_size = 97;
      c.hidden_size = 48;
      c.intermediate_size = 88;
      c.num_hidden_layers = 2;
      c.num_attention_heads = 4;
      c.num_key_value_heads = 2;
      c.head_dim = 12;
      c.max_position_embeddings = 64;
      auto run = [&](bool fused) {
        ft::model::DecoderModel m(c, at::TensorOptions().dtype(dtype));
        m.init_random(3);
        for (auto& p : m.parameters()) p.tensor->requires_grad_(true);
        m.set_fused_ops({fused, fused, fused, fused});
        auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
        const at::Tensor ids = at::randint(97, {2, 20}, gen, at::kLong);
        at::Tensor seg, pos;
        if (packed) {
          seg = (at::arange(20, at::kLong) >= 9).to(at::kLong).unsqueeze(0).expand({2, 20});
          pos = at::where(seg.eq(0), at::arange(20, at::kLong), at::arange(20, at::kLong) - 9);
        }
        const at::Tensor logits = m.forward(ids, pos, true, seg);
        ft::model::causal_lm_loss_sum(logits, ids, false).sum.backward();
        std::vector<at::Tensor> out{logits.detach()};
        for (auto& p : m.parameters()) out.push_back(p.tensor->grad());
        return out;
      };
      const auto ref = run(false), got = run(true);
      REQUIRE(ref.size() == got.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        INFO("tensor " << i << " (0: logits, then each parameter's gradient)");
        CHECK(rel_error(got[i], ref[i]) <= tol_of(dtype));
      }
    }
  }
}

TEST_CASE(
    "packed SwiGLU: the halves of one gate_up tensor give fused_swiglu's bits, and one "
    "gradient",
    "[unit]") {
  // 37 rows of 2 x 45 (odd, so rows start off any vector boundary), fp32 and bf16.
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
    INFO("dtype " << dtype);
    const at::Tensor y0 = rand({37, 90}, dtype, 11), gm = rand({37, 45}, dtype, 12);
    at::Tensor y = leaf(y0), yr = leaf(y0);
    const at::Tensor m = ft::model::fused_swiglu_packed(y);
    const at::Tensor mr = ft::model::fused_swiglu(yr.narrow(-1, 0, 45).contiguous(),
                                                  yr.narrow(-1, 45, 45).contiguous());
    CHECK(m.sizes() == mr.sizes());
    CHECK(at::equal(m, mr));
    (m * gm).sum().backward();
    (mr * gm).sum().backward();
    CHECK(at::equal(y.grad(), yr.grad()));
  }
  CHECK_THROWS_WITH(ft::model::fused_swiglu_packed(at::ones({3, 5})),
                    Catch::Contains("last dimension holds gate and up"));
}

// The chunked LM head + cross-entropy (model/fused_loss.h) against the unfused path
// (causal_lm_loss_sum of at::linear): the loss and both gradients, in fp32 and fp64, with ignored
// labels, chunks that do not divide the tokens, a frozen head, and no gradient at all.
#include "model/fused_loss.h"

#include <ATen/Parallel.h>

#include <vector>

#include "core/error.h"
#include "support/catch_torch.h"
#include "support/numerics.h"

using ft::model::causal_lm_loss_sum;
using ft::model::chunked_lm_loss_sum;
using ft::test::rel_error;

namespace {

struct Case {
  at::Tensor loss, grad_hidden, grad_weight;
  int64_t tokens = 0;
};

// Batch 2 x 7 tokens, hidden 16, vocabulary 50; some labels ignored.
struct Inputs {
  at::Tensor hidden, weight, labels;
  explicit Inputs(at::ScalarType dtype) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    hidden = at::randn({2, 7, 16}, gen, at::TensorOptions().dtype(at::kDouble)).to(dtype);
    weight = (at::randn({50, 16}, gen, at::TensorOptions().dtype(at::kDouble)) * 0.3).to(dtype);
    labels = at::randint(50, {2, 7}, gen, at::kLong);
    labels.index_put_({0, 2}, -100);
    labels.index_put_({1, 5}, -100);
    labels.index_put_({1, 6}, -100);
  }
};

Case run(const Inputs& in, bool fused, bool weight_grad, int64_t chunk_elements,
         ft::core::HostBlockCache* blocks = nullptr) {
  const at::Tensor h = in.hidden.detach().clone().requires_grad_(true);
  const at::Tensor w = in.weight.detach().clone().requires_grad_(weight_grad);
  const ft::model::LossSum ls =
      fused ? chunked_lm_loss_sum(h, w, in.labels, true, chunk_elements, blocks)
            : causal_lm_loss_sum(at::linear(h, w), in.labels, true);
  // The trainer scales the summed loss (1 / tokens, the fp16 loss scale) before backward.
  (ls.sum * 0.37).backward();
  return {ls.sum.detach(), h.grad(), weight_grad ? w.grad() : at::Tensor(), ls.tokens};
}

}  // namespace

TEST_CASE("chunked LM loss equals the unfused path: loss and both gradients, fp32 and fp64") {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    const Inputs in(dtype);
    const double tol = dtype == at::kDouble ? 1e-12 : 1e-6;
    const Case ref = run(in, false, true, 0);
    // 3 tokens a chunk (150 logits), 14 tokens: chunks of 3, 3, 3, 3 and 2; and all at once.
    for (const int64_t chunk : {int64_t{150}, int64_t{50}, int64_t{1} << 25}) {
      INFO("dtype " << dtype << ", chunk elements " << chunk);
      const Case got = run(in, true, true, chunk);
      CHECK(got.tokens == ref.tokens);
      CHECK(got.tokens == 14 - 2 - 3);  // 2 last positions, 3 ignored labels (one is a last one)
      CHECK(got.loss.scalar_type() == ref.loss.scalar_type());
      CHECK(rel_error(got.loss, ref.loss) <= tol);
      CHECK(rel_error(got.grad_hidden, ref.grad_hidden) <= tol);
      CHECK(rel_error(got.grad_weight, ref.grad_weight) <= tol);
      CHECK(got.grad_hidden.scalar_type() == dtype);
      CHECK(got.grad_weight.scalar_type() == dtype);
    }
  }
}

// fp32 on the CPU goes through cross_entropy_rows (model/fused_ops.h): its vectorized rows (a
// vocabulary that is not a multiple of the 16 lanes, logits spread over +-40) still equal the
// unfused path within 1e-6, and give the same bits at 1 and 2 threads (rows are split over
// threads; each row's sums have a fixed order).
TEST_CASE("chunked LM loss, fp32 rows over threads: the unfused path's values, the same bits") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  Inputs in(at::kFloat);
  in.hidden = at::randn({3, 40, 32}, gen) * 2.0;
  in.weight = at::randn({1003, 32}, gen) * 1.5;
  in.labels = at::randint(1003, {3, 40}, gen, at::kLong);
  in.labels.narrow(1, 10, 5).fill_(-100);
  const Case ref = run(in, false, true, 0);
  const int before = at::get_num_threads();
  std::vector<Case> got;
  for (const int threads : {1, 2}) {
    at::set_num_threads(threads);
    got.push_back(run(in, true, true, 1003 * 50));  // chunks of 50 tokens: 3, the last short
  }
  at::set_num_threads(before);
  CHECK(rel_error(got[0].loss, ref.loss) <= 1e-6);
  CHECK(rel_error(got[0].grad_hidden, ref.grad_hidden) <= 1e-6);
  CHECK(rel_error(got[0].grad_weight, ref.grad_weight) <= 1e-6);
  CHECK(at::equal(got[0].loss, got[1].loss));
  CHECK(at::equal(got[0].grad_hidden, got[1].grad_hidden));
  CHECK(at::equal(got[0].grad_weight, got[1].grad_weight));
  // Ignored rows pass no gradient to their hidden states.
  CHECK(got[0].grad_hidden.index({0, 12}).abs().max().item<float>() == 0.0f);
}

// The trainer passes a HostBlockCache on the CPU: its logits chunk and the gradients' buffers come
// back unzeroed from the previous step, and the results are the same bits as with fresh buffers.
TEST_CASE("chunked LM loss from kept host blocks: the same bits, the blocks reused every step") {
  for (const int64_t chunk : {int64_t{150}, int64_t{1} << 25}) {
    INFO("chunk elements " << chunk);
    const Inputs in(at::kFloat);
    const Case fresh = run(in, true, true, chunk);
    ft::core::HostBlockCache blocks(4, /*min_bytes=*/0);  // these blocks are small
    for (int step = 0; step < 3; ++step) {
      const Case got = run(in, true, true, chunk, &blocks);
      CHECK(at::equal(got.loss, fresh.loss));
      CHECK(at::equal(got.grad_hidden, fresh.grad_hidden));
      CHECK(at::equal(got.grad_weight, fresh.grad_weight));
    }
    // The logits chunk, the hidden states' and the head's gradients: three blocks taken from the
    // C library in the first step, every later step served from the kept ones.
    CHECK(blocks.allocated() == 3);
    CHECK(blocks.reused() == 6);
    CHECK(blocks.kept_blocks() == 3);
  }
}

namespace {

// A strategy that takes the head weight's gradient into a buffer of its own (UnitHooks::grad_sink).
struct HeadSink final : ft::model::UnitHooks {
  at::Tensor weight, into;
  int asked = 0, sunk = 0;
  void before_unit(int) override {}
  void after_unit(int, const at::Tensor&) override {}
  GradSink grad_sink(const at::Tensor& w) override {
    ++asked;
    if (!w.is_same(weight)) return {};
    return {into, 7};
  }
  void grad_sunk(int64_t id) override { sunk += id == 7 ? 1 : 100; }
};

}  // namespace

// With a sink the head's gradient, scaled by the incoming gradient, is added into the strategy's
// buffer (twice: two backwards) and autograd gets none; the hidden states' gradient is unchanged.
TEST_CASE("chunked LM loss into a gradient sink: the head's gradient added there, not autograd's") {
  const Inputs in(at::kFloat);
  const Case ref = run(in, true, true, 150);
  const at::Tensor h = in.hidden.detach().clone().requires_grad_(true);
  const at::Tensor w = in.weight.detach().clone().requires_grad_(true);
  HeadSink sink;
  sink.weight = w;
  sink.into = at::zeros_like(w);
  for (int pass = 0; pass < 2; ++pass) {
    const auto ls = chunked_lm_loss_sum(h, w, in.labels, true, 150, nullptr, &sink);
    (ls.sum * 0.37).backward();
  }
  CHECK(sink.asked == 2);
  CHECK(sink.sunk == 2);
  CHECK_FALSE(w.grad().defined());
  CHECK(rel_error(sink.into, ref.grad_weight * 2) <= 1e-6);
  CHECK(rel_error(h.grad(), ref.grad_hidden * 2) <= 1e-6);
}

TEST_CASE("chunked LM loss: a frozen head gets no gradient, and without grad mode only the loss") {
  const Inputs in(at::kFloat);
  const Case ref = run(in, false, false, 0);
  const Case got = run(in, true, false, 150);
  CHECK(!got.grad_weight.defined());
  CHECK(rel_error(got.grad_hidden, ref.grad_hidden) <= 1e-6);
  const at::NoGradGuard no_grad;
  const auto ls = chunked_lm_loss_sum(in.hidden, in.weight, in.labels, true, 150);
  CHECK(!ls.sum.requires_grad());
  CHECK(rel_error(ls.sum, ref.loss) <= 1e-6);
}

TEST_CASE("chunked LM loss in bf16 follows the unfused bf16 path within bf16's rounding") {
  const Inputs in(at::kBFloat16);
  const Case ref = run(in, false, true, 0);
  const Case got = run(in, true, true, 150);
  CHECK(got.loss.scalar_type() == at::kFloat);  // upcast, as the unfused path
  CHECK(rel_error(got.loss, ref.loss) <= 1e-3);
  CHECK(rel_error(got.grad_hidden, ref.grad_hidden) <= 2e-2);
  CHECK(rel_error(got.grad_weight, ref.grad_weight) <= 2e-2);
}

TEST_CASE("chunked LM loss refuses shapes that do not match") {
  const Inputs in(at::kFloat);
  CHECK_THROWS_AS(chunked_lm_loss_sum(in.hidden, in.weight.t(), in.labels), ft::ConfigError);
}

// The expert-parallel token exchange (parallel/expert_exchange.h) over real Gloo groups, every rank
// a thread of this process with its own group (support/inproc_ranks.h). Random routing, with an
// expert no rank routes to and a rank that routes nothing: dispatch, a per-expert function (expert
// e multiplies its rows by weights[e], about e + 1), combine, and a loss's backward, against the
// same arithmetic on one rank that holds every expert and sees every rank's rows. The exchange
// only moves rows, so outputs and gradients are equal bit for bit, in fp32 and bf16. Also EP 2
// inside a world of 4 (two EP groups side by side, the experts' gradients then summed over the
// expert-data-parallel groups of expert_parallel_layout), the one-rank identity and the refusals.
// Seconds.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <ATen/Parallel.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

#include "comm/process_group.h"
#include "core/error.h"
#include "parallel/expert_exchange.h"
#include "parallel/strategy.h"
#include "support/inproc_ranks.h"

using namespace ft;
using Catch::Matchers::Contains;

namespace {

constexpr int64_t kHidden = 8;

// One rank's routed rows.
struct Routing {
  at::Tensor rows;              // [M, H] sorted by global expert
  std::vector<int64_t> counts;  // [E] rows per global expert
  at::Tensor loss_weights;      // [M, H]: the rank's loss is sum(out * loss_weights)
};

struct Case {
  int world = 2, ep = 2;
  int64_t experts = 4;
  at::ScalarType dtype = at::kFloat;
  std::vector<Routing> routing;  // per world rank
  at::Tensor weights;            // [E, H] expert e multiplies its rows by weights[e]
};

// Up to 3 rows per (rank, expert), none for expert 1 (an expert that gets nothing) and none at all
// from `silent_rank` (-1: every rank routes some).
Case make_case(int world, int ep, int64_t experts, at::ScalarType dtype, int silent_rank,
               uint64_t seed) {
  Case c;
  c.world = world;
  c.ep = ep;
  c.experts = experts;
  c.dtype = dtype;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto opts = at::TensorOptions(dtype);
  for (int r = 0; r < world; ++r) {
    Routing rt;
    int64_t m = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t n = at::randint(0, 4, {1}, gen, at::kLong).item<int64_t>();
      rt.counts.push_back(e == 1 || r == silent_rank ? 0 : n);
      m += rt.counts.back();
    }
    rt.rows = at::randn({m, kHidden}, gen, opts);
    rt.loss_weights = at::randn({m, kHidden}, gen, opts);
    c.routing.push_back(std::move(rt));
  }
  c.weights = (at::arange(1, experts + 1, at::kFloat).unsqueeze(1) +
               0.1 * at::randn({experts, kHidden}, gen, at::kFloat))
                  .to(dtype);
  return c;
}

// Expert j (local) over its contiguous rows: rows * weights[j]. An expert without rows still
// contributes its [0, H] product, so the output requires grad on every rank alike.
at::Tensor run_experts(const at::Tensor& rows, const std::vector<int64_t>& counts,
                       const at::Tensor& weights) {
  std::vector<at::Tensor> outs;
  int64_t at_row = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    outs.push_back(rows.narrow(0, at_row, counts[j]) * weights[static_cast<int64_t>(j)]);
    at_row += counts[j];
  }
  return at::cat(outs);
}

// What one rank of the EP run saw.
struct RankResult {
  at::Tensor out, rows_grad;       // [M, H]
  at::Tensor weights_grad;         // [L, H] its local experts'
  at::Tensor weights_grad_summed;  // the same summed over its expert-DP group (world > ep)
  std::vector<int64_t> local_counts;
  int64_t dispatched_rows = -1;
  parallel::ExchangeStats stats;
};

// Dispatch, experts, combine, loss, backward: the MoE block's use of the exchange.
void exchange_and_backward(const Case& c, const parallel::ExpertExchange& ex, const Routing& rt,
                           RankResult& res) {
  at::Tensor x = rt.rows.clone().requires_grad_(true);
  at::Tensor w =
      c.weights.narrow(0, ex.first_local_expert(), ex.local_experts()).clone().requires_grad_(true);
  parallel::Dispatched d = parallel::dispatch(ex, x, rt.counts);
  res.local_counts = d.local_counts;
  res.dispatched_rows = d.rows.size(0);
  at::Tensor out = parallel::combine(ex, run_experts(d.rows, d.local_counts, w), d.plan);
  (out * rt.loss_weights).sum().backward();
  res.out = out.detach();
  res.rows_grad = x.grad();
  res.weights_grad = w.grad();
}

// World rank `rank` of case `c`: its groups from expert_parallel_layout (subgroups when EP < world,
// named per group: names are unique per process group), the exchange, and when there are several
// EP groups the experts' gradients summed over the expert-DP group.
void run_rank(const Case& c, int rank, uint16_t port, RankResult& res) {
  at::set_num_threads(1);  // 2 cores shared by every rank
  comm::ProcessGroupOptions po;
  po.timeout = test::kInprocTimeout;
  comm::ProcessGroup world(test::inproc_rank_env(rank, c.world, port), po);
  const auto layout = parallel::expert_parallel_layout(c.world, rank, c.ep, c.world);
  std::unique_ptr<comm::ProcessGroup> ep_group, expert_dp;
  if (c.ep < c.world) {
    ep_group = world.subgroup("ep" + std::to_string(layout.ep_group), layout.ep_ranks);
    expert_dp =
        world.subgroup("expert_dp" + std::to_string(layout.ep_rank), layout.expert_dp_ranks);
  }
  parallel::ExpertExchange ex(ep_group ? ep_group.get() : &world, c.experts);
  exchange_and_backward(c, ex, c.routing[rank], res);
  res.stats = ex.stats();
  if (expert_dp) {
    std::vector<at::Tensor> sum{res.weights_grad.clone()};
    expert_dp->backend().allreduce(sum)->wait();
    res.weights_grad_summed = sum[0];
  }
  // Every rank is done with the groups before any rank destroys its end of them.
  world.backend().barrier()->wait();
}

// One rank holding every expert, given the rows of `ranks` (an EP group): each expert's rows from
// all of them in rank order, multiplied, handed back to their ranks; the same loss summed.
struct Reference {
  std::vector<at::Tensor> out, rows_grad;  // per rank of `ranks`
  at::Tensor weights_grad;                 // [E, H]
  std::vector<int64_t> expert_rows;        // [E] over all of `ranks`
};

Reference reference(const Case& c, const std::vector<int>& ranks) {
  at::set_num_threads(1);  // as the ranks ran
  const size_t R = ranks.size();
  std::vector<at::Tensor> xs;
  for (int r : ranks) xs.push_back(c.routing[r].rows.clone().requires_grad_(true));
  at::Tensor w = c.weights.clone().requires_grad_(true);
  std::vector<std::vector<at::Tensor>> outs(R);
  std::vector<int64_t> start(R, 0);
  Reference ref;
  for (int64_t e = 0; e < c.experts; ++e) {
    std::vector<at::Tensor> segs;
    std::vector<int64_t> sizes;
    for (size_t i = 0; i < R; ++i) {
      sizes.push_back(c.routing[ranks[i]].counts[e]);
      segs.push_back(xs[i].narrow(0, start[i], sizes.back()));
      start[i] += sizes.back();
    }
    at::Tensor y = at::cat(segs) * w[e];
    ref.expert_rows.push_back(y.size(0));
    auto pieces = y.split_with_sizes(sizes);
    for (size_t i = 0; i < R; ++i) outs[i].push_back(pieces[i]);
  }
  at::Tensor loss = at::zeros({}, c.dtype);
  for (size_t i = 0; i < R; ++i) {
    ref.out.push_back(at::cat(outs[i]));
    loss = loss + (ref.out.back() * c.routing[ranks[i]].loss_weights).sum();
  }
  loss.backward();
  for (size_t i = 0; i < R; ++i) {
    ref.out[i] = ref.out[i].detach();
    ref.rows_grad.push_back(xs[i].grad());
  }
  ref.weights_grad = w.grad();
  return ref;
}

// What the exchanges of EP rank `p` of `ranks` must have moved: the forward dispatch and the
// backward of combine send its rows for other ranks' experts, the forward combine and the
// backward of dispatch return the rows other ranks sent it, plus one count exchange.
int64_t expected_bytes(const Case& c, const std::vector<int>& ranks, int p) {
  const int64_t N = static_cast<int64_t>(ranks.size()), L = c.experts / N;
  const int64_t row_bytes = kHidden * at::elementSize(c.dtype);
  int64_t away = 0, back = 0;
  for (int64_t q = 0; q < N; ++q)
    for (int64_t j = 0; j < L; ++j)
      if (q != p) {
        away += c.routing[ranks[p]].counts[q * L + j];
        back += c.routing[ranks[q]].counts[p * L + j];
      }
  const int64_t header = (N - 1) * (L + 2) * static_cast<int64_t>(sizeof(int64_t));
  return 2 * (away + back) * row_bytes + header;
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.sizes() == b.sizes() && at::equal(a, b);
}

// Case `c` on its ranks against one rank per EP group: everything bit for bit.
void check_against_one_rank(const Case& c) {
  std::vector<RankResult> res(c.world);
  const auto errors = test::run_rank_threads(
      c.world, [&](int rank, uint16_t port) { run_rank(c, rank, port, res[rank]); });
  INFO(test::rank_errors(errors));
  REQUIRE(test::rank_errors(errors).empty());

  const int64_t L = c.experts / c.ep;
  std::vector<at::Tensor> group_grads;
  for (int g = 0; g < c.world / c.ep; ++g) {
    std::vector<int> ranks;
    for (int p = 0; p < c.ep; ++p) ranks.push_back(g * c.ep + p);
    const Reference ref = reference(c, ranks);
    group_grads.push_back(ref.weights_grad);
    for (int p = 0; p < c.ep; ++p) {
      const int rank = ranks[p];
      const RankResult& r = res[rank];
      INFO("world rank " << rank << " (EP group " << g << ", EP rank " << p << ")");
      CHECK(same(r.out, ref.out[p]));
      CHECK(same(r.rows_grad, ref.rows_grad[p]));
      CHECK(same(r.weights_grad, ref.weights_grad.narrow(0, p * L, L)));
      const std::vector<int64_t> want_counts(ref.expert_rows.begin() + p * L,
                                             ref.expert_rows.begin() + (p + 1) * L);
      CHECK(r.local_counts == want_counts);
      int64_t want_rows = 0;
      for (int64_t n : want_counts) want_rows += n;
      CHECK(r.dispatched_rows == want_rows);
      CHECK(r.stats.dispatches == 2);  // forward, and the backward of combine
      CHECK(r.stats.combines == 2);    // forward, and the backward of dispatch
      CHECK(r.stats.bytes_sent == expected_bytes(c, ranks, p));
      CHECK(r.stats.bytes_received == expected_bytes(c, ranks, p));
      CHECK(r.stats.dispatch_s > 0);
      CHECK(r.stats.combine_s > 0);
    }
  }
  if (c.world == c.ep) return;
  // The expert-DP groups ({p, p + N, ...}) sum each expert's gradient over the EP groups: with two
  // groups, the two references' sum (a + b is the same either way round).
  REQUIRE(group_grads.size() == 2);
  const at::Tensor total = group_grads[0] + group_grads[1];
  for (int rank = 0; rank < c.world; ++rank) {
    INFO("world rank " << rank);
    const int p = rank % c.ep;
    CHECK(same(res[rank].weights_grad_summed, total.narrow(0, p * L, L)));
  }
}

}  // namespace

TEST_CASE("expert exchange on 2 ranks equals one rank with every expert, bit for bit", "[unit]") {
  SECTION("2 experts per rank, both ranks route") {
    check_against_one_rank(make_case(2, 2, 4, at::kFloat, -1, 11));
  }
  SECTION("2 experts per rank, rank 1 routes nothing") {
    check_against_one_rank(make_case(2, 2, 4, at::kFloat, 1, 12));
  }
  SECTION("1 expert per rank") { check_against_one_rank(make_case(2, 2, 2, at::kFloat, -1, 13)); }
  SECTION("bf16") { check_against_one_rank(make_case(2, 2, 4, at::kBFloat16, -1, 14)); }
}

TEST_CASE("expert exchange on 4 ranks, and EP 2 x expert-DP 2 in a world of 4", "[unit]") {
  SECTION("EP 4, 3 experts per rank, rank 2 routes nothing") {
    check_against_one_rank(make_case(4, 4, 12, at::kFloat, 2, 21));
  }
  SECTION("EP 2 in a world of 4: two EP groups side by side, rank 3 routes nothing") {
    check_against_one_rank(make_case(4, 2, 4, at::kFloat, 3, 22));
  }
}

TEST_CASE("expert exchange on one rank is the identity and refuses bad routing", "[unit]") {
  const parallel::ExpertExchange ex(nullptr, 4);
  CHECK(ex.ep_size() == 1);
  CHECK(ex.local_experts() == 4);
  at::Tensor x = at::randn({5, kHidden}).requires_grad_(true);
  const std::vector<int64_t> counts{2, 0, 3, 0};
  parallel::Dispatched d = parallel::dispatch(ex, x, counts);
  CHECK(d.rows.is_same(x));
  CHECK(d.local_counts == counts);
  at::Tensor y = d.rows * 2;
  CHECK(parallel::combine(ex, y, d.plan).is_same(y));
  CHECK(ex.stats().dispatches == 0);
  CHECK(ex.stats().bytes_sent == 0);

  CHECK_THROWS_WITH(parallel::dispatch(ex, x, {2, 0, 3}),
                    Contains("counts_per_expert has 3 entries but the layer has 4 experts"));
  CHECK_THROWS_WITH(parallel::dispatch(ex, x, {2, 0, 4, -1}),
                    Contains("counts_per_expert[3] = -1 is negative"));
  CHECK_THROWS_WITH(parallel::dispatch(ex, x, {2, 0, 3, 1}),
                    Contains("counts_per_expert sum to 6 rows but rows_sorted has 5"));
  CHECK_THROWS_WITH(parallel::dispatch(ex, at::randn({5}), {2, 0, 3, 0}),
                    Contains("rows_sorted must be [rows, hidden]"));
  CHECK_THROWS_WITH(parallel::combine(ex, at::randn({4, kHidden}), d.plan),
                    Contains("the 5 rows dispatch gave them, got shape [4, 8]"));
  // An output made afresh instead of from the rows or the weights would leave this rank out of the
  // backward's exchange.
  CHECK_THROWS_WITH(parallel::combine(ex, at::zeros({5, kHidden}), d.plan),
                    Contains("combine's input does not require grad though the dispatched rows"));
  CHECK_THROWS_AS(parallel::ExpertExchange(nullptr, 0), ConfigError);
}

TEST_CASE("expert exchange refuses experts that do not split, and rows that differ between ranks",
          "[unit]") {
  std::vector<std::vector<std::string>> seen(2);
  const auto errors = test::run_rank_threads(2, [&](int rank, uint16_t port) {
    at::set_num_threads(1);
    comm::ProcessGroupOptions po;
    po.timeout = test::kInprocTimeout;
    comm::ProcessGroup world(test::inproc_rank_env(rank, 2, port), po);
    auto attempt = [&](const std::function<void()>& f) {
      try {
        f();
        seen[rank].push_back("");
      } catch (const ConfigError& e) {
        seen[rank].push_back(e.what());
      }
    };
    attempt([&] { parallel::ExpertExchange(&world, 3); });
    const parallel::ExpertExchange ex(&world, 4);
    const std::vector<int64_t> counts{1, 1, 1, 1};
    // Rank 1's rows are wider, then of another dtype: each rank learns it from the count exchange.
    attempt([&] { parallel::dispatch(ex, at::zeros({4, rank == 0 ? 8 : 6}), counts); });
    attempt([&] {
      parallel::dispatch(ex, at::zeros({4, 8}, rank == 0 ? at::kFloat : at::kBFloat16), counts);
    });
    // The group is still in step: a good exchange goes through. Every rank sends one row (its
    // rank's value) per expert; each EP rank gets, per local expert, rank 0's row then rank 1's.
    // No grad here: the rows need no backward.
    attempt([&] {
      auto d = parallel::dispatch(ex, at::full({4, 8}, static_cast<double>(rank)), counts);
      const at::Tensor want = at::tensor({0.f, 1.f, 0.f, 1.f}).unsqueeze(1).expand({4, 8});
      if (!at::equal(d.rows, want))
        throw ConfigError("rank " + std::to_string(rank) + " received the wrong rows");
      // Experts whose output is wider than their input: the rows come home all the same.
      const at::Tensor back = parallel::combine(ex, at::cat({d.rows, 2 * d.rows}, 1), d.plan);
      if (!at::equal(back, at::full({4, 16}, static_cast<double>(rank)) *
                               at::cat({at::ones({8}), at::full({8}, 2.0)})))
        throw ConfigError("rank " + std::to_string(rank) + " got the wrong rows back");
    });
    world.backend().barrier()->wait();
  });
  INFO(test::rank_errors(errors));
  REQUIRE(test::rank_errors(errors).empty());
  for (int rank = 0; rank < 2; ++rank) {
    INFO("rank " << rank);
    REQUIRE(seen[rank].size() == 4);
    CHECK_THAT(seen[rank][0], Contains("strategy.expert_parallel=2 must divide the model's number "
                                       "of experts (3)"));
    CHECK_THAT(seen[rank][1], Contains("EP rank " + std::to_string(1 - rank) +
                                       " routes rows of width " + (rank == 0 ? "6" : "8")));
    CHECK_THAT(seen[rank][2], Contains("every member of an EP group must run the same model"));
    CHECK(seen[rank][3].empty());
  }
}

TEST_CASE("expert_parallel_layout: contiguous EP groups, strided expert-DP groups", "[unit]") {
  const auto l = parallel::expert_parallel_layout(8, 5, 4, 4);
  CHECK(l.ep_size == 4);
  CHECK(l.ep_rank == 1);
  CHECK(l.ep_group == 1);
  CHECK(l.ep_ranks == std::vector<int>{4, 5, 6, 7});
  CHECK(l.expert_dp_ranks == std::vector<int>{1, 5});
  CHECK(l.within_node);
  // 2 ranks per node: a group of 4 spans two nodes; of 3 per node, groups of 2 straddle them.
  CHECK_FALSE(parallel::expert_parallel_layout(8, 5, 4, 2).within_node);
  CHECK_FALSE(parallel::expert_parallel_layout(6, 0, 2, 3).within_node);
  CHECK(parallel::expert_parallel_layout(6, 0, 3, 3).within_node);
  const auto one = parallel::expert_parallel_layout(4, 2, 1, 4);
  CHECK(one.ep_ranks == std::vector<int>{2});
  CHECK(one.expert_dp_ranks == std::vector<int>{0, 1, 2, 3});
  const auto all = parallel::expert_parallel_layout(4, 2, 4, 2);
  CHECK(all.ep_rank == 2);
  CHECK(all.expert_dp_ranks == std::vector<int>{2});
  CHECK_THROWS_WITH(parallel::expert_parallel_layout(8, 0, 3, 8),
                    Contains("strategy.expert_parallel=3 must divide the world size (8 ranks); use "
                             "one of 1, 2, 4, 8"));
  CHECK_THROWS_AS(parallel::expert_parallel_layout(8, 0, 0, 8), ConfigError);
}

#include "parallel/expert_exchange.h"

#include <c10/util/accumulate.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <chrono>
#include <numeric>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/process_group.h"
#include "core/error.h"

namespace ft::parallel {

struct ExpertExchange::State {
  comm::ProcessGroup* group = nullptr;  // nullptr: one rank
  int rank = 0, size = 1;
  int64_t num_experts = 0, local_experts = 0;
  ExchangeStats stats;
};

ExpertExchange::ExpertExchange(comm::ProcessGroup* ep_group, int64_t num_experts)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.group = ep_group && ep_group->size() > 1 ? ep_group : nullptr;
  s.rank = s.group ? s.group->rank() : 0;
  s.size = s.group ? s.group->size() : 1;
  s.num_experts = num_experts;
  FT_CHECK(num_experts >= 1, "expert exchange: a MoE layer needs at least one expert, got ",
           num_experts);
  FT_CHECK(num_experts % s.size == 0, "strategy.expert_parallel=", s.size,
           " must divide the model's number of experts (", num_experts,
           ") so that every EP rank holds as many; choose a divisor of ", num_experts);
  s.local_experts = num_experts / s.size;
}

int ExpertExchange::ep_rank() const { return state_->rank; }
int ExpertExchange::ep_size() const { return state_->size; }
int64_t ExpertExchange::num_experts() const { return state_->num_experts; }
int64_t ExpertExchange::local_experts() const { return state_->local_experts; }
int64_t ExpertExchange::first_local_expert() const { return state_->rank * state_->local_experts; }
const ExchangeStats& ExpertExchange::stats() const { return state_->stats; }
void ExpertExchange::reset_stats() { state_->stats = ExchangeStats(); }

namespace {

using State = ExpertExchange::State;

// Adds the wall time of its scope to `into`.
class Timed {
 public:
  explicit Timed(double& into) : into_(into), t0_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    into_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  double& into_;
  std::chrono::steady_clock::time_point t0_;
};

// Runs one all-to-all of `in` into `out` over the EP group and waits for it; split sizes count
// rows (dim 0), empty for equal splits. Failures are typed as the engine types them: a lost peer
// as PeerLostError, anything else c10d reports as BackendError.
void all_to_all(const State& s, at::Tensor& out, at::Tensor& in, std::vector<int64_t> out_splits,
                std::vector<int64_t> in_splits, const char* what) {
  try {
    s.group->backend().alltoall_base(out, in, out_splits, in_splits)->wait();
  } catch (const std::exception& e) {
    const std::string where =
        fmt::format("EP rank {}/{}: expert exchange ({})", s.rank, s.size, what);
    if (auto lost = comm::peer_failure(e)) throw PeerLostError(where + " failed: " + *lost);
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    if (!c10_error) throw;
    throw BackendError(where + " failed: " + c10_error->what_without_backtrace());
  }
}

// Rows x laid out in blocks (a, b) (a-major, sizes[a * B + b] rows each), laid out (b, a). A
// gather of whole rows: no arithmetic, the values are the input's bits.
at::Tensor regroup(const at::Tensor& x, const std::vector<int64_t>& sizes, int64_t A, int64_t B) {
  if (A == 1 || B == 1 || x.size(0) == 0) return x;
  std::vector<int64_t> start(sizes.size());
  std::exclusive_scan(sizes.begin(), sizes.end(), start.begin(), int64_t{0});
  std::vector<at::Tensor> blocks;
  blocks.reserve(sizes.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < A; ++a)
      if (const int64_t n = sizes[a * B + b]; n > 0)
        blocks.push_back(x.narrow(0, start[a * B + b], n));
  return at::cat(blocks);
}

// What this rank's rows weigh on the wire: the rows of `splits` not addressed to itself.
int64_t foreign_bytes(const State& s, const std::vector<int64_t>& splits, int64_t row_bytes) {
  int64_t rows = 0;
  for (int p = 0; p < s.size; ++p)
    if (p != s.rank) rows += splits[p];
  return rows * row_bytes;
}

// Moves rows laid out by destination (`send` rows to each EP rank) to their ranks; returns what
// arrived, laid out by source (`recv` rows from each).
at::Tensor move_rows(State& s, const at::Tensor& x, const std::vector<int64_t>& send,
                     const std::vector<int64_t>& recv, int64_t rows_out, const char* what) {
  at::Tensor in = x.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = rows_out;
  at::Tensor out = at::empty(shape, in.options());
  all_to_all(s, out, in, recv, send, what);
  // From the row's shape, not nbytes / rows: a rank that sends nothing still receives.
  const int64_t row_bytes =
      c10::multiply_integers(in.sizes().slice(1)) * static_cast<int64_t>(in.element_size());
  s.stats.bytes_sent += foreign_bytes(s, send, row_bytes);
  s.stats.bytes_received += foreign_bytes(s, recv, row_bytes);
  return out;
}

// Header fields after the L counts of each block the count exchange sends.
enum HeaderField { kWidth = 0, kDtype = 1, kHeaderFields = 2 };

void check_routing(const State& s, const at::Tensor& rows, const std::vector<int64_t>& counts) {
  FT_CHECK(rows.dim() == 2, "expert exchange: rows_sorted must be [rows, hidden], got shape ",
           rows.sizes());
  FT_CHECK(static_cast<int64_t>(counts.size()) == s.num_experts,
           "expert exchange: counts_per_expert has ", counts.size(), " entries but the layer has ",
           s.num_experts, " experts");
  int64_t total = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    FT_CHECK(counts[e] >= 0, "expert exchange: counts_per_expert[", e, "] = ", counts[e],
             " is negative");
    total += counts[e];
  }
  FT_CHECK(total == rows.size(0), "expert exchange: counts_per_expert sum to ", total,
           " rows but rows_sorted has ", rows.size(0), " (shape ", rows.sizes(), ")");
}

// The count exchange: each EP rank learns how many rows every member sends to each of its local
// experts, and that every member's rows have this rank's width and dtype (a mismatch would
// otherwise garble the row exchange or hang it). Every member sees a mismatch and throws.
ExchangePlan plan_exchange(State& s, const at::Tensor& rows, const std::vector<int64_t>& counts) {
  const int N = s.size;
  const int64_t L = s.local_experts, block = L + kHeaderFields;
  ExchangePlan plan;
  plan.ep_size = N;
  plan.local_experts = L;
  plan.rows_in = rows.size(0);
  at::Tensor header = at::empty({N, block}, at::kLong);
  auto h = header.accessor<int64_t, 2>();
  for (int p = 0; p < N; ++p) {
    int64_t sum = 0;
    for (int64_t j = 0; j < L; ++j) sum += h[p][j] = counts[p * L + j];
    h[p][L + kWidth] = rows.size(1);
    h[p][L + kDtype] = static_cast<int64_t>(rows.scalar_type());
    plan.send_splits.push_back(sum);
  }
  at::Tensor in = header.to(rows.device());
  at::Tensor out = at::empty_like(in);
  {
    Timed t(s.stats.counts_s);
    all_to_all(s, out, in, {}, {}, "row counts");
  }
  const int64_t header_bytes = block * static_cast<int64_t>(sizeof(int64_t)) * (N - 1);
  s.stats.bytes_sent += header_bytes;
  s.stats.bytes_received += header_bytes;
  at::Tensor got = out.cpu();
  auto g = got.accessor<int64_t, 2>();
  plan.local_counts.assign(L, 0);
  for (int src = 0; src < N; ++src) {
    FT_CHECK(g[src][L + kWidth] == rows.size(1) &&
                 g[src][L + kDtype] == static_cast<int64_t>(rows.scalar_type()),
             "expert exchange: EP rank ", src, " routes rows of width ", g[src][L + kWidth],
             " and dtype ", static_cast<at::ScalarType>(g[src][L + kDtype]), " but EP rank ",
             s.rank, " routes ", rows.size(1), " and ", rows.scalar_type(),
             "; every member of an EP group must run the same model and precision");
    int64_t sum = 0;
    for (int64_t j = 0; j < L; ++j) {
      plan.recv_counts.push_back(g[src][j]);
      plan.local_counts[j] += g[src][j];
      sum += g[src][j];
    }
    plan.recv_splits.push_back(sum);
    plan.rows_out += sum;
  }
  return plan;
}

// The plan's row movements, each direction one all-to-all and one regrouping.
at::Tensor to_experts(State& s, const ExchangePlan& plan, const at::Tensor& rows) {
  Timed t(s.stats.dispatch_s);
  s.stats.dispatches++;
  at::Tensor got =
      move_rows(s, rows, plan.send_splits, plan.recv_splits, plan.rows_out, "dispatch");
  return regroup(got, plan.recv_counts, plan.ep_size, plan.local_experts);
}

at::Tensor from_experts(State& s, const ExchangePlan& plan, const at::Tensor& rows) {
  Timed t(s.stats.combine_s);
  s.stats.combines++;
  // The (source, expert) counts seen from the experts' side: expert-major.
  const int64_t N = plan.ep_size, L = plan.local_experts;
  std::vector<int64_t> by_expert(N * L);
  for (int64_t src = 0; src < N; ++src)
    for (int64_t j = 0; j < L; ++j) by_expert[j * N + src] = plan.recv_counts[src * L + j];
  return move_rows(s, regroup(rows, by_expert, L, N), plan.recv_splits, plan.send_splits,
                   plan.rows_in, "combine");
}

// What the autograd nodes keep: the group and stats, and the plan. A capsule is the one IValue
// that owns an arbitrary C++ object (as in model/activation_checkpoint.cpp).
struct Saved : torch::CustomClassHolder {
  std::shared_ptr<State> state;
  std::shared_ptr<const ExchangePlan> plan;
};
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Dispatch (kToExperts) or combine as an autograd node; its backward moves the gradient the
// other way over the same plan.
template <bool kToExperts>
struct ExchangeFn : torch::autograd::Function<ExchangeFn<kToExperts>> {
  static at::Tensor move(bool to_experts_now, const Saved& keep, const at::Tensor& rows) {
    return to_experts_now ? to_experts(*keep.state, *keep.plan, rows)
                          : from_experts(*keep.state, *keep.plan, rows);
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows,
                            c10::intrusive_ptr<Saved> keep) {
    at::Tensor out = move(kToExperts, *keep, rows);
    ctx->saved_data["exchange"] = c10::IValue::make_capsule(std::move(keep));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto keep =
        c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data.at("exchange").toCapsule());
    return {move(!kToExperts, *keep, grad.at(0)), at::Tensor()};
  }
};
using DispatchFn = ExchangeFn<true>;
using CombineFn = ExchangeFn<false>;

}  // namespace

Dispatched dispatch(const ExpertExchange& ex, const at::Tensor& rows_sorted,
                    const std::vector<int64_t>& counts_per_expert) {
  State& s = *ex.state();
  check_routing(s, rows_sorted, counts_per_expert);
  Dispatched d;
  if (s.size == 1) {
    auto plan = std::make_shared<ExchangePlan>();
    plan->local_experts = s.local_experts;
    plan->rows_in = plan->rows_out = rows_sorted.size(0);
    plan->send_splits = plan->recv_splits = {rows_sorted.size(0)};
    plan->recv_counts = plan->local_counts = counts_per_expert;
    plan->rows_required_grad = at::GradMode::is_enabled() && rows_sorted.requires_grad();
    d.rows = rows_sorted;
    d.local_counts = counts_per_expert;
    d.plan = std::move(plan);
    return d;
  }
  auto keep = c10::make_intrusive<Saved>();
  keep->state = ex.state();
  auto plan = std::make_shared<ExchangePlan>();
  {
    Timed t(s.stats.dispatch_s);
    *plan = plan_exchange(s, rows_sorted, counts_per_expert);
  }
  plan->rows_required_grad = at::GradMode::is_enabled() && rows_sorted.requires_grad();
  keep->plan = plan;
  d.rows = DispatchFn::apply(rows_sorted, keep);
  d.local_counts = plan->local_counts;
  d.plan = std::move(plan);
  return d;
}

at::Tensor combine(const ExpertExchange& ex, const at::Tensor& expert_out,
                   const std::shared_ptr<const ExchangePlan>& plan) {
  const State& s = *ex.state();
  FT_ASSERT(plan && plan->ep_size == s.size && plan->local_experts == s.local_experts,
            "combine: the plan was made by a dispatch over another EP group");
  FT_CHECK(expert_out.dim() == 2 && expert_out.size(0) == plan->rows_out,
           "expert exchange: combine takes the experts' output for the ", plan->rows_out,
           " rows dispatch gave them, got shape ", expert_out.sizes());
  FT_CHECK(!plan->rows_required_grad || !at::GradMode::is_enabled() || expert_out.requires_grad(),
           "expert exchange: combine's input does not require grad though the dispatched rows "
           "did: compute every expert's output from its rows even when it has none (a [0, H] "
           "product), else this rank skips the exchange of the backward the others wait in");
  if (s.size == 1) return expert_out;
  auto keep = c10::make_intrusive<Saved>();
  keep->state = ex.state();
  keep->plan = plan;
  return CombineFn::apply(expert_out, keep);
}

at::Tensor ModelExpertExchange::dispatch(const at::Tensor& rows, const std::vector<int64_t>& counts,
                                         std::vector<int64_t>& local_counts) {
  Dispatched d = parallel::dispatch(ex_, rows, counts);
  local_counts = std::move(d.local_counts);
  plan_ = std::move(d.plan);
  return d.rows;
}

at::Tensor ModelExpertExchange::combine(const at::Tensor& expert_rows) {
  FT_ASSERT(plan_, "ModelExpertExchange::combine without a dispatch before it");
  return parallel::combine(ex_, expert_rows, plan_);
}

}  // namespace ft::parallel

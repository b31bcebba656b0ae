// The token exchange of expert parallelism: rows routed to experts travel to the EP rank that
// holds their expert (dispatch) and their outputs travel back (combine), by all-to-all over the EP
// group (c10d: Gloo on CPU, NCCL on CUDA), the row counts exchanged first. Both are autograd
// functions: the backward of dispatch is a combine of the gradient and the backward of combine a
// dispatch, over the splits the forward dispatch found (no second count exchange).
//
// Ordering: dispatch and combine are collectives over the EP group, so every member calls them
// the same number of times in the same order (once per MoE layer and direction, also with zero
// rows), and so does its backward. Autograd's engine runs a graph's nodes in an order fixed by its
// shape, which is the same on every rank of one model; an activation-checkpointed layer exchanges
// again when it is recomputed, on every rank alike. One ExpertExchange per EP group and thread;
// not thread-safe (its stats are plain counters). The process group must outlive every graph that
// went through it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "model/moe.h"

namespace ft::comm {
class ProcessGroup;
}

namespace ft::parallel {

// What the exchanges of this rank cost since the last reset (ep_size > 1 only; with one rank
// nothing is exchanged or counted). A dispatch moves rows toward the experts: the forward
// dispatch, and the backward of combine; a combine moves them back: the forward combine, and the
// backward of dispatch. Times are the wall time of the calls, count exchange and regrouping
// included. On NCCL a collective's wait only orders the streams, so they are the time to enqueue
// plus the count exchange's copy to the host (which waits for the device), not the transfer.
struct ExchangeStats {
  int64_t dispatches = 0, combines = 0;
  double dispatch_s = 0, combine_s = 0;
  // Of dispatch_s, the seconds in the exchange of row counts that starts each dispatch: a few
  // bytes, so mostly this rank waiting for the slowest of its EP group to reach the layer (their
  // skew: load imbalance, a slower rank), not moving rows.
  double counts_s = 0;
  // What left this rank for, and arrived from, other ranks: rows and the count headers (a rank's
  // rows for its own experts are not counted: they never leave it).
  int64_t bytes_sent = 0, bytes_received = 0;
};

// Which rows a dispatch sent where and how its experts' rows are grouped: what combine and both
// backwards reuse. N = ep_size, L = local experts (num_experts / N).
struct ExchangePlan {
  int ep_size = 1;
  int64_t local_experts = 0;
  int64_t rows_in = 0;               // M: the rows this rank routed (sum of its counts)
  int64_t rows_out = 0;              // M': the rows its local experts received
  std::vector<int64_t> send_splits;  // [N] rows sent to each EP rank (its experts' counts summed)
  std::vector<int64_t> recv_splits;  // [N] rows received from each EP rank
  // [N * L] rows received from source rank s for local expert j, at s * L + j.
  std::vector<int64_t> recv_counts;
  std::vector<int64_t> local_counts;  // [L] rows per local expert (over all sources)
  bool rows_required_grad = false;    // the dispatched rows did (grad mode on, input required it)
};

// One MoE layer's view of its EP group: EP rank p holds the contiguous global experts
// [p * L, (p + 1) * L), L = num_experts / ep_size. Cheap to copy (copies share the group and
// stats).
class ExpertExchange {
 public:
  // `ep_group`: the EP group, whose rank is the EP rank; nullptr for one rank holding every expert
  // (dispatch and combine are then identities). FT_CHECKs that ep_size divides num_experts.
  ExpertExchange(comm::ProcessGroup* ep_group, int64_t num_experts);
  int ep_rank() const;
  int ep_size() const;
  int64_t num_experts() const;
  int64_t local_experts() const;
  int64_t first_local_expert() const;  // ep_rank * local_experts
  const ExchangeStats& stats() const;
  void reset_stats();

  // The group and the stats, shared with the autograd nodes that dispatch and combine create
  // (they outlive this object when a graph does).
  struct State;
  const std::shared_ptr<State>& state() const { return state_; }

 private:
  std::shared_ptr<State> state_;
};

struct Dispatched {
  // [M', H] the caller's dtype: the rows of this rank's local experts, grouped by local expert (for
  // local expert j: the rows from EP rank 0 for j, then from rank 1, ...), each source's rows in
  // the order it sent them.
  at::Tensor rows;
  std::vector<int64_t> local_counts;         // [L] rows per local expert, summing to M'
  std::shared_ptr<const ExchangePlan> plan;  // for combine
};

// Sends each row to its expert's EP rank. `rows_sorted` [M, H] (any dtype, on the group's device)
// is sorted by global expert (a stable sort of the routed rows); `counts_per_expert` [E] says how
// many rows each global expert has, summing to M. Collective over the EP group. Differentiable
// with respect to `rows_sorted`. FT_CHECKs the shapes and counts before anything is sent, and that
// every member sends rows of the same width and dtype.
Dispatched dispatch(const ExpertExchange& ex, const at::Tensor& rows_sorted,
                    const std::vector<int64_t>& counts_per_expert);

// The inverse of the dispatch that made `plan`: `expert_out` [M', H'] (rows in Dispatched::rows'
// order; H' may differ from H but is the same on every member) goes back to the rows' ranks,
// [M, H'] in the order of the dispatch's `rows_sorted`. Collective over the EP group.
// Differentiable with respect to `expert_out`; its backward is a collective too, so under grad
// mode `expert_out` must require grad on every member or on none: a rank whose experts received
// no rows still returns a [0, H'] tensor computed from its expert weights or the dispatched rows
// (a product over zero rows), not a fresh empty one. When the dispatched rows required grad and
// `expert_out` does not, this FT_CHECKs instead of letting the other ranks' backward hang.
at::Tensor combine(const ExpertExchange& ex, const at::Tensor& expert_out,
                   const std::shared_ptr<const ExchangePlan>& plan);

// The model's side of the exchange (model::ExpertExchange) over an EP group: each MoE layer's
// dispatch keeps its plan for the combine that follows it (an activation-checkpointed layer's
// recompute dispatches and combines again, in the same order). One per model; not thread-safe.
class ModelExpertExchange : public model::ExpertExchange {
 public:
  explicit ModelExpertExchange(parallel::ExpertExchange ex) : ex_(std::move(ex)) {}
  int64_t first_local_expert() const override { return ex_.first_local_expert(); }
  int64_t num_local_experts() const override { return ex_.local_experts(); }
  at::Tensor dispatch(const at::Tensor& rows, const std::vector<int64_t>& counts,
                      std::vector<int64_t>& local_counts) override;
  at::Tensor combine(const at::Tensor& expert_rows) override;
  const parallel::ExpertExchange& exchange() const { return ex_; }
  void reset_stats() { ex_.reset_stats(); }

 private:
  parallel::ExpertExchange ex_;
  std::shared_ptr<const ExchangePlan> plan_;
};

}  // namespace ft::parallel

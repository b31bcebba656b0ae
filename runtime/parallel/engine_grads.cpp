// Engine: gradients from autograd's hooks and sinks into the groups' accumulators, reduced by
// buckets, handed to the host, and the micro-batch protocol (parallel/engine.h).
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>

#include <chrono>
#include <optional>

#include "parallel/engine.h"
#include "parallel/engine_parts.h"

namespace ft::parallel {

using namespace engine_detail;

// ---- gradients ----

void Engine::on_param_grad(int ui, int gi, int mi, const at::Tensor& param) {
  at::NoGradGuard no_grad;
  Unit& u = *units_[ui];
  Group& g = u.groups[gi];
  const Member& m = g.members[mi];
  at::Tensor& grad = param.mutable_grad();
  // A weight whose backward added its gradient itself (grad_sink) still reaches its hook, without
  // a gradient: grad_sunk has counted it.
  if (!grad.defined() && sink_of_.count(param.unsafeGetTensorImpl())) return;
  FT_ASSERT(grad.defined(), "gradient hook without a gradient for ", m.name);
  // A sparse gradient (the embedding's rows, DecoderModel::set_sparse_embedding_grad on the CPU)
  // adds its rows, in token order, where a dense one adds the whole [vocab, hidden] tensor.
  auto add_into = [&](at::Tensor dst) {
    if (!grad.is_sparse()) {
      // An offloaded accumulator: added on the host's own thread (host_add).
      if (g.layout.shards == 1 && g.master_host)
        g.host_ticket = host_add(dst, grad.reshape({-1}));
      else
        dst.add_(grad.reshape({-1}));
      return;
    }
    const at::Tensor rows = grad._indices().select(0, 0);
    const at::Tensor values = grad._values().reshape({rows.size(0), -1});
    dst.view({grad.size(0), -1}).index_add_(0, rows, values.to(dst.scalar_type()));
  };
  if (g.layout.shards == 1) {
    add_into(g.grad_acc.narrow(0, m.offset, m.numel));
  } else {
    if (!g.grad_full.defined())
      g.grad_full = at::zeros({g.layout.padded}, g.full.options().dtype(options_.reduce_dtype));
    add_into(g.grad_full.narrow(0, m.offset, m.numel));
  }
  grad = at::Tensor();
  member_done(ui);
}

void Engine::member_done(int ui) {
  Unit& u = *units_[ui];
  FT_ASSERT(u.pending > 0, "unit ", u.name, ": more gradients than trained parameters");
  if (--u.pending == 0 && (!u.sharded || u.input_done)) mark_ready(ui);
}

model::UnitHooks::GradSink Engine::grad_sink(const at::Tensor& weight) {
  if (!grads_) return {};
  const auto it = sink_of_.find(weight.unsafeGetTensorImpl());
  if (it == sink_of_.end()) return {};
  const Sink& s = sinks_[static_cast<size_t>(it->second)];
  const Group& g = units_[s.unit]->groups[s.group];
  const Member& m = g.members[s.member];
  return {g.grad_acc.narrow(0, m.offset, m.numel).view(m.shape), it->second};
}

void Engine::grad_sunk(int64_t id) {
  FT_ASSERT(id >= 0 && id < static_cast<int64_t>(sinks_.size()), "unknown gradient sink ", id);
  member_done(sinks_[static_cast<size_t>(id)].unit);
}

void Engine::mark_ready(int ui) {
  Unit& u = *units_[ui];
  if (u.ready) return;
  u.ready = true;
  // Its backward is over: a sharded unit's gathered parameters can go (not the root's, which the
  // embedding's backward still reads; end_backward releases it).
  if (u.sharded && u.model_unit >= 1) {
    if (options_.backward_prefetch == BackwardPrefetch::kPost && options_.prefetch_elements < 0 &&
        u.model_unit >= 2)
      gather(unit_of_model_[u.model_unit - 1]);
    release(ui);
  }
  launch_ready();
}

void Engine::launch_ready() {
  while (launch_cursor_ < launch_order_.size() && units_[launch_order_[launch_cursor_]]->ready) {
    finalize(launch_order_[launch_cursor_]);
    ++launch_cursor_;
  }
}

// Issues the unit's gradient reduction: sharded units every micro-batch (reduce-scatter, through
// the bucket queue), replicated units once per optimizer step (all-reduce on the last micro-batch).
void Engine::finalize(int ui) {
  Unit& u = *units_[ui];
  if (u.launched) return;
  u.launched = true;
  for (size_t gi = 0; gi < u.groups.size(); ++gi) {
    Group& g = u.groups[gi];
    if (!g.trained) continue;
    if (g.layout.shards > 1) {
      if (!g.grad_full.defined())  // no gradient reached it (unused): reduce zeros all the same
        g.grad_full = at::zeros({g.layout.padded}, g.full.options().dtype(options_.reduce_dtype));
      // A bucket is reduce-scattered over one group: experts go over another one.
      if (!reduce_queue_.empty() &&
          units_[reduce_queue_[0].first]->groups[reduce_queue_[0].second].over != g.over)
        flush_reduce_queue();
      reduce_queue_.emplace_back(ui, static_cast<int>(gi));
      reduce_queue_elements_ += g.layout.padded;
    } else if (g.expert && last_micro_ && groups_.expert_dp) {
      // Each expert's gradient already holds its EP group's tokens (they came to it); the other
      // EP groups' copies add theirs.
      all_reduce_grad(g, groups_.expert_dp, final_master(u, g, false));
    } else if (!g.expert && last_micro_ && world_size_ > 1) {
      all_reduce_grad(g, groups_.world, final_master(u, g, false));
    } else if (const int m = final_master(u, g, false); m >= 0) {
      host_add(g.grad_acc, at::Tensor(), false, m);  // (its norm, after its additions)
    }
  }
  if (reduce_queue_elements_ > 0 && reduce_queue_elements_ >= options_.reduce_bucket_elements)
    flush_reduce_queue();
}

// Sums a group's step gradient over `pg`, in place or through a copy in the reduce dtype.
void Engine::all_reduce_grad(Group& g, comm::ProcessGroup* pg, int final_master) {
  auto p = std::make_unique<Pending>();
  // In place, or through a copy on the device in the reduce dtype (offloaded: the accumulator is
  // in host memory, which NCCL cannot reduce).
  if (g.master_host && host_adds_) host_adds_->drain(g.host_ticket);
  at::Tensor buf = options_.reduce_dtype == g.grad_acc.scalar_type() && !g.master_host
                       ? g.grad_acc
                       : g.grad_acc.to(options_.device, options_.reduce_dtype, false, true);
  std::vector<at::Tensor> v{buf};
  p->work = backend(pg).allreduce(v);
  p->out = buf;
  if (!buf.is_same(g.grad_acc))
    p->parts.push_back({&g, 0, g.layout.shard_numel, true, final_master});
  acc_.all_reduces++;
  acc_.all_reduce_bytes += buf.nbytes();
  issued(*p->work);
  settle_later(std::move(p));
}

void Engine::flush_reduce_queue() {
  if (reduce_queue_.empty()) return;
  comm::ProcessGroup* over = units_[reduce_queue_[0].first]->groups[reduce_queue_[0].second].over;
  const int S = over->size();
  auto p = std::make_unique<Pending>();
  at::Tensor in;
  if (reduce_queue_.size() == 1) {
    in = units_[reduce_queue_[0].first]->groups[reduce_queue_[0].second].grad_full;
  } else {
    // Rank k's slice of the bucket is every group's k-th shard, side by side.
    std::vector<at::Tensor> rows;
    for (auto [ui, gi] : reduce_queue_)
      rows.push_back(units_[ui]->groups[gi].grad_full.view({S, -1}));
    in = at::cat(rows, 1).reshape({-1});
  }
  p->out = at::empty({in.numel() / S}, in.options());
  int64_t off = 0;
  for (auto [ui, gi] : reduce_queue_) {
    Group& g = units_[ui]->groups[gi];
    p->parts.push_back({&g, off, g.layout.shard_numel, false, final_master(*units_[ui], g, false)});
    off += g.layout.shard_numel;
    p->keep.push_back(g.grad_full);
    g.grad_full = at::Tensor();
  }
  p->keep.push_back(in);
  p->work = backend(over)._reduce_scatter_base(p->out, in);
  acc_.reduce_scatters++;
  acc_.reduce_scatter_bytes += in.nbytes();
  issued(*p->work);
  settle_later(std::move(p));
  reduce_queue_.clear();
  reduce_queue_elements_ = 0;
}

// A reduction just issued: drain() folds its output into the accumulators, or, where they are in
// host memory (offload_optimizer), the host thread does as soon as the reduction completes.
void Engine::settle_later(std::unique_ptr<Pending> p) {
  if (options_.offload_optimizer)
    hand_down(std::move(p));
  else
    pending_.push_back(std::move(p));
}

// An offloaded reduction's output goes to the host thread now, while the backward goes on: a unit's
// gradient reaches its master, and its update can begin (update_can_begin_in_backward), as soon
// as its reduction is done, at any number of ranks (issue 32; before, at drain()). From a GPU it
// comes down by a copy on a side stream that waits for the reduction (NCCL's wait makes the
// current stream wait; the backward's stream does not); on the host the thread waits for the
// work itself. The jobs keep the reduction's tensors until they are done.
void Engine::hand_down(std::unique_ptr<Pending> p) {
  std::shared_ptr<Pending> keep(std::move(p));
  c10::intrusive_ptr<c10d::Work> after;
  std::optional<c10::StreamGuard> on_side;
  if (keep->out.is_cuda()) {
    on_side.emplace(*down_stream_);
    wait(*keep->work);  // (the side stream waits)
  } else {
    after = keep->work;
  }
  for (const auto& part : keep->parts) {
    Group& g = *part.group;
    g.host_ticket = host_add(g.grad_acc, keep->out.narrow(0, part.offset, part.numel), part.copy,
                             part.final_master, after, keep);
  }
}

void Engine::drain() {
  at::NoGradGuard no_grad;
  for (auto& p : pending_) {
    wait(*p->work);
    for (const auto& part : p->parts) {
      at::Tensor src = p->out.narrow(0, part.offset, part.numel);
      at::Tensor& dst = part.group->grad_acc;
      part.copy ? void(dst.copy_(src)) : void(dst.add_(src));
    }
  }
  pending_.clear();
}

namespace {
// Waits for a collective, its failure an ft error: PeerLostError when a peer is gone, else
// BackendError (the message without LibTorch's backtrace).
void wait_work(c10d::Work& work, int rank, const std::string& kind) {
  try {
    work.wait();
  } catch (const std::exception& e) {
    if (auto lost = comm::peer_failure(e))
      throw PeerLostError(fmt::format("rank {}: {} collective failed: {}", rank, kind, *lost));
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    if (!c10_error) throw;
    throw BackendError(fmt::format("rank {}: {} collective failed: {}", rank, kind,
                                   c10_error->what_without_backtrace()));
  }
}
}  // namespace

void Engine::wait(c10d::Work& work) {
  const auto t0 = std::chrono::steady_clock::now();
  wait_work(work, rank_, options_.kind);
  acc_.comm_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Engine::ensure_grads() {
  if (grads_) return;
  for (auto& u : units_)
    for (auto& g : u->groups)
      if (g.trained) {
        g.grad_acc = at::zeros({g.layout.shard_numel}, master_options(g));
        g.master.mutable_grad() = g.grad_acc;
      }
  grads_ = true;
}

void Engine::hand_over_grads() {
  for (auto& u : units_)
    for (auto& g : u->groups) {
      if (!g.trained || !g.grad_acc.defined()) continue;
      if (!g.grad_spare.defined()) g.grad_spare = at::zeros_like(g.grad_acc);
      g.master.mutable_grad() = g.grad_acc;
      std::swap(g.grad_acc, g.grad_spare);
    }
}

// Without overlap a collective is waited for here, right after it was issued; drain() and
// release() then find it complete.
void Engine::issued(c10d::Work& work) {
  if (!options_.overlap_comm) wait(work);
}

void Engine::begin_micro_batch(bool last) {
  FT_ASSERT(loaded_, "Engine used before load()");
  ensure_grads();
  if (last_micro_) {  // a new step: no gradient is final yet (the host thread is idle: drained)
    drain_host_adds();
    std::fill(grad_sq_.begin(), grad_sq_.end(), std::nan(""));
    finals_in_backward_ = 0;
  }
  last_micro_ = last;
  in_last_backward_ = last;
  for (auto& u : units_) {
    u->pending = u->trained_members;
    u->input_done = false;
    u->ready = false;
    u->launched = false;
  }
  launch_cursor_ = 0;
}

void Engine::end_backward() {
  in_last_backward_ = false;
  // Whatever did not report (units whose input needs no gradient, the root, the persistent
  // group), in the fixed order.
  for (int ui : launch_order_) {
    Unit& u = *units_[ui];
    u.ready = true;
    if (u.sharded) release(ui);
  }
  launch_ready();
  flush_reduce_queue();
  // Sharded gradients must be folded in before the next micro-batch's hooks refill grad_full;
  // replicated all-reduces (last micro-batch only) are waited for in finish_gradients.
  drain();
}

int64_t Engine::host_add(at::Tensor dst, at::Tensor src, bool copy, int final_master,
                         c10::intrusive_ptr<c10d::Work> after, std::shared_ptr<const void> keep) {
  if (!host_adds_)
    host_adds_ = std::make_unique<HostAdds>(
        [this](int master, double sq, std::exception_ptr e) {
          grad_final(master, sq, std::move(e));
        },
        [rank = rank_, kind = options_.kind](c10d::Work& w) { wait_work(w, rank, kind); });
  HostAdds::Job job{std::move(dst),   std::move(src),  copy,         nullptr,
                    std::move(after), std::move(keep), final_master, at::Tensor()};
  if (job.src.defined() && job.src.is_cuda()) {
    // Down on down_stream_, beside the backward's kernels, once the work queued so far on the
    // current stream (what made src) is done; the job keeps src (a block of that stream's pool)
    // until the copy has run. (hand_down calls from down_stream_, which needs no event.)
    FT_ASSERT(down_stream_, "offloaded GPU gradient without the engine's side stream");
    const c10::Stream current =
        c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(job.src.device());
    if (current != *down_stream_) {
      c10::Event made(c10::DeviceType::CUDA);
      made.record(current);
      made.block(*down_stream_);
    }
    const c10::StreamGuard on_down(*down_stream_);
    at::Tensor down =
        at::empty(job.src.sizes(), job.src.options().device(at::kCPU).pinned_memory(true));
    down.copy_(job.src, /*non_blocking=*/true);
    job.ready = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    job.ready->record(*down_stream_);
    job.device_src = std::exchange(job.src, down);
  }
  // (Added even on the step's first micro-batch, into zeros: a copy would keep a gradient's -0,
  // which 0 + x makes +0, and the first moment can carry that sign.)
  return host_adds_->push(std::move(job));
}

// Group g's master when this write makes its accumulator final (the host thread then takes its
// norm: grad_final), else -1: an offloaded fp32 / fp64 accumulator on the step's last
// micro-batch, with no reduction after this one (HYBRID_SHARD's replicas add theirs later:
// `replica_pass` is that one). Not for fp16, whose gradients the trainer unscales before their
// norm.
int Engine::final_master(const Unit& u, const Group& g, bool replica_pass) {
  if (!last_micro_ || !g.trained || !g.master_host || options_.compute_dtype == at::kHalf ||
      (g.grad_acc.scalar_type() != at::kFloat && g.grad_acc.scalar_type() != at::kDouble))
    return -1;
  const bool replica_follows =
      groups_.replica && groups_.replica->size() > 1 && u.sharded && !g.expert;
  if (replica_follows && !replica_pass) return -1;
  return g.master_index;
}

double Engine::grad_sq_beside_backward(size_t master) const { return grad_sq_.at(master); }

void Engine::drain_host_adds() {
  if (host_adds_) host_adds_->drain();
}

void Engine::finish_gradients() {
  drain();
  if (groups_.replica && groups_.replica->size() > 1) {
    // HYBRID_SHARD: the shards are reduced inside the node; replicas add theirs across nodes.
    // (Sharded experts were reduced over all the ranks holding them.)
    for (auto& u : units_) {
      if (!u->sharded) continue;
      for (auto& g : u->groups) {
        if (!g.trained || g.expert) continue;
        all_reduce_grad(g, groups_.replica, final_master(*u, g, true));
      }
    }
    drain();
  }
  drain_host_adds();
}

}  // namespace ft::parallel

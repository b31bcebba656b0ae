// Engine: gathering each unit's parameters before the forward and backward use them, releasing them
// after, prefetching (parallel/engine.h).
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "parallel/engine.h"
#include "parallel/engine_parts.h"

namespace ft::parallel {

using namespace engine_detail;

// ---- gathering ----

void Engine::gather(int ui) {
  Unit& u = *units_[ui];
  if (!u.sharded || u.state != Unit::State::kReleased) return;
  await_update(u.model_unit);  // (its shard is what the gather reads)
  for (auto& g : u.groups) {
    alloc_storage(g.full, g.full_bytes());
    at::Tensor src = g.shard;
    std::optional<c10::StreamGuard> on_up;
    if (g.shard_host && g.full.is_cuda()) {
      // Up on a stream of its own, the collective after it there: shard_up.
      src = shard_up(g);
      on_up.emplace(*up_stream_);
      src.copy_(g.shard, /*non_blocking=*/true);
      u.gather_inputs.push_back(src);
    } else if (g.shard_host) {
      src = g.shard.to(g.full.device(), /*non_blocking=*/true, /*copy=*/true);
      u.gather_inputs.push_back(src);
    }
    u.gathers.push_back(backend(g.over)._allgather_base(g.full, src));
    acc_.all_gathers++;
    acc_.all_gather_bytes += g.full_bytes();
    acc_.gathered_bytes += g.full_bytes();
  }
  acc_.gathered_peak_bytes = std::max(acc_.gathered_peak_bytes, acc_.gathered_bytes);
  u.state = Unit::State::kGathering;
  if (!options_.overlap_comm) ensure_gathered(ui);
}

// An offloaded (page-locked) shard's device buffer for its gather. The copy into it and the
// gather run on up_stream_, so that the copy runs beside the compute stream's kernels instead of
// between them (before, a prefetched unit's copy up delayed the running unit's kernels by its
// transfer time; issue 32). NCCL's collective waits for the stream it is issued on, which holds
// the copy; ensure_gathered makes the compute stream wait for the collective. The buffer, and the
// gathered `full` the collective writes, come from the compute stream's pool, so up_stream_
// first waits for the compute stream's work queued so far (whoever used those blocks before).
at::Tensor Engine::shard_up(const Group& g) {
  const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  const c10::Device device = g.full.device();
  FT_ASSERT(up_stream_, "offloaded GPU shard without the engine's side stream");
  at::Tensor dst = at::empty(g.shard.sizes(), g.shard.options().device(device));
  c10::Event compute_so_far(c10::DeviceType::CUDA);
  compute_so_far.record(cuda.getStream(device));
  compute_so_far.block(*up_stream_);
  return dst;
}

void Engine::ensure_gathered(int ui) {
  Unit& u = *units_[ui];
  if (!u.sharded) return;
  gather(ui);
  if (u.state == Unit::State::kGathering) {
    for (auto& w : u.gathers) wait(*w);
    u.gathers.clear();
    u.gather_inputs.clear();
    u.state = Unit::State::kGathered;
  }
}

void Engine::release(int ui) {
  Unit& u = *units_[ui];
  if (!u.sharded || u.state == Unit::State::kReleased) return;
  for (auto& w : u.gathers) wait(*w);
  u.gathers.clear();
  u.gather_inputs.clear();
  for (auto& g : u.groups) {
    free_storage(g.full);
    acc_.gathered_bytes -= g.full_bytes();
  }
  u.state = Unit::State::kReleased;
}

// Gathers the units after model unit `from` in direction `step` (+1 forward, -1 backward) as the
// strategy's prefetch policy allows.
void Engine::prefetch(int from, int step) {
  const int n = model_.num_units();
  if (options_.prefetch_elements >= 0) {  // zero3: by elements
    int64_t ahead = 0;
    for (int mu = from + step; mu >= 1 && mu < n; mu += step) {
      ahead += units_[unit_of_model_[mu]]->elements();
      if (ahead > options_.prefetch_elements) break;
      gather(unit_of_model_[mu]);
    }
    return;
  }
  const int next = from + step;
  if (next < 1 || next >= n) return;
  if (step > 0 && options_.forward_prefetch) gather(unit_of_model_[next]);
  if (step < 0 && options_.backward_prefetch == BackwardPrefetch::kPre)
    gather(unit_of_model_[next]);
}

void Engine::before_unit(int mu) {
  await_update(mu);
  if (!gather_hooks_) return;
  const int ui = unit_of_model_.at(mu);
  if (ui < 0) return;
  ensure_gathered(ui);
  if (mu >= 1) prefetch(mu, +1);
}

void Engine::after_unit(int mu, const at::Tensor& output) {
  if (!gather_hooks_) return;
  const int ui = unit_of_model_.at(mu);
  if (ui < 0) return;
  if (at::GradMode::is_enabled() && output.requires_grad())
    output.register_hook([this, mu](const at::TensorBase&) { on_output_grad(mu); });
  // The root stays gathered: the head needs it at the end of forward and first in backward.
  if (mu >= 1 && options_.reshard_after_forward) release(ui);
}

// The gradient of model unit `mu`'s output exists: unit mu+1's backward is over, mu's begins.
void Engine::on_output_grad(int mu) {
  const int n = model_.num_units();
  if (mu + 1 < n) {
    Unit& next = *units_[unit_of_model_[mu + 1]];
    next.input_done = true;
    if (next.pending == 0) mark_ready(unit_of_model_[mu + 1]);
  }
  if (mu >= 1) {
    ensure_gathered(unit_of_model_[mu]);
    prefetch(mu, -1);
  }
}

}  // namespace ft::parallel

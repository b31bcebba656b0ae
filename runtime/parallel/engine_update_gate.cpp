// Engine: the overlapped host update's gate: which masters' gradients are final, and the forward
// waiting for the update of the units it reads (parallel/engine.h).
#include <fmt/format.h>

#include <chrono>

#include "parallel/engine.h"
#include "parallel/engine_parts.h"

namespace ft::parallel {

using namespace engine_detail;

// ---- the overlapped host update ----

bool update_can_begin_in_backward(const EngineOptions& o, double grad_clip) {
  return o.offload_optimizer && grad_clip <= 0 && o.compute_dtype != at::kHalf &&
         (o.master_dtype == at::kFloat || o.master_dtype == at::kDouble);
}

void Engine::reset_updates(bool during_backward) {
  std::lock_guard<std::mutex> lock(update_mu_);
  collect_final_ = during_backward;
  update_next_ = 0;
  is_updated_.assign(masters_.size(), 0);
  final_masters_.clear();
  update_error_ = nullptr;
  updates_cancelled_ = false;
}

// The first model unit a master not yet updated is read by, less one (INT_MAX: all updated).
int Engine::updated_through_locked() const {
  return update_next_ < update_order_.size() ? update_order_[update_next_].model_unit - 1
                                             : std::numeric_limits<int>::max();
}

void Engine::close_updates() {
  std::lock_guard<std::mutex> lock(update_mu_);
  updates_closed_ = true;
  updated_through_ = updated_through_locked();
}

at::Tensor Engine::update_staging(size_t i) const {
  const auto [ui, gi] = group_of_master_.at(i);
  const Group& g = units_[static_cast<size_t>(ui)]->groups[static_cast<size_t>(gi)];
  if (g.master.is_same(g.shard) || g.copy_out.defined() || !g.shard.is_cuda() ||
      !g.master.is_cpu() || g.master.scalar_type() != at::kFloat ||
      g.shard.scalar_type() == at::kFloat)
    return at::Tensor();
  return at::empty(g.master.sizes(),
                   g.master.options().dtype(g.shard.scalar_type()).pinned_memory(true));
}

void Engine::updated(size_t i, const at::Tensor& staged) {
  at::NoGradGuard no_grad;
  const auto [ui, gi] = group_of_master_.at(i);
  Group& g = units_[static_cast<size_t>(ui)]->groups[static_cast<size_t>(gi)];
  if (!g.copy_out.defined()) refresh_shard(g, staged);
  {
    std::lock_guard<std::mutex> lock(update_mu_);
    FT_ASSERT(!is_updated_.at(i), "Engine::updated: master ", i, " updated twice");
    is_updated_[i] = 1;
    while (update_next_ < update_order_.size() && is_updated_[update_order_[update_next_].master])
      ++update_next_;
    if (updates_closed_) updated_through_ = updated_through_locked();
  }
  update_cv_.notify_all();
}

void Engine::open_updates(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(update_mu_);
    updates_closed_ = false;
    collect_final_ = false;
    updated_through_ = std::numeric_limits<int>::max();
    if (error) update_error_ = std::move(error);
  }
  update_cv_.notify_all();
}

void Engine::grad_final(int master, double sq, std::exception_ptr error) {
  // (Read after drain_host_adds, which returns after this.)
  grad_sq_[static_cast<size_t>(master)] = sq;
  if (in_last_backward_.load()) ++finals_in_backward_;
  {
    std::lock_guard<std::mutex> lock(update_mu_);
    if (!collect_final_) return;
    final_masters_.push_back({master, std::move(error)});
  }
  update_cv_.notify_all();
}

size_t Engine::next_final_master() {
  std::unique_lock<std::mutex> lock(update_mu_);
  update_cv_.wait(lock, [&] { return !final_masters_.empty() || updates_cancelled_; });
  if (final_masters_.empty()) throw Error("the host update was cancelled: the step did not finish");
  auto [i, error] = std::move(final_masters_.front());
  final_masters_.pop_front();
  if (error) std::rethrow_exception(error);
  return static_cast<size_t>(i);
}

void Engine::cancel_updates() {
  {
    std::lock_guard<std::mutex> lock(update_mu_);
    updates_cancelled_ = true;
  }
  update_cv_.notify_all();
}

void Engine::await_update(int model_unit) {
  std::unique_lock<std::mutex> lock(update_mu_);
  // (A failed update may have been closed after it failed: its error ends the wait.)
  if (updated_through_ < model_unit && !update_error_) {
    const auto t0 = std::chrono::steady_clock::now();
    update_cv_.wait(lock, [&] { return updated_through_ >= model_unit || update_error_; });
    update_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (update_error_) std::rethrow_exception(update_error_);
}

double Engine::take_update_wait_s() {
  std::lock_guard<std::mutex> lock(update_mu_);
  return std::exchange(update_wait_s_, 0.0);
}

}  // namespace ft::parallel

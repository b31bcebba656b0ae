#include "train/launcher_link.h"

#include <algorithm>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace ft::train {

namespace {
// A save not measured yet is guessed from this rank's share of a checkpoint (an fp32 master and
// Adam's two moments per trained element) at a write rate slow shared storage still reaches.
constexpr double kAssumedSaveBytesPerS = 200e6;
constexpr double kAssumedSaveFixedS = 2;  // fsync, meta.json, the commit's rename
}  // namespace

LauncherLink::LauncherLink(c10d::Store* store, int rank, std::function<int64_t()> state_elements)
    : store_(store), rank_(rank), state_elements_(std::move(state_elements)) {}

void LauncherLink::report_progress() {
  if (!store_ || std::chrono::steady_clock::now() < next_progress_) return;
  store_->add(contract::progress_key(rank_), 1);
  next_progress_ = std::chrono::steady_clock::now() + std::chrono::seconds(1);
}

void LauncherLink::publish_stop_estimate(int64_t step, int64_t committed_step, double last_save_s,
                                         double iteration_s) {
  if (!store_) return;
  if (iteration_s > 0) recent_iterations_s_.push_back(iteration_s);
  if (recent_iterations_s_.size() > 8) recent_iterations_s_.pop_front();
  contract::StopEstimate e;
  e.step = step;
  for (double t : recent_iterations_s_) e.step_s = std::max(e.step_s, t);
  e.committed_step = committed_step;
  e.save_s = last_save_s;
  e.save_measured = e.save_s > 0;
  if (!e.save_measured) {
    if (assumed_save_s_ < 0)
      assumed_save_s_ =
          static_cast<double>(state_elements_()) * 12 / kAssumedSaveBytesPerS + kAssumedSaveFixedS;
    e.save_s = assumed_save_s_;
  }
  const auto now = std::chrono::steady_clock::now();
  const bool committed = published_ && e.committed_step != published_->committed_step;
  if (published_ && !committed && now < next_publish_) return;
  const std::string text = contract::to_json(e);
  store_->set(contract::stop_estimate_key(rank_), std::vector<uint8_t>(text.begin(), text.end()));
  published_ = e;
  next_publish_ = now + std::chrono::seconds(1);
}

}  // namespace ft::train

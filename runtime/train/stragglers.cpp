#include "train/stragglers.h"

#include <fmt/format.h>

#include <algorithm>

namespace ft::train {

double lower_median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t mid = (v.size() - 1) / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  return v[mid];
}

StragglerWatch::StragglerWatch(double ratio, int steps, double min_excess_s)
    : ratio_(ratio), min_excess_s_(min_excess_s), steps_(steps) {}

std::vector<std::string> StragglerWatch::observe(int64_t step, const std::vector<double>& busy_s,
                                                 const std::vector<RankPlace>& places) {
  const size_t n = busy_s.size();
  if (run_.size() != n) {
    run_.assign(n, 0);
    sum_busy_.assign(n, 0);
    sum_others_.assign(n, 0);
    warned_.assign(n, false);
  }
  std::vector<std::string> out;
  if (n < 2) return out;
  for (size_t r = 0; r < n; ++r) {
    std::vector<double> others;
    for (size_t q = 0; q < n; ++q)
      if (q != r) others.push_back(busy_s[q]);
    const double median = lower_median(others);
    const bool slow = busy_s[r] > ratio_ * median && busy_s[r] - median >= min_excess_s_;
    if (!slow) {
      run_[r] = 0;
      sum_busy_[r] = sum_others_[r] = 0;
      continue;
    }
    ++run_[r];
    sum_busy_[r] += busy_s[r];
    sum_others_[r] += median;
    if (run_[r] < steps_ || warned_[r]) continue;
    warned_[r] = true;
    const RankPlace& p = places.at(r);
    const double mine = sum_busy_[r] / run_[r], theirs = sum_others_[r] / run_[r];
    out.push_back(fmt::format(
        "straggler: rank {} (node {}, {}) worked {:.1f} ms per step against a median of {:.1f} "
        "ms on the other ranks ({:.1f}x) for the {} steps up to step {}; every rank waits for it "
        "at each collective, so the job runs at its pace. Its own work is data, forward, backward "
        "and the optimizer, not waiting; look at that node's load, clocks and data reads "
        "(`ft doctor` measures each device)",
        p.rank, p.node, p.device, mine * 1e3, theirs * 1e3, mine / std::max(theirs, 1e-12), run_[r],
        step));
  }
  return out;
}

}  // namespace ft::train

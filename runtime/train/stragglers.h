// Finding a straggler: a rank whose own work per step (its step time less the time it was blocked
// on communication, so waiting for others does not count) stays well above the other ranks'. In
// synchronous training every rank waits for the slowest at each collective, so one slow device,
// node or data read slows the whole job; the warning names it once, with the figures. Pure logic
// over the figures every rank shares each step (train/run.cpp gathers them). Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ft::train {

// Who a rank is, for the warning.
struct RankPlace {
  int rank = 0;
  int node = 0;        // node rank
  std::string device;  // "cpu" | "cuda:3"
};

class StragglerWatch {
 public:
  // A rank is a straggler when its busy time exceeds `ratio` x the median of the other ranks'
  // (and that median by at least `min_excess_s`, so that noise on millisecond steps is not
  // named) for `steps` steps in a row.
  explicit StragglerWatch(double ratio = 1.5, int steps = 10, double min_excess_s = 0.005);
  // One optimizer step's busy seconds per rank (index = rank). Returns the warnings to print now,
  // each rank's at most once per run.
  std::vector<std::string> observe(int64_t step, const std::vector<double>& busy_s,
                                   const std::vector<RankPlace>& places);

 private:
  double ratio_, min_excess_s_;
  int steps_;
  std::vector<int> run_;          // consecutive slow steps, per rank
  std::vector<double> sum_busy_;  // over the run, per rank
  std::vector<double> sum_others_;
  std::vector<bool> warned_;
};

// The median of `v` (the lower of the two middle values for an even count); 0 when empty.
double lower_median(std::vector<double> v);

}  // namespace ft::train

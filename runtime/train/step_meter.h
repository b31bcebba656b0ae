// How a run's steps compare with the device: the model FLOPs of a step's micro-batches and the
// peak that MFU divides by, measured by every rank at the start, measured again once the run is
// steady, and raised by a step that outran it, so that no MFU above 1 is shown or recorded. One
// per run; not thread-safe. measure() and remeasure() are collectives (a barrier first): every rank
// calls them at the same points.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/batch.h"
#include "model/config.h"
#include "train/device_peak.h"
#include "train/metrics.h"

namespace ft::train {

class StepMeter {
 public:
  struct Options {
    model::ModelConfig model;               // the whole model's shape
    std::vector<std::string> lora_targets;  // empty for a full fine-tune
    int64_t lora_r = 0;
    at::Device device{at::kCPU};
    at::ScalarType dtype = at::kFloat;  // the compute dtype
    bool rank0 = true;                  // says what it measured
    std::function<void()> barrier;      // every rank's; null at world size 1
  };
  // The step after which the peak is measured again.
  static constexpr int64_t kRemeasureStep = 3;

  explicit StepMeter(Options options) : o_(std::move(options)) {}

  // The device's peak, measured by every rank at once (after the barrier, so that ranks sharing a
  // CPU measure their share of it, as they will train).
  void measure(bool quiet = false);
  // Measured again (kRemeasureStep): the higher of two measurements is kept.
  void remeasure();
  // The model FLOPs of this rank's micro-batches: each one's input tokens at its own length.
  double flops(const std::vector<data::Batch>& micro_batches) const;
  // A step that ran faster than the peak makes its own rate the peak (said once); `r`'s peak is
  // updated.
  void keep_mfu_at_most_one(StepRecord& r);
  double peak_flops_s() const { return peak_.flops_per_s; }

 private:
  Options o_;
  PeakFlops peak_;
  bool raised_ = false;  // a step ran faster than the peak
};

}  // namespace ft::train

#include "train/step_meter.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/build_info.h"
#include "model/flops.h"

namespace ft::train {

void StepMeter::measure(bool quiet) {
  if (o_.barrier) o_.barrier();
  const BuildInfo info = build_info(o_.device.is_cuda());
  const std::string name =
      o_.device.is_cuda() && o_.device.index() < static_cast<int>(info.gpu_names.size())
          ? info.gpu_names[o_.device.index()]
          : "";
  peak_ = device_peak(o_.device, o_.dtype, name);
  if (o_.rank0 && !quiet)
    fmt::print("ft train: MFU against {:.3g} TFLOP/s ({})\n", peak_.flops_per_s / 1e12, peak_.from);
}

// A peak measured at start can come out low when another process was busy in those 0.15 s (MFU
// of 173% and 355% were seen on a loaded machine): measured again once the run is steady, the
// higher figure kept.
// measure is a collective (its barrier), so every rank takes part whatever its own figure: a rank
// whose step outran its peak (keep_mfu_at_most_one) holds that step's rate, not a measurement,
// and used to return before the barrier while the others waited in it. Their barrier then paired
// with its next scalar collective, and every collective after it with the wrong one: a hang in
// the final save (the offload test under load, 1 run in 3 of its fp16 job), or Gloo's "Received
// data size doesn't match expected size" where the sizes differ.
void StepMeter::remeasure() {
  const PeakFlops before = peak_;
  measure(/*quiet=*/true);
  // A data sheet's figure or a step's own rate stands; of two measurements the higher.
  if (before.from.rfind("measured", 0) != 0 || peak_.flops_per_s < before.flops_per_s) {
    peak_ = before;
    return;
  }
  peak_.from += fmt::format(" (again after {} steps: {:.3g} TFLOP/s at start)", kRemeasureStep,
                            before.flops_per_s / 1e12);
  if (o_.rank0)
    fmt::print("ft train: MFU now against {:.3g} TFLOP/s ({})\n", peak_.flops_per_s / 1e12,
               peak_.from);
}

double StepMeter::flops(const std::vector<data::Batch>& micro_batches) const {
  double flops = 0;
  for (const auto& b : micro_batches) {
    const auto f = model::training_flops(o_.model, b.input_ids.size(1), o_.lora_targets, o_.lora_r);
    flops += f.per_token() * static_cast<double>(b.input_tokens());
  }
  return flops;
}

void StepMeter::keep_mfu_at_most_one(StepRecord& r) {
  const double achieved = r.flops / std::max(r.step_time_s, 1e-12);
  const double before = peak_.flops_per_s;
  if (!raise_peak(peak_, achieved, r.stats.step)) return;
  if (o_.rank0 && !raised_)
    fmt::print(stderr,
               "ft train: step {} ran at {:.3g} TFLOP/s, above the peak measured at start "
               "({:.3g}; the machine was busier then?): MFU is against the fastest step's rate "
               "from now on\n",
               r.stats.step, achieved / 1e12, before / 1e12);
  raised_ = true;
  r.peak_flops_s = peak_.flops_per_s;
}

}  // namespace ft::train

// The peak a device's matrix multiplies reach: what MFU divides by. For known GPUs, the vendor's
// dense bf16/fp16 tensor-core figure from a table; for CPUs and other devices or dtypes, measured
// here with LibTorch's own matmul (so a CPU rank's MFU is against what its threads can do). Used by
// `ft train` (metrics.jsonl's mfu) and `ft doctor`. Not thread-safe: measuring uses the device.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace ft::train {

struct PeakFlops {
  double flops_per_s = 0;
  std::string from;  // "table: NVIDIA H100 80GB HBM3, dense bf16" | "measured: the best of 5 rounds
                     // of 512^3 fp32 matmuls..."
};

// The dense tensor-core peak of a GPU named `name` (the driver's name) for bf16 or fp16; 0 when the
// GPU or the dtype is not in the table.
double known_gpu_peak(const std::string& name, at::ScalarType dtype);

// Square `n` x `n` matrix multiplies in `dtype` on `device` after a warm-up, in 5 rounds of
// `min_seconds` / 5: the best round's FLOPs per second (2 n^3 per multiply), so that a round
// another process interrupted does not lower the figure.
PeakFlops measure_matmul(const at::Device& device, at::ScalarType dtype, int64_t n,
                         double min_seconds);

// A step that ran at `achieved` FLOP/s, above `peak`, proves the peak low (measured while another
// process held the cores): the peak becomes that rate, so that no MFU exceeds 1, and `from` says
// so. Returns whether it was raised.
bool raise_peak(PeakFlops& peak, double achieved, int64_t step);

// The peak MFU is computed against on `device` (`gpu_name`: the driver's name of a GPU; "" on CPU):
// the table's figure, else measured (n = 512 on a CPU, 4096 on a GPU; 0.15 s).
PeakFlops device_peak(const at::Device& device, at::ScalarType dtype,
                      const std::string& gpu_name = "");

}  // namespace ft::train

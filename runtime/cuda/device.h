// Which device a rank trains on: the preset's hardware.device (auto | cpu | cuda) against what this
// ft was built with and what the machine has. The choice is made before anything is written and
// before LibTorch is asked about CUDA. Pure functions apart from probe_devices(); thread-safe.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace ft::cuda {

// What the choice depends on.
struct DeviceProbe {
  bool cuda_compiled = false;  // this ft has its CUDA code paths (libft_cuda.so)
  int visible_gpus = 0;        // GPUs the CUDA driver shows this process (CUDA_VISIBLE_DEVICES)
  std::string gpu_name;        // device 0, for messages
};

// Asks the CUDA driver (without loading LibTorch's CUDA part; core/build_info.h).
DeviceProbe probe_devices();

struct DeviceChoice {
  c10::Device device{c10::kCPU};  // cpu, or cuda:LOCAL_RANK
  std::string reason;             // "hardware.device=auto: no GPU visible", for the run's log
};

// `setting` is hardware.device. auto: cuda:local_rank when a GPU is visible and this ft has CUDA,
// else cpu; cuda: cuda:local_rank or a ConfigError saying why not and what to do; cpu: cpu. A CUDA
// choice needs local_rank < visible GPUs (one GPU per worker), else ConfigError.
DeviceChoice choose_device(const std::string& setting, int local_rank, const DeviceProbe& probe);
// The same with this machine's probe, taken only when the setting is not cpu (a CPU run never
// touches the CUDA driver).
DeviceChoice choose_device(const std::string& setting, int local_rank);

}  // namespace ft::cuda

#include "cuda/device.h"

#include <fmt/format.h>

#include <cstdlib>

#include "core/build_info.h"
#include "core/error.h"

namespace ft::cuda {

DeviceProbe probe_devices() {
  const BuildInfo b = build_info(/*probe_devices=*/true);
  DeviceProbe p;
  p.cuda_compiled = b.cuda_compiled;
  p.visible_gpus = b.cuda_devices;
  p.gpu_name = b.gpu_name;
  return p;
}

DeviceChoice choose_device(const std::string& setting, int local_rank, const DeviceProbe& probe) {
  FT_CHECK(setting == "auto" || setting == "cpu" || setting == "cuda",
           "hardware.device must be auto, cpu or cuda, got '", setting, "'");
  DeviceChoice c;
  if (setting == "cpu") {
    c.reason = "hardware.device=cpu";
    return c;
  }
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string visible_text =
      visible ? fmt::format("CUDA_VISIBLE_DEVICES='{}'", visible) : "CUDA_VISIBLE_DEVICES unset";
  if (setting == "auto") {
    if (!probe.cuda_compiled) {
      c.reason = "hardware.device=auto: this ft was built without CUDA";
      return c;
    }
    if (probe.visible_gpus == 0) {
      c.reason = fmt::format("hardware.device=auto: no GPU visible, {}", visible_text);
      return c;
    }
  } else {
    FT_CHECK(probe.cuda_compiled,
             "hardware.device=cuda, but this ft was built without CUDA (FT_WITH_CUDA=OFF: nvcc "
             "was not found when it was configured); rebuild ft where the CUDA toolkit is "
             "installed, or train on CPU with --set hardware.device=cpu (or auto)");
    FT_CHECK(probe.visible_gpus > 0, "hardware.device=cuda, but the CUDA driver shows no GPU (",
             visible_text,
             "); run on a GPU machine (check `nvidia-smi` and CUDA_VISIBLE_DEVICES), or train on "
             "CPU with --set hardware.device=cpu (or auto)");
  }
  // One GPU per worker, the worker's LOCAL_RANK-th: a rank never falls back to CPU alone, which
  // would leave the job half on GPUs.
  FT_CHECK(local_rank < probe.visible_gpus, "hardware.device=", setting, ": LOCAL_RANK ",
           local_rank, " needs cuda:", local_rank, " but ", probe.visible_gpus,
           " GPU(s) are visible (", visible_text, "); run at most ", probe.visible_gpus,
           " workers per node (ft launch --nproc-per-node ", probe.visible_gpus,
           "), or train on CPU with --set hardware.device=cpu");
  c.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  c.reason = fmt::format("hardware.device={}: {} GPU(s) visible, GPU 0: {}", setting,
                         probe.visible_gpus, probe.gpu_name.empty() ? "?" : probe.gpu_name);
  return c;
}

DeviceChoice choose_device(const std::string& setting, int local_rank) {
  return choose_device(setting, local_rank, setting == "cpu" ? DeviceProbe{} : probe_devices());
}

}  // namespace ft::cuda

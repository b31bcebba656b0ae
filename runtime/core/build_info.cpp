#include "core/build_info.h"

#include <ATen/Context.h>
#include <fmt/format.h>
#include <torch/version.h>

#ifdef FT_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace ft {
namespace detail {
extern const char* const kFtVersion;
extern const char* const kGitCommit;
}  // namespace detail

BuildInfo build_info(bool probe_devices) {
  BuildInfo b;
  b.ft_version = detail::kFtVersion;
  b.git_commit = detail::kGitCommit;
  b.torch_version = TORCH_VERSION;
#ifdef FT_WITH_CUDA
  b.cuda_compiled = true;
  b.cuda_version = fmt::format("{}.{}", CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10);
  b.nccl_version = fmt::format("{}.{}.{}", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
  if (probe_devices && at::hasCUDA()) {
    b.cuda_devices = static_cast<int>(c10::cuda::device_count());
    if (b.cuda_devices > 0) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) b.gpu_name = prop.name;
    }
  }
#else
  (void)probe_devices;
#endif
  return b;
}

std::string version_text(const BuildInfo& b) {
  std::string s =
      fmt::format("ft {} (commit {})\nLibTorch {}\n", b.ft_version, b.git_commit, b.torch_version);
  if (b.cuda_compiled) {
    s += fmt::format("CUDA {} compiled in; NCCL {} compiled in\n", b.cuda_version, b.nccl_version);
    if (b.cuda_devices > 0)
      s += fmt::format("CUDA available: {} device(s), {}\n", b.cuda_devices, b.gpu_name);
    else
      s += "CUDA available: no (no visible GPU); NCCL available: no\n";
  } else {
    s += "CUDA: not compiled in; NCCL: not compiled in\n";
  }
  s += "Gloo: compiled in, available\n";
  return s;
}

}  // namespace ft

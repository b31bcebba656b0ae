#include "core/build_info.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <torch/version.h>

#ifdef FT_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace ft {
namespace detail {
extern const char* const kFtVersion;
extern const char* const kGitCommit;
}  // namespace detail

namespace {

#ifdef FT_WITH_CUDA
// Opens the first library that loads; nullptr when none does (no driver: a CPU machine).
void* open_first(std::initializer_list<std::string> names) {
  for (const auto& n : names)
    if (void* h = ::dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
  return nullptr;
}

// GPUs through the CUDA driver API (libcuda ships with the driver, honours CUDA_VISIBLE_DEVICES and
// creates no context), so probing needs neither libtorch_cuda nor the CUDA runtime.
void probe_gpus(BuildInfo& b) {
  void* cuda = open_first({"libcuda.so.1", "libcuda.so"});
  if (!cuda) return;
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  using Get = int (*)(int*, int);
  using Name = int (*)(char*, int, int);
  auto init = reinterpret_cast<Init>(::dlsym(cuda, "cuInit"));
  auto count = reinterpret_cast<Count>(::dlsym(cuda, "cuDeviceGetCount"));
  auto get = reinterpret_cast<Get>(::dlsym(cuda, "cuDeviceGet"));
  auto name = reinterpret_cast<Name>(::dlsym(cuda, "cuDeviceGetName"));
  int n = 0;
  if (init && count && init(0) == 0 && count(&n) == 0 && n > 0) {
    b.cuda_devices = n;
    for (int i = 0; i < n; ++i) {
      int dev = 0;
      char buf[256] = {0};
      const bool named = get && name && get(&dev, i) == 0 && name(buf, sizeof buf - 1, dev) == 0;
      b.gpu_names.push_back(named ? buf : "");
    }
    b.gpu_name = b.gpu_names.front();
  }
  void* nccl = open_first(
      {"libnccl.so.2", std::string(FT_TORCH_LIB_DIR) + "/../../nvidia/nccl/lib/libnccl.so.2"});
  b.nccl_loadable = nccl != nullptr;
}
#endif

}  // namespace

BuildInfo build_info(bool probe_devices) {
  BuildInfo b;
  b.ft_version = detail::kFtVersion;
  b.git_commit = detail::kGitCommit;
  b.torch_version = TORCH_VERSION;
#ifdef FT_WITH_CUDA
  b.cuda_compiled = true;
  b.cuda_version = fmt::format("{}.{}", CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10);
  b.nccl_version = fmt::format("{}.{}.{}", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
  if (probe_devices) probe_gpus(b);
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
      s += fmt::format("CUDA available: {} device(s), {}; NCCL available: {}\n", b.cuda_devices,
                       b.gpu_name, b.nccl_loadable ? "yes" : "no (libnccl.so.2 not found)");
    else
      s += "CUDA available: no (no GPU or driver visible); NCCL available: no\n";
  } else {
    s += "CUDA: not compiled in; NCCL: not compiled in\n";
  }
  s += "Gloo: compiled in, available\n";
  return s;
}

}  // namespace ft

// What this binary is: ft version and commit, the LibTorch it was built and runs with, and which
// accelerator stacks are compiled in and usable on this machine. Used by `ft --version` and by the
// launcher's node fingerprint. GPUs are probed through the CUDA driver (dlopen), without loading
// libtorch_cuda. Thread-safe.
#pragma once

#include <string>
#include <vector>

namespace ft {

struct BuildInfo {
  std::string ft_version;              // "0.1.0"
  std::string git_commit;              // short hash, "-dirty" when built from a modified tree
  std::string torch_version;           // LibTorch version compiled against, e.g. "2.11.0"
  bool cuda_compiled = false;          // ft's CUDA code paths were compiled (FT_WITH_CUDA)
  std::string cuda_version;            // CUDA runtime LibTorch was built with, "" if none
  std::string nccl_version;            // NCCL version, "" if not compiled in
  int cuda_devices = 0;                // visible CUDA devices now (0 on CPU machines)
  std::string gpu_name;                // name of device 0, "" when none
  std::vector<std::string> gpu_names;  // every visible device's name, by index
  bool nccl_loadable = false;  // libnccl.so.2 could be opened (only probed when a GPU is visible)
};

// Queries once per call; `probe_devices=false` skips touching the CUDA driver.
BuildInfo build_info(bool probe_devices = true);

// Multi-line human text for `ft --version`.
std::string version_text(const BuildInfo& info);

}  // namespace ft

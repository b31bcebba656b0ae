#include "cuda/loader.h"

#include <ATen/Context.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "core/build_info.h"
#include "core/error.h"

namespace ft::cuda {

namespace fs = std::filesystem;

bool compiled() {
#ifdef FT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<std::string> library_paths() {
  if (const char* env = std::getenv("FT_CUDA_LIBRARY"); env && *env) return {env};
  std::vector<std::string> out;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) out.push_back((exe.parent_path().parent_path() / "lib" / "libft_cuda.so").string());
#ifdef FT_CUDA_LIBRARY_PATH
  if (out.empty() || out.front() != FT_CUDA_LIBRARY_PATH) out.push_back(FT_CUDA_LIBRARY_PATH);
#endif
  return out;
}

const Api& open_library(const std::string& path) {
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!handle) {
    const char* err = ::dlerror();
    throw ConfigError(fmt::format("cannot load the CUDA runtime library {}: {}", path,
                                  err ? err : "unknown error"));
  }
  using Entry = const Api* (*)();
  auto entry = reinterpret_cast<Entry>(::dlsym(handle, kApiSymbol));
  FT_CHECK(entry != nullptr, path, " does not export ", kApiSymbol,
           ": it is not ft's CUDA library; rebuild ft or unset FT_CUDA_LIBRARY");
  const Api* table = entry();
  FT_CHECK(table && table->version == kApiVersion, path, " is ft CUDA library version ",
           table ? table->version : -1, " but this ft needs version ", kApiVersion,
           ": it comes from another build of ft; rebuild, or point FT_CUDA_LIBRARY at the "
           "libft_cuda.so built with this ft");
  return *table;
}

const Api& api() {
  static std::once_flag once;
  static const Api* table = nullptr;
  std::call_once(once, [] {
    FT_CHECK(compiled(),
             "this ft was built without CUDA (FT_WITH_CUDA=OFF: nvcc was not found when it was "
             "configured), so it has no libft_cuda.so; rebuild ft where the CUDA toolkit is "
             "installed, or train on CPU with hardware.device=cpu");
    std::string errors;
    for (const auto& path : library_paths()) {
      try {
        table = &open_library(path);
        return;
      } catch (const ConfigError& e) {
        errors += fmt::format("\n  {}", e.what());
      }
    }
    throw ConfigError(fmt::format(
        "this ft was built with CUDA but its CUDA library libft_cuda.so did not load:{}\nBuild "
        "it (`cmake --build BUILD --target ft_cuda`), keep it in lib/ beside the bin/ folder of "
        "ft, or set FT_CUDA_LIBRARY=/path/to/libft_cuda.so; hardware.device=cpu trains without "
        "it",
        errors));
  });
  // call_once rethrows the loader's error to this caller and lets the next one try again.
  return *table;
}

void use_device(int index) {
  const Api& a = api();
  int count = 0;
  try {
    count = a.device_count();
  } catch (const c10::Error& e) {
    throw ConfigError(fmt::format("cannot count CUDA devices: {}", e.what_without_backtrace()));
  }
  if (index >= count) {
    const int driver = build_info().cuda_devices;
    FT_CHECK(driver <= count, "the CUDA driver reports ", driver,
             " GPU(s) but LibTorch's CUDA runtime sees ", count, " (CUDA ",
             build_info(false).cuda_version,
             "): the driver may be too old for this CUDA runtime; check `nvidia-smi`");
    FT_CHECK(false, "this rank needs cuda:", index, " but ", count,
             " CUDA device(s) are visible (CUDA_VISIBLE_DEVICES=",
             std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES") : "unset",
             "): run at most ", count, " workers per node (ft launch --nproc-per-node ", count,
             ")");
  }
  try {
    a.set_device(index);
  } catch (const c10::Error& e) {
    throw ConfigError(
        fmt::format("cannot use CUDA device {}: {}", index, e.what_without_backtrace()));
  }
  // LibTorch looks its CUDA hooks up once; a lookup made before the library was opened leaves it
  // without CUDA for the life of the process, and every CUDA tensor would fail obscurely.
  FT_ASSERT(at::hasCUDA(), "LibTorch's CUDA hooks were looked up before libft_cuda.so was loaded; ",
            "the runtime must open it before any CUDA query");
}

}  // namespace ft::cuda

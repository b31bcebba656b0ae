// Opens libft_cuda.so, the CUDA part of the runtime (cuda/api.h), once per process and only when a
// job trains on a GPU: the ft binary links only LibTorch's CPU part. The library must be opened
// before anything asks LibTorch about CUDA (LibTorch caches its CUDA hooks on first use), so the
// runtime opens it as soon as it has chosen a CUDA device. Thread-safe: the first call loads, the
// others get the same table.
#pragma once

#include <string>
#include <vector>

#include "cuda/api.h"

namespace ft::cuda {

// True when this ft was built with its CUDA code paths (FT_WITH_CUDA), so it has a libft_cuda.so.
bool compiled();

// Where api() looks for the library, in order: $FT_CUDA_LIBRARY alone when it is set; else
// lib/libft_cuda.so beside the running program's bin/ folder, then the path it was built at.
std::vector<std::string> library_paths();

// Opens the library at `path` (RTLD_NOW | RTLD_GLOBAL, so libtorch_cuda's static initialisers
// register CUDA with the libtorch_cpu already loaded) and checks its table. Throws ConfigError
// naming the path and the loader's error, or the version mismatch.
const Api& open_library(const std::string& path);

// The table, loading the library on the first call. Throws ConfigError when this ft was built
// without CUDA, or when no path of library_paths() loads (each path with its error, and what to
// do).
const Api& api();

// Loads the library, checks that the CUDA runtime sees device `index` and makes it the calling
// thread's current device. Throws ConfigError (the driver and the runtime disagree, a device
// index out of range) with what to check.
void use_device(int index);

}  // namespace ft::cuda

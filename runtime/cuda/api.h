// The CUDA part of ft's runtime as the CPU-only part sees it: libft_cuda.so (linked with
// libtorch_cuda, c10_cuda and, through them, NCCL) exports one symbol, kApiSymbol, returning this
// table of plain functions. The runtime opens the library only when a job trains on GPUs
// (cuda/loader.h), so the launcher and CPU workers never load libtorch_cuda. The functions throw
// c10::Error for CUDA or NCCL failures (callers wrap them into ft's typed errors) and are as
// thread-safe as the CUDA runtime calls they make.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/element_type.h"
#include "cuda/adamw_math.h"

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace ft::cuda {

// Bumped whenever Api changes: a libft_cuda.so from another build is refused, not misread.
inline constexpr int kApiVersion = 5;
inline constexpr const char* kApiSymbol = "ft_cuda_api";

// One device's caching allocator (LibTorch's CUDA allocator), bytes.
struct DeviceMemory {
  int64_t allocated_bytes = 0;       // held by live tensors now
  int64_t reserved_bytes = 0;        // held from the driver: allocated + cached free blocks
  int64_t peak_allocated_bytes = 0;  // most allocated at once since the last peak reset
};

// One NCCL process group: this rank's place in it and the GPU its collectives run on.
struct NcclGroup {
  int rank = 0;
  int size = 1;
  int device = 0;                             // CUDA device index of this rank
  std::chrono::milliseconds timeout{300000};  // the watchdog aborts collectives that hang longer
  std::string name;                           // "world", "shard0": logs and NCCL's flight recorder
  std::vector<uint64_t> global_ranks;         // world rank of each group rank
};

struct Api {
  int version;  // kApiVersion of the library
  // Devices the CUDA runtime sees (honours CUDA_VISIBLE_DEVICES); 0 when it cannot use any.
  int (*device_count)();
  // Makes `index` the calling thread's current device.
  void (*set_device)(int index);
  // A c10d NCCL backend on `store` (a PrefixStore unique to the group). Communicators are created
  // at the first collective; every member must issue the same collectives in the same order.
  c10::intrusive_ptr<c10d::Backend> (*make_nccl_backend)(
      const c10::intrusive_ptr<c10d::Store>& store, const NcclGroup& group);
  // Waits until all work queued on device `index` is done.
  void (*synchronize)(int index);
  // The allocator's figures for device `index`; `reset_peak` starts a new peak afterwards.
  DeviceMemory (*memory)(int index, bool reset_peak);
  // Seeds the default CUDA generator of every visible device.
  void (*manual_seed)(uint64_t seed);
  // The state of device `index`'s default generator (dropout draws from it), as
  // at::Generator::get_state returns it, and back: checkpoints carry it so a resumed run draws
  // the same masks.
  std::vector<uint8_t> (*generator_state)(int index);
  void (*set_generator_state)(int index, const std::vector<uint8_t>& state);
  // AdamW (cuda/adamw_math.h: the same bits as the host's loop) over n contiguous fp32 elements
  // on device `index`, queued on its current stream.
  void (*adamw_fp32)(int index, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                     int64_t n, const train::AdamWScalars& s);
  // The fused elementwise ops of model/fused_ops.h (cuda/kernels.h) on device `index`, queued on
  // its current stream: contiguous data of `dtype`, rstd fp32 [rows]; null pointers leave parts
  // out (no residual add, no ds, no dx or dw).
  void (*rms_norm_forward)(int index, ElementType dtype, const void* h, const void* delta,
                           void* sum, const void* w, void* y, float* rstd, int64_t rows, int64_t H,
                           float eps);
  void (*rms_norm_backward)(int index, ElementType dtype, const void* dy, const void* x,
                            const void* w, const float* rstd, const void* ds, void* dx, void* dw,
                            int64_t rows, int64_t H);
  void (*swiglu)(int index, ElementType dtype, const void* gate, const void* up, const void* dy,
                 void* y_or_dgate, void* dup, int64_t n, bool backward);
  void (*rope)(int index, ElementType dtype, const void* x, const void* cos, const void* sin,
               void* out, int64_t rows, int64_t heads, int64_t head_dim, bool backward);
  // NF4 dequantization (cuda/kernels.h) on device `index`, queued on its current stream.
  void (*nf4_dequantize)(int index, ElementType dtype, const uint8_t* packed, const float* absmax,
                         void* out, int64_t n, int64_t blocksize);
};

}  // namespace ft::cuda

// What libft_cuda.so exports (looked up with dlsym by cuda/loader.cpp).
extern "C" const ft::cuda::Api* ft_cuda_api();

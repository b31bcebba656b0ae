// libft_cuda.so: the table of cuda/api.h over LibTorch's CUDA part. The only translation unit of
// ft that includes CUDA or NCCL headers of LibTorch; loading it (RTLD_GLOBAL) runs libtorch_cuda's
// static initialisers, which register the CUDA kernels, allocator, device guard and hooks with the
// libtorch_cpu the process already has.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <mutex>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "cuda/api.h"
#include "cuda/kernels.h"

namespace ft::cuda {
namespace {

c10::DeviceIndex index_of(int index) {
  TORCH_CHECK(index >= 0 && index < c10::cuda::device_count(), "CUDA device ", index,
              " does not exist (", static_cast<int>(c10::cuda::device_count()), " visible)");
  return static_cast<c10::DeviceIndex>(index);
}

int device_count() { return c10::cuda::device_count(); }

void set_device(int index) { c10::cuda::set_device(index_of(index)); }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const NcclGroup& g) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = g.timeout;
  options->group_name = g.name;
  options->group_desc = g.name;
  options->global_ranks_in_group = g.global_ranks;
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, g.rank, g.size, options);
  // The group's GPU is known up front (torch's init_process_group(device_id=...)): collectives
  // that carry no tensor, and NCCL's communicator, use this device rather than a guess.
  pg->setBoundDeviceId(at::Device(at::kCUDA, index_of(g.device)));
  return pg;
}

void synchronize(int index) {
  c10::cuda::CUDAGuard guard(index_of(index));
  c10::cuda::device_synchronize();
}

DeviceMemory memory(int index, bool reset_peak) {
  const c10::DeviceIndex d = index_of(index);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d);
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  DeviceMemory m;
  m.allocated_bytes = stats.allocated_bytes[kAll].current;
  m.reserved_bytes = stats.reserved_bytes[kAll].current;
  m.peak_allocated_bytes = stats.allocated_bytes[kAll].peak;
  if (reset_peak) c10::cuda::CUDACachingAllocator::resetPeakStats(d);
  return m;
}

void manual_seed(uint64_t seed) {
  for (c10::DeviceIndex i = 0; i < c10::cuda::device_count(); ++i) {
    at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(i);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
}

std::vector<uint8_t> generator_state(int index) {
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(index_of(index));
  std::lock_guard<std::mutex> lock(gen.mutex());
  const at::Tensor s = gen.get_state().contiguous();  // a CPU byte tensor
  const auto* p = s.data_ptr<uint8_t>();
  return std::vector<uint8_t>(p, p + s.numel());
}

void set_generator_state(int index, const std::vector<uint8_t>& state) {
  at::Tensor s = at::empty({static_cast<int64_t>(state.size())}, at::kByte);
  std::copy(state.begin(), state.end(), s.data_ptr<uint8_t>());
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(index_of(index));
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

void adamw(int index, float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
           const train::AdamWScalars& s) {
  const c10::DeviceIndex d = index_of(index);
  c10::cuda::CUDAGuard guard(d);
  adamw_fp32(param, grad, exp_avg, exp_avg_sq, n, s, c10::cuda::getCurrentCUDAStream(d).stream());
}

void rms_norm_forward_on(int index, ElementType dtype, const void* h, const void* delta, void* sum,
                         const void* w, void* y, float* rstd, int64_t rows, int64_t H, float eps) {
  const c10::DeviceIndex d = index_of(index);
  c10::cuda::CUDAGuard guard(d);
  rms_norm_forward(dtype, h, delta, sum, w, y, rstd, rows, H, eps,
                   c10::cuda::getCurrentCUDAStream(d).stream());
}

void rms_norm_backward_on(int index, ElementType dtype, const void* dy, const void* x,
                          const void* w, const float* rstd, const void* ds, void* dx, void* dw,
                          int64_t rows, int64_t H) {
  const c10::DeviceIndex d = index_of(index);
  c10::cuda::CUDAGuard guard(d);
  rms_norm_backward(dtype, dy, x, w, rstd, ds, dx, dw, rows, H,
                    c10::cuda::getCurrentCUDAStream(d).stream());
}

void swiglu_on(int index, ElementType dtype, const void* gate, const void* up, const void* dy,
               void* y_or_dgate, void* dup, int64_t n, bool backward) {
  const c10::DeviceIndex d = index_of(index);
  c10::cuda::CUDAGuard guard(d);
  swiglu(dtype, gate, up, dy, y_or_dgate, dup, n, backward,
         c10::cuda::getCurrentCUDAStream(d).stream());
}

void rope_on(int index, ElementType dtype, const void* x, const void* cos, const void* sin,
             void* out, int64_t rows, int64_t heads, int64_t head_dim, bool backward) {
  const c10::DeviceIndex d = index_of(index);
  c10::cuda::CUDAGuard guard(d);
  rope(dtype, x, cos, sin, out, rows, heads, head_dim, backward,
       c10::cuda::getCurrentCUDAStream(d).stream());
}

void nf4_dequantize_on(int index, ElementType dtype, const uint8_t* packed, const float* absmax,
                       void* out, int64_t n, int64_t blocksize) {
  const c10::DeviceIndex d = index_of(index);
  c10::cuda::CUDAGuard guard(d);
  nf4_dequantize(dtype, packed, absmax, out, n, blocksize,
                 c10::cuda::getCurrentCUDAStream(d).stream());
}

}  // namespace
}  // namespace ft::cuda

extern "C" __attribute__((visibility("default"))) const ft::cuda::Api* ft_cuda_api() {
  using namespace ft::cuda;
  static const Api api{kApiVersion,         device_count, set_device,          make_nccl_backend,
                       synchronize,         memory,       manual_seed,         generator_state,
                       set_generator_state, adamw,        rms_norm_forward_on, rms_norm_backward_on,
                       swiglu_on,           rope_on,      nf4_dequantize_on};
  return &api;
}

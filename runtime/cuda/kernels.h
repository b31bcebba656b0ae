// The CUDA kernels of libft_cuda.so, callable from C++ without CUDA headers (a stream is passed as
// the cudaStream_t it is). Only library.cpp calls them.
#pragma once

#include <cstdint>

#include "train/adamw_math.h"

namespace ft::cuda {

// AdamW over n contiguous fp32 elements on the current device, queued on `stream`.
void adamw_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                const train::AdamWScalars& s, void* stream);

}  // namespace ft::cuda

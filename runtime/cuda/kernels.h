// The CUDA kernels of libft_cuda.so, callable from C++ without CUDA headers (a stream is passed as
// the cudaStream_t it is). Only library.cpp calls them.
#pragma once

#include <cstdint>

#include "cuda/element_type.h"
#include "cuda/adamw_math.h"

namespace ft::cuda {

// AdamW over n contiguous fp32 elements on the current device, queued on `stream`.
void adamw_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                const train::AdamWScalars& s, void* stream);

// The fused elementwise ops of model/fused_ops.h on the current device, queued on `stream`; the
// same arithmetic and roundings as the CPU kernels there. Contiguous row-major data of `dtype`;
// rstd is fp32 [rows]. A null delta/sum, ds, dx or dw leaves that part out.
void rms_norm_forward(ElementType dtype, const void* h, const void* delta, void* sum, const void* w,
                      void* y, float* rstd, int64_t rows, int64_t H, float eps, void* stream);
void rms_norm_backward(ElementType dtype, const void* dy, const void* x, const void* w,
                       const float* rstd, const void* ds, void* dx, void* dw, int64_t rows,
                       int64_t H, void* stream);
// Forward: y_or_dgate = silu(gate) * up. Backward: y_or_dgate = d gate, dup = d up (either null).
void swiglu(ElementType dtype, const void* gate, const void* up, const void* dy, void* y_or_dgate,
            void* dup, int64_t n, bool backward, void* stream);
// x [rows, heads, head_dim], cos/sin [rows, head_dim]; backward applies the transposed map to dy.
void rope(ElementType dtype, const void* x, const void* cos, const void* sin, void* out,
          int64_t rows, int64_t heads, int64_t head_dim, bool backward, void* stream);

// NF4 (model/nf4.h): out[i] = code[nibble i of packed] * absmax[i / blocksize] in fp32, rounded to
// `dtype`, for n values (code: bitsandbytes' NF4 table, as model/nf4.h's nf4_code()).
void nf4_dequantize(ElementType dtype, const uint8_t* packed, const float* absmax, void* out,
                    int64_t n, int64_t blocksize, void* stream);

}  // namespace ft::cuda

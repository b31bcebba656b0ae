// A projection whose frozen weight is held in NF4 (QLoRA, issue 33), as the blob model/nf4.h lays
// out: y = x W^T with W dequantized into x's dtype for the product and again, in backward, for
// the input's gradient. Nothing dequantized is kept between the two: the dequantized weight of
// one projection exists only while its product runs (ft plan counts it). The CPU dequantizes
// with a byte table over the threads (at::parallel_for), CUDA with cuda/kernels.h's kernel; the
// values are model/nf4.h's dequantize_nf4, so equal to bitsandbytes' dequantize_4bit. Thread-safe
// (pure functions; autograd as usual).
#pragma once

#include <ATen/ATen.h>

#include "model/nf4.h"

namespace ft::model {

// The weight [rows, cols] in `dtype` (fp32, bf16, fp16) from its blob (1-D, any dtype, viewed as
// bytes; on the CPU or a CUDA device), on the blob's device.
at::Tensor dequantize_blob(const at::Tensor& blob, const Nf4Shape& shape, at::ScalarType dtype);

// x [..., cols] -> [..., rows]; the blob gets no gradient (it is frozen).
at::Tensor nf4_linear(const at::Tensor& x, const at::Tensor& blob, const Nf4Shape& shape);

}  // namespace ft::model

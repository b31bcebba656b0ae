// The element types the fused CUDA kernels take, as the table of api.h passes them between the
// CPU-only runtime and libft_cuda.so (no LibTorch or CUDA headers on either side of this file).
#pragma once

namespace ft::cuda {

enum class ElementType { kFloat, kBFloat16, kHalf };

}  // namespace ft::cuda

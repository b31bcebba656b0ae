// fp32 matrix products on the host straight through the BLAS that LibTorch links (MKL's sgemm_),
// without the dispatcher.
//
// A linear layer of the overhead-bound model (64 tokens, d=256) makes 3 products per step and
// micro-batch, 40-odd in all; at::addmm_ spends 1-8 us of each outside the product (dispatch,
// structured-kernel checks, views, a parallel fill of the result). host_addmm makes the same
// sgemm_ call that at::addmm_ makes for these layouts (the same transposes, sizes and leading
// dimensions, as ATen's addmm_impl_cpu_ and cpublas::gemm choose them), so the bits are the same:
// model_test compares the layer's products with autograd's.
#pragma once

#include <ATen/ATen.h>

namespace ft::model {

// c += a @ b for 2-D fp32 CPU tensors: c row-major contiguous [M, N]; a [M, K] and b [K, N] each
// row-major or a transposed view of a row-major matrix; every size at least 2 and within int.
// Returns false, having done nothing, when a tensor is outside that or LibTorch exports no
// sgemm_; the caller then uses at::addmm_.
bool host_addmm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b);
// host_addmm, or c = a @ b (beta 0: c's values are not read) when not `accumulate`.
bool host_mm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, bool accumulate);

// c = alpha op(a) op(b) + beta c on row-major fp32 arrays, through the same sgemm_: op(a) [m, k]
// (a stored [m, k] with row stride lda, or, `ta`, stored [k, m] and transposed), op(b) [k, n]
// likewise, c [m, n] with row stride ldc. Every size at least 1 and every stride within int.
// Returns false, having done nothing, when LibTorch exports no sgemm_ (host_sgemm_available()).
bool host_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
bool host_sgemm_available();

// An uninitialised [rows, cols] tensor of `like`'s options, filled with zeros by memset (in
// blocks over threads when large): the zero-filled result host_addmm adds into.
at::Tensor host_zeros(int64_t rows, int64_t cols, const at::TensorOptions& like);

}  // namespace ft::model

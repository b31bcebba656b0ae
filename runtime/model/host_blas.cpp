#include "model/host_blas.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <climits>
#include <cstring>

namespace ft::model {

namespace {

// The Fortran BLAS interface of the LP64 MKL inside libtorch_cpu.so (ATen's CPUBlas.cpp calls it
// with these types).
using Sgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc);

// LibTorch's own sgemm_, looked up in libtorch_cpu.so (already loaded) rather than whatever
// library defines the name first; nullptr when that build exports none.
Sgemm torch_sgemm() {
  static const Sgemm fn = [] {
    void* lib = ::dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
    Sgemm f = lib ? reinterpret_cast<Sgemm>(::dlsym(lib, "sgemm_")) : nullptr;
    if (lib) ::dlclose(lib);
    return f;
  }();
  return fn;
}

bool fits(int64_t v) { return v >= 2 && v <= INT_MAX; }

}  // namespace

bool host_addmm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b) {
  return host_mm(c, a, b, /*accumulate=*/true);
}

bool host_mm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  const Sgemm sgemm = torch_sgemm();
  if (!sgemm) return false;
  for (const at::Tensor* t : {&c, &a, &b})
    if (!t->is_cpu() || t->scalar_type() != at::kFloat || t->dim() != 2 || t->is_conj() ||
        t->is_neg() || !fits(t->size(0)) || !fits(t->size(1)))
      return false;
  const int64_t M = c.size(0), N = c.size(1), K = a.size(1);
  if (a.size(0) != M || b.size(0) != K || b.size(1) != N || !c.is_contiguous()) return false;
  // ATen's addmm_impl_cpu_ for a row-major result: column-major c^T = b^T a^T, so BLAS's m, n, k
  // are N, M, K, its first operand is b and its second a. An operand is passed as stored
  // ('N', leading dimension its row stride) or transposed ('T', its column stride).
  auto layout = [](const at::Tensor& t, int64_t min_ld_stored, int64_t min_ld_transposed,
                   char* trans, int64_t* ld) {
    if (t.stride(1) == 1 && t.stride(0) >= min_ld_stored) {
      *trans = 'N';
      *ld = t.stride(0);
      return true;
    }
    if (t.stride(0) == 1 && t.stride(1) >= min_ld_transposed) {
      *trans = 'T';
      *ld = t.stride(1);
      return true;
    }
    return false;
  };
  char ta = 0, tb = 0;
  int64_t lda = 0, ldb = 0;
  // b [K, N]: as stored when its rows hold N (= BLAS's m) values; else a transposed view
  // (ATen: lda >= k). a [M, K] likewise against K (BLAS's k) and M (BLAS's n).
  if (!layout(b, N, K, &ta, &lda) || !layout(a, K, M, &tb, &ldb)) return false;
  if (lda > INT_MAX || ldb > INT_MAX || c.stride(0) > INT_MAX) return false;
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int lda_ = static_cast<int>(lda), ldb_ = static_cast<int>(ldb),
            ldc_ = static_cast<int>(c.stride(0));
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  sgemm(&ta, &tb, &m, &n, &k, &one, b.data_ptr<float>(), &lda_, a.data_ptr<float>(), &ldb_, &beta,
        c.data_ptr<float>(), &ldc_);
  return true;
}

bool host_sgemm_available() { return torch_sgemm() != nullptr; }

bool host_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const Sgemm sgemm = torch_sgemm();
  if (!sgemm) return false;
  // Row-major c = op(a) op(b) is column-major c^T = op(b)^T op(a)^T: BLAS's first operand is b.
  const char tra = tb ? 'T' : 'N', trb = ta ? 'T' : 'N';
  const int m_ = static_cast<int>(n), n_ = static_cast<int>(m), k_ = static_cast<int>(k);
  const int lda_ = static_cast<int>(ldb), ldb_ = static_cast<int>(lda),
            ldc_ = static_cast<int>(ldc);
  sgemm(&tra, &trb, &m_, &n_, &k_, &alpha, b, &lda_, a, &ldb_, &beta, c, &ldc_);
  return true;
}

at::Tensor host_zeros(int64_t rows, int64_t cols, const at::TensorOptions& like) {
  at::Tensor t = at::empty({rows, cols}, like);
  char* p = static_cast<char*>(t.data_ptr());
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  // Under 256 KiB one memset on this thread (a parallel region costs more than it saves).
  at::parallel_for(0, bytes, int64_t{1} << 18, [p](int64_t begin, int64_t end) {
    std::memset(p + begin, 0, static_cast<size_t>(end - begin));
  });
  return t;
}

}  // namespace ft::model

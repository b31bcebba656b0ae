#include "model/cpu_math.h"

#include <ATen/ATen.h>

#include <mutex>

namespace ft::model {

void prime_cpu_math() {
  static std::once_flag once;
  std::call_once(once, [] {
    // ATen's list (aten/src/ATen/cpu/vml.h, IMPLEMENT_VML_MKL): 16 elements, far below ATen's
    // grain size, so each call runs on this thread alone.
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      const at::Tensor x = at::linspace(0.05, 0.95, 16, at::TensorOptions().dtype(dtype));
      (void)x.acos(), (void)x.asin(), (void)x.atan(), (void)x.cos(), (void)x.erf();
      (void)x.erfc(), (void)x.erfinv(), (void)x.exp(), (void)x.log(), (void)x.log10();
      (void)x.log2(), (void)x.sin(), (void)x.sqrt(), (void)x.tan(), (void)x.tanh();
      (void)x.trunc();
    }
  });
}

}  // namespace ft::model

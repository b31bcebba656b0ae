// Test support: how far a tensor is from a reference, relative to the reference's scale. The one
// definition of each measure the tests compare with a tolerance; header-only (the tests that use it
// link LibTorch). Pure functions; thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

namespace ft::test {

// max |actual - reference| / max |reference|, the difference taken in fp64 (so the measure adds no
// rounding of its own, whatever the tensors' dtype). Shapes must match or broadcast.
inline double rel_error(const at::Tensor& actual, const at::Tensor& reference) {
  const double scale = std::max(reference.abs().max().item<double>(), 1e-30);
  return (actual.to(at::kDouble) - reference.to(at::kDouble)).abs().max().item<double>() / scale;
}

// As rel_error, but the difference taken in the tensors' own dtype (both the same): what the
// training loop's unit tests measure, where an fp32 difference is itself rounded to fp32.
inline double rel_error_in_dtype(const at::Tensor& actual, const at::Tensor& reference) {
  return (actual - reference).abs().max().item<double>() /
         std::max(reference.abs().max().item<double>(), 1e-30);
}

}  // namespace ft::test

#include "core/dtype.h"

#include "core/error.h"

namespace ft {

at::ScalarType parse_dtype(const std::string& name, const std::string& key) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  if (name == "fp64") return at::kDouble;
  FT_CHECK(name == "fp32", key, " must be fp32, bf16 or fp16, got '", name, "'");
  return at::kFloat;
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return "bf16";
    case at::kHalf:
      return "fp16";
    case at::kDouble:
      return "fp64";
    case at::kFloat:
      return "fp32";
    default:
      return c10::toString(t);
  }
}

}  // namespace ft

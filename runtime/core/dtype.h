// ft's names of floating-point dtypes (fp32, bf16, fp16, fp64) as the preset, `ft export --dtype`
// and the strategies spell them, and the one parser from name to LibTorch dtype. Pure functions;
// thread-safe.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace ft {

// fp32 | bf16 | fp16 | fp64 (fp64 is for exact numerical checks) -> the ScalarType. Anything else
// is a ConfigError naming `key` (the setting or flag that held it) and the value.
at::ScalarType parse_dtype(const std::string& name, const std::string& key = "precision.mode");

// The name of one of those dtypes ("bf16"); LibTorch's own name for any other.
std::string dtype_name(at::ScalarType t);

}  // namespace ft

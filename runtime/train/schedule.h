// Learning-rate schedule: linear warmup from 0, then cosine or linear decay to min_lr_ratio * lr,
// or constant. Pure; thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace ft::train {

struct Schedule {
  double lr = 1e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.0;
  std::string kind = "cosine";  // cosine | linear | constant
  // Learning rate for optimizer step `step` (1-based: the first update uses lr_at(1)).
  double lr_at(int64_t step) const;
};

}  // namespace ft::train

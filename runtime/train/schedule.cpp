#include "train/schedule.h"

#include <algorithm>
#include <cmath>

namespace ft::train {

double Schedule::lr_at(int64_t step) const {
  if (warmup_steps > 0 && step <= warmup_steps)
    return lr * static_cast<double>(step) / warmup_steps;
  if (kind == "constant") return lr;
  const double span = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress = std::clamp((step - warmup_steps) / span, 0.0, 1.0);
  const double min_lr = lr * min_lr_ratio;
  if (kind == "linear") return min_lr + (lr - min_lr) * (1.0 - progress);
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace ft::train

#include "data/batch.h"

namespace ft::data {

int64_t Batch::target_tokens() const { return labels.slice(1, 1).ne(-100).sum().item<int64_t>(); }

int64_t Batch::input_tokens() const {
  if (!segment_ids.defined()) return input_ids.numel();
  return input_ids.ne(0).sum().item<int64_t>();
}

Batch Batch::to(const at::Device& device) const {
  Batch b = *this;
  for (at::Tensor* t : {&b.input_ids, &b.labels, &b.position_ids, &b.segment_ids})
    if (t->defined()) *t = t->to(device);
  return b;
}

}  // namespace ft::data

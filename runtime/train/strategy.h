// How parameters, gradients and optimizer state are spread over ranks: the slot between the model
// and the training loop that the distributed strategies (ddp, zero3, fsdp) fill. World size 1 is
// SingleProcess. Implementations document their own thread-safety.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ft::train {

// How parameters, gradients and optimizer state are spread over ranks. The loop calls these hooks
// in the same order on every rank. World size 1 is `SingleProcess`; the distributed strategies
// (ddp, zero3, fsdp) implement the same interface.
class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  virtual int rank() const { return 0; }
  virtual int world_size() const { return 1; }
  // Sum of a per-rank count over all ranks (the step's target tokens); collective.
  virtual int64_t sum_over_ranks(int64_t v) { return v; }
  // After the last micro-batch's backward: turn local gradient sums into global sums; collective.
  virtual void reduce_gradients(std::vector<at::Tensor>& /*grads*/) {}
};

class SingleProcess : public Strategy {
 public:
  std::string name() const override { return "single"; }
};

}  // namespace ft::train

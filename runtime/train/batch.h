// A micro-batch as the training loop consumes it, and the interfaces between the loop and what
// surrounds it: where batches come from (data) and how work is spread over ranks (strategy).
// Plain data + interfaces; implementations document their own thread-safety.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ft::train {

struct Batch {
  at::Tensor input_ids;     // [B, T] int64
  at::Tensor labels;        // [B, T] int64, -100 where a token is not trained on
  at::Tensor position_ids;  // [B, T] int64, restarting at 0 in each packed segment
  at::Tensor segment_ids;   // [B, T] int64 (packed sequences) or undefined
  // Tokens that carry a loss after the next-token shift (labels[:, 1:] != -100).
  int64_t target_tokens() const;
};

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual Batch next() = 0;
  // Samples handed out so far, counted globally (independent of world size): the data position a
  // checkpoint records.
  virtual int64_t samples_consumed() const = 0;
};

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

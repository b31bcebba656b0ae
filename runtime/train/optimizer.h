// AdamW over fp32 (or fp64) master parameters, one pass per flat tensor through the element
// function of cuda/adamw_math.h: a threaded loop on the host, a kernel of libft_cuda.so on a GPU,
// the same bits on both (an offloaded optimizer changes nothing). In two groups: with weight decay,
// and without it for norms and biases. Owns the optimizer state (exp_avg, exp_avg_sq, step per
// tensor). Not thread-safe.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <string>
#include <utility>
#include <vector>

#include "cuda/adamw_math.h"

namespace ft::train {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

class AdamW {
 public:
  struct Param {
    Param(at::Tensor t, bool d = true, at::Tensor out = at::Tensor())
        : tensor(std::move(t)), decay(d), copy_out(std::move(out)) {}
    at::Tensor tensor;  // fp32 leaf whose .grad() holds the (unscaled) gradient at step() time
    bool decay = true;  // weight decay applies
    // Optional, fp32 host parameters only: a contiguous bf16 or fp16 host tensor of as many
    // elements that each update also writes, in its own pass, with the new values rounded as
    // at::Tensor::copy_ rounds them (the compute copy of an offloaded or mixed-precision job).
    at::Tensor copy_out;
  };
  AdamW(const std::vector<Param>& params, AdamWOptions options);
  // Named parameters: norms and biases are not decayed.
  AdamW(const std::vector<std::pair<std::string, at::Tensor>>& params, AdamWOptions options);

  // One update at learning rate lr. grad_scale multiplies every gradient first (the clip's factor:
  // on the host inside the update's own pass, with the bits of a separate multiply by the same
  // factor rounded to the masters' dtype; on a GPU as a separate multiply). zero_grads: the update
  // leaves every gradient zero (on the host in the same pass, which saves the engine's own pass
  // over the gradient buffers). Parameters with a copy_out get it written in the same pass.
  // write_copies false: the copy_out tensors are left alone (a delayed update runs while the
  // model reads them).
  void step(double lr, double grad_scale = 1.0, bool zero_grads = false, bool write_copies = true);
  // The same step in pieces, parameter by parameter (an offloaded job's host step, unit by unit
  // while the next step runs: trainer.h): begin() counts the step and fixes its scalars, then
  // update(i) updates the i-th parameter given to the constructor, each exactly once, in any
  // order, on any one thread at a time. `copy_out` (fp32 host parameters only) receives the
  // rounded new values instead of the parameter's own Param::copy_out (page-locked staging for
  // the device's copy). step() is begin() and update() of every parameter in order.
  void begin(double lr, double grad_scale = 1.0, bool zero_grads = false, bool write_copies = true);
  void update(size_t i, const at::Tensor& copy_out = at::Tensor());
  size_t size() const { return where_.size(); }
  int64_t steps() const { return steps_; }
  // Resident bytes of the state (exp_avg + exp_avg_sq + steps).
  int64_t state_bytes() const;

  // The state of the i-th parameter given to the constructor (for checkpoints).
  at::Tensor& exp_avg(size_t i) { return groups_[where_[i].first].exp_avg[where_[i].second]; }
  at::Tensor& exp_avg_sq(size_t i) { return groups_[where_[i].first].exp_avg_sq[where_[i].second]; }
  // Sets the step count (a resumed run): steps() and every parameter's step tensor.
  void set_steps(int64_t steps);

  // True for parameters AdamW does not decay: norms and biases.
  static bool no_decay(const std::string& name);

 private:
  struct Group {
    double weight_decay;
    AdamWScalars scalars;                                        // of the step begun last
    std::vector<at::Tensor> params, exp_avg, exp_avg_sq, steps;  // each entry like its param, fp32
    std::vector<at::Tensor> copy_out;                            // undefined: none
  };
  AdamWOptions options_;
  std::vector<Group> groups_;
  int64_t steps_ = 0;
  double grad_scale_ = 1.0;  // of the step begun last
  bool zero_grads_ = false, write_copies_ = true;
  std::vector<std::pair<size_t, size_t>> where_;  // parameter i -> (group, index)
};

}  // namespace ft::train

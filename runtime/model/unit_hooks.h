// The contract between the model's forward and a distributed strategy (parallel/engine.h): hooks
// around each shard unit, and gradient sinks, where a weight's backward adds its gradient straight
// into the strategy's accumulator. The custom autograd nodes that take sinks (model/sink_nodes.h,
// model/moe.cpp, model/fused_loss.cpp) keep them in their contexts with save_grad_sink. Called on
// the forward's and the backward's thread; not thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace torch::autograd {
struct AutogradContext;
}

namespace ft::model {

// Called by the forward pass around its shard units, so a distributed strategy can gather a unit's
// parameters just before use, release them after, and hook the backward pass. Unit 0 is the root
// (embeddings, final norm, LM head); unit i >= 1 is layer i-1. Called on the forward's thread.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  // The unit's parameters are read after this returns. Unit 0 comes first and stays in use until
  // the head has run.
  virtual void before_unit(int unit) = 0;
  // `output` is the hidden state the unit produced ([B, T, hidden]; for unit 0 the embeddings).
  virtual void after_unit(int unit, const at::Tensor& output) = 0;

  // A trained linear weight (no bias) whose gradient the strategy takes straight from the weight's
  // matrix product: `into` ([out, in], the weight's dtype and device) is where its backward adds
  // grad_out^T x (one addmm, beta 1), in place of autograd's product, AccumulateGrad and the
  // strategy's hook adding it into its accumulator; then it calls grad_sunk(id). An undefined
  // `into`: the usual autograd gradient. Asked during a forward with grad mode on.
  struct GradSink {
    at::Tensor into;
    int64_t id = -1;
  };
  virtual GradSink grad_sink(const at::Tensor& weight) {
    (void)weight;
    return {};
  }
  virtual void grad_sunk(int64_t id) { (void)id; }
};

// A custom autograd function that takes a gradient sink keeps it in its context in forward
// (`sink.into` undefined: none) and gets it back in backward; `done()` reports it sunk.
struct SavedGradSink {
  at::Tensor into;  // undefined: no sink was saved
  UnitHooks* hooks = nullptr;
  int64_t id = -1;
  void done() const { hooks->grad_sunk(id); }
};
// A node with several sinks keeps each in a slot of its own (0, 1, ...).
void save_grad_sink(torch::autograd::AutogradContext* ctx, UnitHooks* hooks,
                    const UnitHooks::GradSink& sink, int slot = 0);
SavedGradSink saved_grad_sink(torch::autograd::AutogradContext* ctx, int slot = 0);

}  // namespace ft::model

// Activation checkpointing: a block of the model (a transformer layer) runs without keeping its
// activations and is run again during backward, the reentrant variant of torch.utils.checkpoint,
// which LibTorch's C++ API lacks. The autograd node owns the block's inputs, the random generators'
// states and the recompute function until the graph is freed. Not thread-safe: one training thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace ft::model {

// A block's output from its inputs. It runs twice (forward, then recompute in backward), so it
// must depend only on the inputs, the parameters it reads and the random generators' state. It
// reads its parameters when it runs rather than holding copies, so the recompute sees whatever
// tensors are current then (a strategy may gather a layer's parameters before its backward).
using BlockFn = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;

// Returns block(inputs) computed under no-grad, keeping only `inputs` (undefined entries allowed;
// the block gets them undefined again) and the state of the CPU generator and of the inputs'
// device's generator. In backward, re-runs the block with grad on detached copies of the inputs
// with those generators set back to the saved state (dropout draws the same masks; the generators
// are left where they were), then backpropagates the output gradient through the recomputed graph:
// parameter gradients accumulate into their .grad as without checkpointing and input gradients
// flow on. `params_require_grad` says whether a parameter the block reads requires grad: the
// output then requires grad even when no input does (a frozen embedding under LoRA layers).
// Without grad mode, or when nothing requires grad, the block just runs.
// As with torch.utils.checkpoint(use_reentrant=True), parameter gradients arrive through
// backward() only; torch::autograd::grad(loss, params) does not see them.
at::Tensor run_checkpointed(const BlockFn& block, const std::vector<at::Tensor>& inputs,
                            bool params_require_grad);

}  // namespace ft::model

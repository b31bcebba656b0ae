#include "model/activation_checkpoint.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "core/error.h"

namespace ft::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A generator the block may draw from and its state before the block's forward.
struct RngState {
  at::Generator generator;
  at::Tensor state;  // [n] uint8, the generator's own format
};

// The CPU generator always (CPU dropout), and the default generator of every other device an input
// lives on. A CUDA generator is reached through at::Context's CUDA hooks, which libtorch_cuda
// registers when it is loaded, so ft needs no link against it (no test covers it: ft trains on the
// CPU only so far).
std::vector<RngState> capture_rng(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Device> devices = {at::Device(at::kCPU)};
  for (const auto& t : inputs)
    if (t.defined() && std::find(devices.begin(), devices.end(), t.device()) == devices.end())
      devices.push_back(t.device());
  std::vector<RngState> out;
  for (const auto& d : devices) {
    at::Generator g = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(g.mutex());
    out.push_back({g, g.get_state()});
  }
  return out;
}

// Sets the generators to the forward's states for its lifetime and puts back the states they had,
// so a recompute neither draws new masks nor moves the generators the rest of the step uses.
class RngReplay {
 public:
  explicit RngReplay(const std::vector<RngState>& saved) {
    for (const auto& s : saved) {
      at::Generator g = s.generator;
      std::lock_guard<std::mutex> lock(g.mutex());
      now_.push_back({g, g.get_state()});
      g.set_state(s.state);
    }
  }
  ~RngReplay() {
    for (auto& s : now_) {
      std::lock_guard<std::mutex> lock(s.generator.mutex());
      s.generator.set_state(s.state);
    }
  }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  std::vector<RngState> now_;
};

// What backward needs besides the saved input tensors. The autograd context holds only IValues;
// a capsule is the one IValue that owns an arbitrary C++ object without registering a TorchScript
// class, so the Recompute lives exactly as long as the graph node.
struct Recompute : torch::CustomClassHolder {
  BlockFn block;
  std::vector<bool> defined;  // per block input: passed to the Function (the rest were undefined)
  std::vector<RngState> rng;
};

// Inputs: the block's defined inputs, an optional anchor (a leaf that requires grad, present when
// only the block's parameters do, so that autograd reaches this node), the Recompute.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static at::Tensor forward(AutogradContext* ctx, at::TensorList inputs,
                            const std::optional<at::Tensor>& /*anchor*/,
                            c10::intrusive_ptr<Recompute> recompute) {
    // Function::apply already runs this under no-grad; said again because it is the point: the
    // block's graph and activations are not kept.
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> all(recompute->defined.size());
    for (size_t i = 0, j = 0; i < all.size(); ++i)
      if (recompute->defined[i]) all[i] = inputs[j++];
    recompute->rng = capture_rng(all);
    at::Tensor out = recompute->block(all);
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(std::move(recompute));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto recompute =
        c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data.at("recompute").toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> all(recompute->defined.size());
    variable_list detached;
    for (size_t i = 0; i < all.size(); ++i) {
      if (!recompute->defined[i]) continue;
      const size_t j = detached.size();
      at::Tensor d = saved[j].detach();
      d.requires_grad_(ctx->needs_input_grad(j));
      all[i] = d;
      detached.push_back(d);
    }
    at::Tensor out;
    {
      RngReplay replay(recompute->rng);
      at::AutoGradMode grad_mode(true);
      out = recompute->block(all);
    }
    FT_ASSERT(out.requires_grad(),
              "the recomputed block's output does not require grad, yet its backward ran");
    // A nested backward (the engine allows re-entry): parameters are leaves, so their gradients
    // accumulate into .grad exactly as when the block ran without checkpointing.
    torch::autograd::backward({out}, {grad_outputs.at(0)});
    variable_list grads;
    for (const auto& d : detached) grads.push_back(d.requires_grad() ? d.grad() : at::Tensor());
    grads.emplace_back();  // anchor: nothing to accumulate
    grads.emplace_back();  // recompute: not a tensor
    return grads;
  }
};

}  // namespace

at::Tensor run_checkpointed(const BlockFn& block, const std::vector<at::Tensor>& inputs,
                            bool params_require_grad) {
  const bool inputs_require_grad =
      std::any_of(inputs.begin(), inputs.end(),
                  [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  if (!at::GradMode::is_enabled() || !(inputs_require_grad || params_require_grad))
    return block(inputs);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->block = block;
  std::vector<at::Tensor> defined;
  for (const auto& t : inputs) {
    recompute->defined.push_back(t.defined());
    if (t.defined()) defined.push_back(t);
  }
  std::optional<at::Tensor> anchor;
  if (!inputs_require_grad) {
    const at::Device device = defined.empty() ? at::Device(at::kCPU) : defined.front().device();
    anchor = at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(device)).requires_grad_();
  }
  return CheckpointFunction::apply(at::TensorList(defined), anchor, std::move(recompute));
}

}  // namespace ft::model

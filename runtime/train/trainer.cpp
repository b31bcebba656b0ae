#include "train/trainer.h"

#include <fmt/format.h>

#include <cmath>

#include "core/error.h"
#include "model/lora.h"

namespace ft::train {

at::ScalarType precision_dtype(const std::string& p) {
  if (p == "bf16") return at::kBFloat16;
  if (p == "fp16") return at::kHalf;
  if (p == "fp64") return at::kDouble;  // tests only: exact-arithmetic checks of the loop
  FT_CHECK(p == "fp32", "precision.mode must be fp32, bf16 or fp16, got '", p, "'");
  return at::kFloat;
}

Trainer::Trainer(model::LlamaModel& model, TrainOptions options, Strategy& strategy)
    : model_(model), options_(std::move(options)), strategy_(strategy) {
  compute_dtype_ = precision_dtype(options_.precision);
  master_dtype_ = compute_dtype_ == at::kDouble ? at::kDouble : at::kFloat;
  auto base = model_.parameters();
  std::vector<model::NamedTensor> trained = options_.lora ? model::lora_parameters(model_) : base;
  FT_CHECK(!trained.empty(), options_.lora ? "lora.enabled but the model has no adapters"
                                           : "the model has no parameters to train");
  // Freeze everything, then open up what is trained.
  for (auto& p : base) p.tensor->requires_grad_(false);
  at::NoGradGuard no_grad;
  for (auto& p : trained) {
    FT_ASSERT(p.tensor->scalar_type() == compute_dtype_, p.name, " is ", p.tensor->scalar_type(),
              ", expected the compute dtype");
    at::Tensor master = compute_dtype_ == master_dtype_ ? *p.tensor : p.tensor->to(master_dtype_);
    masters_.emplace_back(p.name, master);
    compute_.push_back(*p.tensor);
  }
  for (auto& t : compute_) t.requires_grad_(true);
  // Separate fp32 masters need their own grad buffers; in fp32 the model's grads are the masters'.
  if (compute_dtype_ != master_dtype_)
    for (auto& [n, m] : masters_) m.mutable_grad() = at::zeros_like(m);
  optimizer_ = std::make_unique<AdamW>(masters_, options_.adamw);
  if (compute_dtype_ == at::kHalf) {
    loss_scale_ = at::full({}, options_.loss_scale_init, at::kFloat);
    growth_tracker_ = at::zeros({}, at::kInt);
  }
}

StepStats Trainer::step(const std::vector<data::Batch>& micro_batches) {
  return apply_update(compute_gradients(micro_batches));
}

StepStats Trainer::compute_gradients(const std::vector<data::Batch>& micro_batches) {
  FT_CHECK(!micro_batches.empty(), "an optimizer step needs at least one micro-batch");
  int64_t local_tokens = 0;
  for (const auto& b : micro_batches) local_tokens += b.target_tokens();
  const int64_t tokens = strategy_.sum_over_ranks(local_tokens);
  StepStats st;
  st.tokens = tokens;
  const bool fp16 = compute_dtype_ == at::kHalf;
  const bool separate_masters = compute_dtype_ != master_dtype_;
  const double scale = fp16 ? loss_scale_.item<double>() : 1.0;
  st.loss_scale = scale;

  double loss_sum = 0;
  for (const auto& b : micro_batches) {
    at::Tensor logits =
        model_.forward(b.input_ids, b.position_ids, /*training=*/true, b.segment_ids);
    model::LossSum ls = model::causal_lm_loss_sum(logits, b.labels);
    // Each micro-batch contributes its token-loss sum over the whole step's tokens: the sum of
    // these gradients is exactly the gradient of the step's mean token loss.
    at::Tensor loss = ls.sum * (scale / std::max<int64_t>(tokens, 1));
    loss.backward();
    loss_sum += ls.sum.item<double>();
    if (separate_masters) {
      at::NoGradGuard g;
      for (size_t i = 0; i < compute_.size(); ++i) {
        at::Tensor& cg = compute_[i].mutable_grad();
        if (!cg.defined()) continue;
        masters_[i].second.mutable_grad().add_(cg.to(master_dtype_));
        cg = at::Tensor();
      }
    }
  }
  st.loss = loss_sum / std::max<int64_t>(tokens, 1);
  return st;
}

StepStats Trainer::apply_update(StepStats st) {
  const bool fp16 = compute_dtype_ == at::kHalf;
  const bool separate_masters = compute_dtype_ != master_dtype_;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (auto& [n, m] : masters_) {
    if (!m.grad().defined()) m.mutable_grad() = at::zeros_like(m);
    grads.push_back(m.grad());
  }
  strategy_.reduce_gradients(grads);

  if (fp16) {
    at::Tensor found_inf = at::zeros({}, at::kFloat);
    at::Tensor inv_scale = loss_scale_.reciprocal();
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    const bool overflow = found_inf.item<double>() > 0;
    at::_amp_update_scale_(loss_scale_, growth_tracker_, found_inf, 2.0, 0.5,
                           options_.loss_scale_window);
    if (overflow) {
      for (auto& g : grads) g.zero_();
      st.skipped = true;
      st.skipped_total = ++skipped_;
      st.step = step_;
      st.grad_norm = std::nan("");
      return st;
    }
  }
  std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2);
  double norm = at::stack(norms).norm().item<double>();
  st.grad_norm = norm;
  if (options_.grad_clip > 0 && norm > options_.grad_clip)
    at::_foreach_mul_(grads, options_.grad_clip / (norm + 1e-6));

  ++step_;
  st.lr = options_.schedule.lr_at(step_);
    optimizer_->step(st.lr);
  grads.clear();
  // fp32: drop the gradients (the next backward allocates them, as PyTorch's set_to_none does);
  // separate masters keep theirs as zeroed accumulators.
  for (auto& [n, m] : masters_) {
    if (separate_masters)
      m.mutable_grad().zero_();
    else
      m.mutable_grad() = at::Tensor();
  }
  if (separate_masters)
    for (size_t i = 0; i < compute_.size(); ++i) compute_[i].copy_(masters_[i].second);
  st.step = step_;
  st.skipped_total = skipped_;
  return st;
}

MemoryStats Trainer::memory() const {
  MemoryStats m;
  const bool separate_masters = compute_dtype_ != master_dtype_;
  for (auto& p : model_.parameters()) m.param_bytes += p.tensor->nbytes();
  if (options_.lora)  // adapters are not among the base parameters
    for (auto& t : compute_) m.param_bytes += t.nbytes();
  for (auto& [n, t] : masters_) {
    if (separate_masters) m.param_bytes += t.nbytes();
    if (t.grad().defined()) m.grad_bytes += t.grad().nbytes();
  }
  m.optimizer_bytes = optimizer_->state_bytes();
  return m;
}

}  // namespace ft::train

#include "train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "core/dtype.h"
#include "core/error.h"
#include "model/fused_loss.h"
#include "parallel/host_add.h"

namespace ft::train {
namespace {

// A 1-D fp64 tensor's values on the host: one copy (one wait when it is on a GPU).
std::vector<double> host_values(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  const double* p = c.data_ptr<double>();
  return std::vector<double>(p, p + c.numel());
}

}  // namespace

TrainOptions train_options(const config::TrainSettings& train,
                           const config::PrecisionSettings& precision, int64_t total_steps) {
  TrainOptions o;
  o.precision = precision.mode;
  o.schedule = {train.lr, train.warmup_for(total_steps), total_steps, train.min_lr_ratio,
                train.schedule};
  o.adamw = {train.beta1, train.beta2, train.eps, train.weight_decay};
  o.grad_clip = train.grad_clip;
  o.loss_scale_init = precision.loss_scale_init;
  o.loss_scale_window = precision.loss_scale_window;
  o.fused_loss = train.fused_loss;
  return o;
}

double router_aux_coef(const config::MoeSettings& moe, const model::ModelConfig& model) {
  if (!model.moe.enabled() || moe.aux_loss == "off") return 0;
  if (moe.aux_loss == "auto" && !model.moe.output_router_logits) return 0;
  return moe.aux_loss_coef >= 0 ? moe.aux_loss_coef : model.moe.router_aux_loss_coef;
}

std::string warmup_warning(const config::TrainSettings& train, int64_t total_steps) {
  const int64_t warmup = train.warmup_for(total_steps);
  if (warmup < total_steps || warmup == 0) return "";
  const std::string setting = train.warmup_steps > 0
                                  ? fmt::format("train.warmup_steps={}", train.warmup_steps)
                                  : fmt::format("train.warmup_ratio={:g}", train.warmup_ratio);
  return fmt::format(
      "the learning-rate warm-up ({}: {} steps) lasts the whole run of {} steps: the rate reaches "
      "train.lr={:g} {} and no step follows train.schedule={}; warm up for a part of the run "
      "(--set train.warmup_ratio=0.03, which replaces train.warmup_steps), or train longer",
      setting, warmup, total_steps, train.lr,
      warmup == total_steps ? "only at the last step" : "at no step", train.schedule);
}

model::FusedOps fused_ops(const config::TrainSettings& train) {
  return {train.fused_rms_norm, train.fused_swiglu, train.fused_rope, train.fused_attention};
}

Trainer::Trainer(model::DecoderModel& model, TrainOptions options, parallel::Engine& engine)
    : model_(model), options_(std::move(options)), engine_(engine) {
  compute_dtype_ = parse_dtype(options_.precision);
  std::vector<AdamW::Param> params;
  for (const auto& m : engine_.masters()) params.emplace_back(m.tensor, m.decay, m.copy_out);
  FT_CHECK(!params.empty(), "the model has no parameters to train");
  optimizer_ = std::make_unique<AdamW>(params, options_.adamw);
  if (compute_dtype_ == at::kHalf) {
    // Beside the gradients: the unscale and scale-update kernels take them on the same device
    // (the host when the optimizer is offloaded).
    const at::Device device = engine_.master_device();
    loss_scale_ = at::full({}, options_.loss_scale_init, at::dtype(at::kFloat).device(device));
    growth_tracker_ = at::zeros({}, at::dtype(at::kInt).device(device));
  }
}

Trainer::State Trainer::state() const {
  State s;
  s.step = step_;
  s.skipped = skipped_;
  s.optimizer_steps = optimizer_->steps();
  if (loss_scale_.defined()) {
    s.loss_scale = loss_scale_.item<double>();
    s.growth_tracker = growth_tracker_.item<int64_t>();
  }
  return s;
}

void Trainer::restore(const State& s) {
  step_ = s.step;
  skipped_ = s.skipped;
  optimizer_->set_steps(s.optimizer_steps);
  if (loss_scale_.defined()) {
    loss_scale_.fill_(s.loss_scale);
    growth_tracker_.fill_(s.growth_tracker);
  }
}

Trainer::~Trainer() {
  // A delayed update still running holds the masters: let it finish (an error unwinding past
  // here has been reported already). One that began during a backward that did not finish
  // would wait for gradients that never come: cancelled.
  engine_.cancel_updates();
  if (pending_.joinable()) pending_.join();
}

void Trainer::settle() {
  if (!pending_.joinable()) return;
  const auto t0 = std::chrono::steady_clock::now();
  pending_.join();
  // (Reported by the next step, whether it waits here or a checkpoint or evaluation did.)
  settle_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  settled_unreported_ = true;
  settled_run_s_ = pending_run_s_;
  settled_delayed_ = !pending_overlapped_;
  settled_during_backward_ = std::exchange(during_backward_, false);
  if (pending_overlapped_) {
    // Each master's compute copy was refreshed as it was updated.
    engine_.open_updates();
    if (pending_error_) std::rethrow_exception(std::exchange(pending_error_, nullptr));
    return;
  }
  if (pending_error_) std::rethrow_exception(std::exchange(pending_error_, nullptr));
  // The optimizer zeroed the gradients it consumed; the engine's current ones are the next step's.
  engine_.after_update(/*grads_zeroed=*/true, /*copied_out=*/false);
}

void Trainer::start_overlapped_update(double lr, double clip_scale) {
  optimizer_->begin(lr, clip_scale, /*zero_grads=*/true);
  engine_.reset_updates();
  engine_.close_updates();
  run_update_thread(/*during_backward=*/false);
}

// Overlapped, no delay, and nothing of the update waits for the whole gradient.
bool Trainer::update_during_backward() const {
  return options_.overlap_host_step && !delayed() &&
         parallel::update_can_begin_in_backward(engine_.options(), options_.grad_clip);
}

// Before the backward of the step's last micro-batch: the update before is over (the forward
// waited for each unit), this one begins with the next step's learning rate, and its thread takes
// the masters as the engine reports them final. The units stay open until apply_update closes
// those not yet updated.
void Trainer::start_update_during_backward() {
  settle();
  optimizer_->begin(options_.schedule.lr_at(step_ + 1), /*clip_scale=*/1.0, /*zero_grads=*/true);
  engine_.reset_updates(/*during_backward=*/true);
  during_backward_ = began_this_step_ = true;
  run_update_thread(/*during_backward=*/true);
}

void Trainer::run_update_thread(bool during_backward) {
  pending_overlapped_ = true;
  const int64_t step = step_ + (during_backward ? 1 : 0);  // (the step it updates for)
  pending_ = std::thread([this, during_backward, fail = options_.fail_host_update_step == step,
                          step] {
    try {
      at::NoGradGuard guard;
      // Its working time: not the waits for gradients that are not final yet.
      double busy_s = 0;
      const auto& order = engine_.update_order();
      for (size_t k = 0; k < order.size(); ++k) {
        const size_t i = during_backward ? engine_.next_final_master() : order[k].master;
        const auto t0 = std::chrono::steady_clock::now();
        const at::Tensor staged = engine_.update_staging(i);
        optimizer_->update(i, staged);
        engine_.updated(i, staged);
        busy_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (fail)
          throw Error(fmt::format(
              "the host optimizer update of step {} failed (FT_FAULT_HOST_UPDATE, a test's fault)",
              step));
      }
      pending_run_s_ = busy_s;
    } catch (...) {
      pending_error_ = std::current_exception();
      engine_.open_updates(pending_error_);  // (the forward waiting at a unit throws it)
    }
  });
}

StepStats Trainer::step(const std::vector<data::Batch>& micro_batches) {
  return apply_update(compute_gradients(micro_batches));
}

StepStats Trainer::compute_gradients(const std::vector<data::Batch>& micro_batches) {
  FT_CHECK(!micro_batches.empty(), "an optimizer step needs at least one micro-batch");
  int64_t local_tokens = 0;
  for (const auto& b : micro_batches) local_tokens += b.target_tokens();
  const int64_t tokens = std::llround(engine_.sum_over_ranks(static_cast<double>(local_tokens)));
  StepStats st;
  st.tokens = tokens;
  const bool fp16 = compute_dtype_ == at::kHalf;
  const double scale = fp16 ? loss_scale_.item<double>() : 1.0;
  st.loss_scale = scale;

  // The loss sums stay on the device until the step is done: reading one back after each
  // micro-batch would make the host wait for the GPU there (fp64: the same sums as on the host).
  at::Tensor loss_sums =
      at::empty({static_cast<int64_t>(micro_batches.size())},
                at::TensorOptions().dtype(at::kDouble).device(engine_.options().device));
  const double micro_x_ranks =
      static_cast<double>(micro_batches.size()) * static_cast<double>(engine_.world_size());
  const bool moe = model_.config().moe.enabled();
  std::vector<double> load;
  double aux_sum = 0;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const auto& b = micro_batches[i];
    engine_.begin_micro_batch(i + 1 == micro_batches.size());
    const model::LossSum ls =
        options_.fused_loss
            ? model::chunked_lm_loss_sum(
                  model_.hidden_states(b.input_ids, b.position_ids,
                                       /*training=*/true, b.attention_segments()),
                  model_.lm_head(), b.labels, /*count_tokens=*/false,
                  model::loss_chunk_elements(engine_.options().device.is_cuda()), &loss_blocks_,
                  model_.unit_hooks(), model_.logit_map())
            : model::causal_lm_loss_sum(model_.forward(b.input_ids, b.position_ids,
                                                       /*training=*/true, b.attention_segments()),
                                        b.labels, /*count_tokens=*/false);
    // Each micro-batch contributes its token-loss sum over the whole step's tokens (all ranks):
    // the sum of these gradients is exactly the gradient of the step's mean token loss.
    at::Tensor loss = ls.sum * (scale / std::max<int64_t>(tokens, 1));
    // The aux loss is the mean over micro-batches and ranks, its gradient added in backward.
    if (moe) aux_sum += route_aux(scale / micro_x_ranks, load);
    if (i + 1 == micro_batches.size() && update_during_backward()) start_update_during_backward();
    loss.backward();
    engine_.end_backward();
    loss_sums[static_cast<int64_t>(i)].copy_(ls.sum.detach());
  }
  engine_.finish_gradients();
  double loss_sum = 0;
  for (const double v : host_values(loss_sums)) loss_sum += v;
  st.loss = engine_.sum_over_ranks(loss_sum) / std::max<int64_t>(tokens, 1);
  if (moe) {
    if (options_.router_aux_coef > 0) st.aux_loss = engine_.sum_over_ranks(aux_sum) / micro_x_ranks;
    for (const double v : engine_.sum_over_ranks(load)) st.expert_tokens.push_back(std::llround(v));
    for (int64_t i = 0; i < model_.config().num_hidden_layers; ++i)
      if (model_.config().is_moe_layer(i)) st.moe_layers.push_back(i);
  }
  return st;
}

double Trainer::route_aux(double scale, std::vector<double>& load) {
  model::RouterAux& aux = model_.router_aux();
  if (aux.counts.empty()) return 0;
  const at::Tensor counts = at::stack(aux.counts).to(at::kDouble);  // [layers, E] on the host
  load.resize(static_cast<size_t>(counts.numel()), 0.0);
  const double* c = counts.data_ptr<double>();
  for (size_t i = 0; i < load.size(); ++i) load[i] += c[i];
  const double coef = options_.router_aux_coef;
  if (coef <= 0) return 0;
  const int64_t E = model_.config().moe.num_experts;
  if (!options_.router_aux_global) return router_aux_loss(aux, E, coef * scale);
  // f_e over every rank's micro-batch: the counts and token numbers summed over ranks first.
  const at::Tensor per_expert = counts.sum(0).contiguous();
  std::vector<double> both(per_expert.data_ptr<double>(), per_expert.data_ptr<double>() + E);
  both.push_back(static_cast<double>(aux.tokens));
  both = engine_.sum_over_ranks(both);
  const int64_t tokens_total = std::llround(both.back());
  both.pop_back();
  return router_aux_loss(aux, E, coef * scale, at::tensor(both, at::kDouble), tokens_total);
}

StepStats Trainer::apply_update(StepStats st) {
  const bool fp16 = compute_dtype_ == at::kHalf;
  at::NoGradGuard no_grad;
  // Delayed: the previous step's update is done and in the model; this step's gradients go to the
  // optimizer and the engine accumulates the next ones elsewhere.
  const bool delay = delayed();
  const bool overlap = !delay && options_.overlap_host_step && engine_.options().offload_optimizer;
  // The update beside this step (either kind) is done; it is reported with this step. (One that
  // began during this step's backward runs on: settled by the next step.)
  const bool during_backward = std::exchange(began_this_step_, false);
  if (!during_backward) {
    settle();
    pending_overlapped_ = false;
  }
  if (settled_unreported_) {
    st.host_update_s = settled_run_s_;
    st.host_update_wait_s = std::exchange(settle_wait_s_, 0.0) + engine_.take_update_wait_s();
    st.host_update_delayed = settled_delayed_;
    st.host_update_during_backward = settled_during_backward_;
    settled_unreported_ = false;
  }
  if (delay) engine_.hand_over_grads();
  // Each kind of master's gradients, by index into masters().
  std::vector<at::Tensor> grads;
  std::vector<size_t> sharded, replicated, experts, sharded_experts;
  for (size_t i = 0; i < engine_.masters().size(); ++i) {
    const auto& m = engine_.masters()[i];
    grads.push_back(m.tensor.grad());
    (m.expert    ? (m.sharded ? sharded_experts : experts)
     : m.sharded ? sharded
                 : replicated)
        .push_back(i);
  }

  if (fp16) {
    at::Tensor found_inf = at::zeros({}, loss_scale_.options());
    at::Tensor inv_scale = loss_scale_.reciprocal();
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    // One rank's overflow skips the step everywhere.
    found_inf.fill_(engine_.max_over_ranks(found_inf.item<double>()));
    const bool overflow = found_inf.item<double>() > 0;
    at::_amp_update_scale_(loss_scale_, growth_tracker_, found_inf, 2.0, 0.5,
                           options_.loss_scale_window);
    if (overflow) {
      if (delay)  // (the engine's own buffers hold the next step's)
        for (at::Tensor& g : grads) g.zero_();
      else
        engine_.after_update();  // zeroes the gradients
      st.skipped = true;
      st.skipped_total = ++skipped_;
      st.step = step_;
      st.grad_norm = std::nan("");
      return st;
    }
  }
  const auto norm_t0 = std::chrono::steady_clock::now();
  int beside = 0;  // offloaded gradients whose norm the engine's host thread took (fp16: none)
  auto sq = [&](const std::vector<size_t>& which) {
    double s = 0;
    if (which.empty()) return s;
    std::vector<at::Tensor> ts;
    for (const size_t i : which) ts.push_back(grads[i]);
    // fp32 / fp64 host gradients: ft's own pass over each (host_sq_norm, the same bits for any
    // thread count), a third of ATen's vector norm's time. An offloaded one's was taken by the
    // engine's host thread as soon as it was final, beside the backward (the same function).
    const bool host = std::all_of(ts.begin(), ts.end(), [](const at::Tensor& t) {
      return t.is_cpu() && t.is_contiguous() &&
             (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
    });
    if (host) {
      for (const size_t i : which) {
        const double early = fp16 ? std::nan("") : engine_.grad_sq_beside_backward(i);
        // (The update that began during the backward zeroes the gradients it has taken.)
        FT_ASSERT(!during_backward || !std::isnan(early), "master ", i,
                  ": no host norm although the update began during the backward");
        beside += !std::isnan(early);
        s += std::isnan(early) ? parallel::host_sq_norm(grads[i]) : early;
      }
      return s;
    }
    // Each tensor's norm, their squares summed in fp64 on the host, with one copy to the host
    // for all of them (one wait for the GPU). On a GPU the norms accumulate in fp64 (the kernel
    // widens each element; no copy): the clip factor then rounds to the same fp32 as the host
    // pass's (host_sq_norm) for the offloaded optimizer, which keeps an offloaded run's bits
    // those of the same run without offload (the gpu tests). On the CPU each norm in its own
    // dtype (fp32 masters: fp32; asking for fp64 there copies every gradient first, 4.5x slower
    // and a fifth of a small model's step). ATen's reduction splits a tensor by its length and the
    // thread count only, so a resumed process gets the same bits (tests/train/ft_train_test.cpp,
    // "fresh processes ...").
    const std::vector<at::Tensor> norms =
        ts.front().is_cuda() ? at::_foreach_norm(ts, 2, at::kDouble) : at::_foreach_norm(ts, 2);
    for (const double n : host_values(at::stack(norms).to(at::kDouble))) s += n * n;
    return s;
  };
  const double local_sq[4] = {sq(sharded), sq(replicated), sq(experts), sq(sharded_experts)};
  if (engine_.options().offload_optimizer) {
    st.norm_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - norm_t0).count();
    st.norms_beside_backward = beside;
    st.norms_before_backward_end = engine_.finals_before_backward_end();
    st.norms = static_cast<int>(grads.size());
  }
  const double norm =
      std::sqrt(engine_.global_sq_norm(local_sq[0], local_sq[1], local_sq[2], local_sq[3]));
  st.grad_norm = norm;
  // The clip's factor is applied, and the gradients zeroed, inside AdamW's own pass over them
  // (the same bits as a separate multiply; two passes over every gradient fewer).
  const double clip_scale = options_.grad_clip > 0 && norm > options_.grad_clip
                                ? options_.grad_clip / (norm + 1e-6)
                                : 1.0;

  ++step_;
  st.lr = options_.schedule.lr_at(step_);
  if (during_backward) {
    // Its thread goes on; the next forward waits at the units not yet updated.
    engine_.close_updates();
  } else if (delay) {
    // On a thread of its own while the next step runs (its AdamW loop threads as usual); it
    // writes no compute copies, which the next step reads: settle() refreshes them.
    pending_ = std::thread([this, lr = st.lr, clip_scale] {
      try {
        at::NoGradGuard guard;
        const auto t0 = std::chrono::steady_clock::now();
        optimizer_->step(lr, clip_scale, /*zero_grads=*/true, /*write_copies=*/false);
        pending_run_s_ =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } catch (...) {
        pending_error_ = std::current_exception();
      }
    });
  } else if (overlap) {
    start_overlapped_update(st.lr, clip_scale);
  } else {
    optimizer_->step(st.lr, clip_scale, /*zero_grads=*/true);
    engine_.after_update(/*grads_zeroed=*/true, /*copied_out=*/true);
  }
  st.step = step_;
  st.skipped_total = skipped_;
  return st;
}

MemoryStats Trainer::memory() {
  MemoryStats m;
  m.engine = engine_.take_accounting();
  m.param_bytes = m.engine.param_bytes;
  m.grad_bytes = m.engine.grad_bytes;
  m.optimizer_bytes = optimizer_->state_bytes();
  m.host_optimizer_bytes = engine_.options().offload_optimizer ? m.optimizer_bytes : 0;
  return m;
}

}  // namespace ft::train

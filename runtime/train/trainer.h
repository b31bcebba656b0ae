// One optimizer step at a time: gradient accumulation normalised by the step's total target
// tokens over all ranks (so N micro-batches of B equal one batch of N*B exactly, and W ranks equal
// one), mixed precision (bf16 compute with fp32 master weights and state; fp16 with dynamic loss
// scaling that skips and counts non-finite steps; fp32), global-norm clipping and AdamW with a
// schedule. The parameters, gradients and masters live in a parallel::Engine (ddp, zero3, fsdp or
// one rank); the trainer owns the optimizer over this rank's masters. Not thread-safe.
#pragma once

#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "config/settings.h"
#include "core/dtype.h"
#include "core/host_alloc.h"
#include "data/batch.h"
#include "model/decoder.h"
#include "parallel/engine.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace ft::train {

struct TrainOptions {
  std::string precision = "fp32";  // fp32 | bf16 | fp16
  Schedule schedule;
  AdamWOptions adamw;
  double grad_clip = 1.0;          // 0 disables
  double loss_scale_init = 65536;  // fp16
  int64_t loss_scale_window = 1000;
  bool fused_loss = true;  // train.fused_loss: model/fused_loss.h
  // Mixture-of-experts models: the load-balancing loss's weight (0: not added) and whether f_e
  // counts every rank's micro-batch (moe.aux_loss_scope global).
  double router_aux_coef = 0;
  bool router_aux_global = false;
  // ZeRO-Offload's delayed parameter update (strategy.zero3.delayed_update): from the step after
  // this many on, each step's optimizer update runs on a host thread during the next step's
  // forward and backward (-1: never).
  int64_t delayed_update_after = -1;
  // An offloaded optimizer (zero3 offload_optimizer, fsdp cpu_offload) without a delayed update:
  // the host update runs on its own thread, master by master in the order the next forward reads
  // them (parallel::Engine::update_order), each unit's parameters refreshed as soon as they are
  // updated; the next step starts at once and its forward waits at each unit until that unit is
  // updated (strategy.overlap_host_step). The same bits as the update in one piece. Without
  // clipping (grad_clip 0) and fp16's loss scale nothing waits for the whole gradient: the update
  // starts with the backward of the step's last micro-batch and takes each master as soon as its
  // gradient is final on the host (parallel::Engine::next_final_master).
  bool overlap_host_step = true;
  // FT_FAULT_HOST_UPDATE (a test's fault, run.cpp): the overlapped host update of this optimizer
  // step fails after its first master (-1: none).
  int64_t fail_host_update_step = -1;
};

struct StepStats {
  int64_t step = 0;  // optimizer steps taken (skipped fp16 steps do not count)
  double loss = 0;   // mean token loss of the step, all ranks
  double lr = 0;
  double grad_norm = 0;  // before clipping
  int64_t tokens = 0;    // target tokens in the step, all ranks
  bool skipped = false;  // fp16 overflow: no update
  int64_t skipped_total = 0;
  double loss_scale = 1;
  // Mixture-of-experts models: the load-balancing loss (mean over micro-batches and ranks; not in
  // `loss`, which stays the token loss) and the picks each expert received over the step on all
  // ranks, [MoE layer][expert] flattened (empty for a dense model).
  double aux_loss = 0;
  std::vector<int64_t> expert_tokens;
  std::vector<int64_t> moe_layers;  // the model's index of each MoE layer in expert_tokens
  // The host update of the step before that ran on its own thread beside this step (a delayed
  // update, strategy.zero3.delayed_update, or the overlapped one, strategy.overlap_host_step): how
  // long it ran, and how long the training thread waited for it (the forward at its units, this
  // step's hand-over, a checkpoint or evaluation before it); the rest was hidden. < 0: none.
  double host_update_s = -1, host_update_wait_s = 0;
  bool host_update_delayed = false;
  bool host_update_during_backward = false;  // (overlapped) it began with the step's backward
  // The optimizer offloaded: this rank's clip norm after the backward took norm_s, for `norms`
  // masters, of which norms_beside_backward came from the engine's host thread (taken beside the
  // backward as each gradient became final), norms_before_backward_end before the step's last
  // backward had ended. norms < 0: not offloaded.
  double norm_s = 0;
  int norms = -1, norms_beside_backward = 0, norms_before_backward_end = 0;
};

// This rank's resident state and communication over one step (parallel::Accounting) plus the
// optimizer state.
struct MemoryStats {
  int64_t param_bytes = 0;  // parameter shards (compute dtype) + separate fp32 masters
  int64_t grad_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t host_optimizer_bytes = 0;  // of optimizer_bytes, in host memory (offload_optimizer)
  parallel::Accounting engine;
  // The GPU's caching allocator, filled by the run on CUDA (on_gpu false on CPU: not reported).
  bool on_gpu = false;
  int64_t gpu_allocated_bytes = 0;       // held by tensors at the end of the step
  int64_t gpu_reserved_bytes = 0;        // held from the driver (allocated + cached)
  int64_t gpu_peak_allocated_bytes = 0;  // most allocated at once during the step
  // The host's step pool (core/host_alloc.h), filled by the run: its blocks at the end of the
  // step (in use and kept) and at most since loading ended (as peak_rss_bytes).
  int64_t host_pool_bytes = 0;
  int64_t host_pool_peak_bytes = 0;
};

class Trainer {
 public:
  // `engine` has been loaded (it holds the model's parameters); the trainer builds AdamW over its
  // masters.
  Trainer(model::DecoderModel& model, TrainOptions options, parallel::Engine& engine);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step: compute_gradients, then apply_update.
  StepStats step(const std::vector<data::Batch>& micro_batches);
  // Forward + backward over this rank's micro-batches (every rank passes the same number),
  // leaving the step's global gradient (of the mean token loss over all ranks' tokens) in the
  // masters' .grad(); returns loss and tokens.
  StepStats compute_gradients(const std::vector<data::Batch>& micro_batches);
  // Unscale (fp16), clip by the global norm and update; zeroes the gradients. With a delayed
  // update (TrainOptions::delayed_update_after) the update of the step before is finished and put
  // in the model first, and this step's update starts on a host thread and returns at once: the
  // next step's forward and backward run with the parameters of this one's start.
  StepStats apply_update(StepStats stats);
  // Waits for a delayed or overlapped update in flight and puts its values in the model: before a
  // checkpoint, an evaluation and the final save (each is a point where a delay starts over).
  // No-op without one.
  void settle();
  // Resident bytes and communication since the previous call.
  MemoryStats memory();
  int64_t steps() const { return step_; }
  parallel::Engine& engine() { return engine_; }

  // What a checkpoint keeps of the loop besides tensors.
  struct State {
    int64_t step = 0, skipped = 0;
    int64_t optimizer_steps = 0;
    double loss_scale = 0;  // fp16 only
    int64_t growth_tracker = 0;
  };
  State state() const;
  void restore(const State& s);
  AdamW& optimizer() { return *optimizer_; }
  // Frees the host blocks the fused loss keeps between steps (core/host_alloc.h): before work the
  // planner's step peak does not count them in (an evaluation, a checkpoint's snapshot, the end).
  void release_host_blocks() {
    loss_blocks_.release();
    core::release_step_pool();
  }
  const core::HostBlockCache& host_blocks() const { return loss_blocks_; }

 private:
  model::DecoderModel& model_;
  TrainOptions options_;
  parallel::Engine& engine_;
  at::ScalarType compute_dtype_;
  std::unique_ptr<AdamW> optimizer_;
  int64_t step_ = 0;
  int64_t skipped_ = 0;
  at::Tensor loss_scale_;             // [] fp32 on the engine's device (fp16 only)
  at::Tensor growth_tracker_;         // [] int32 on the engine's device (fp16 only)
  core::HostBlockCache loss_blocks_;  // the fused loss's logits and gradients on the CPU
  std::thread pending_;               // a delayed or overlapped update in flight
  bool pending_overlapped_ = false;   // it is the overlapped one (the engine's units wait for it)
  std::exception_ptr pending_error_;  // what it threw
  double pending_run_s_ = 0;          // how long it ran (written by its thread)
  double settle_wait_s_ = 0;          // how long settle() waited for it, since the last report
  bool settled_unreported_ = false;   // it finished and no step has reported it yet
  // What settle() found of the update it waited for, until a step reports it.
  double settled_run_s_ = 0;
  bool settled_delayed_ = false, settled_during_backward_ = false;
  // The update in flight began during a backward (clipping off); during this step's backward
  // (apply_update takes it).
  bool during_backward_ = false, began_this_step_ = false;

  // After a micro-batch's forward: its aux loss value, with the router gradient it adds set for
  // the backward (`scale`: the loss scale over micro-batches x ranks); its picks added to `load`.
  double route_aux(double scale, std::vector<double>& load);
  // The overlapped update (TrainOptions::overlap_host_step) on its thread: after the step, every
  // master in the next forward's order; or during the step's last backward, each master as its
  // gradient becomes final (update_during_backward: clipping off, no fp16, no delay).
  void start_overlapped_update(double lr, double clip_scale);
  bool update_during_backward() const;
  // This step's update is a delayed one (TrainOptions::delayed_update_after).
  bool delayed() const {
    return options_.delayed_update_after >= 0 && step_ >= options_.delayed_update_after;
  }
  void start_update_during_backward();
  void run_update_thread(bool during_backward);
};

// The load-balancing loss's weight a run uses: moe.aux_loss and moe.aux_loss_coef against the
// model's config.json (0 for a dense model, or when off).
double router_aux_coef(const config::MoeSettings& moe, const model::ModelConfig& model);

// The loop's options from the preset's train and precision sections, for `total_steps` steps.
TrainOptions train_options(const config::TrainSettings& train,
                           const config::PrecisionSettings& precision, int64_t total_steps);

// A warning when the warm-up of a run of `total_steps` steps reaches its end (the learning rate
// would rise all run and never decay), naming the setting and the fix; "" when it does not.
std::string warmup_warning(const config::TrainSettings& train, int64_t total_steps);

// The fused kernels the model uses (train.fused_rms_norm, train.fused_swiglu, train.fused_rope,
// train.fused_attention).
model::FusedOps fused_ops(const config::TrainSettings& train);

}  // namespace ft::train

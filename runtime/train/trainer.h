// One optimizer step at a time: gradient accumulation normalised by the step's total target
// tokens (so N micro-batches of B equal one batch of N*B exactly), mixed precision (bf16 compute
// with fp32 master weights and state; fp16 with dynamic loss scaling that skips and counts
// non-finite steps; fp32), global-norm clipping and AdamW with a schedule. Owns the master
// weights and the optimizer. Not thread-safe; one trainer per process.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "data/batch.h"
#include "model/llama.h"
#include "train/optimizer.h"
#include "train/schedule.h"
#include "train/strategy.h"

namespace ft::train {

struct TrainOptions {
  std::string precision = "fp32";  // fp32 | bf16 | fp16
  bool lora = false;               // train only the LoRA adapters (base frozen)
  Schedule schedule;
  AdamWOptions adamw;
  double grad_clip = 1.0;          // 0 disables
  double loss_scale_init = 65536;  // fp16
  int64_t loss_scale_window = 1000;
};

struct StepStats {
  int64_t step = 0;  // optimizer steps taken (skipped fp16 steps do not count)
  double loss = 0;   // mean token loss of the step
  double lr = 0;
  double grad_norm = 0;  // before clipping
  int64_t tokens = 0;    // target tokens in the step, all ranks
  bool skipped = false;  // fp16 overflow: no update
  int64_t skipped_total = 0;
  double loss_scale = 1;
};

struct MemoryStats {
  int64_t param_bytes = 0;  // model parameters (compute copies) + fp32 masters where separate
  int64_t grad_bytes = 0;
  int64_t optimizer_bytes = 0;
};

class Trainer {
 public:
  // `model` holds parameters in the compute dtype (fp32 for fp32; bf16/fp16 otherwise); the trainer
  // makes fp32 masters of what it trains when the dtype is lower.
  Trainer(model::LlamaModel& model, TrainOptions options, Strategy& strategy);

  // One optimizer step: compute_gradients, then apply_update.
  StepStats step(const std::vector<data::Batch>& micro_batches);
  // Forward + backward over the step's micro-batches, leaving the step's gradient (of the mean
  // token loss over all of them) in the masters' .grad(); returns loss and tokens.
  StepStats compute_gradients(const std::vector<data::Batch>& micro_batches);
  // Reduce over ranks, unscale (fp16), clip and update; zeroes the gradients.
  StepStats apply_update(StepStats stats);
  MemoryStats memory() const;
  int64_t steps() const { return step_; }
  // Trained tensors with their names (HF names, or PEFT names for LoRA), fp32 masters.
  const std::vector<std::pair<std::string, at::Tensor>>& masters() const { return masters_; }

 private:
  model::LlamaModel& model_;
  TrainOptions options_;
  Strategy& strategy_;
  at::ScalarType compute_dtype_;
  at::ScalarType master_dtype_;                              // fp32 (fp64 only in tests)
  std::vector<std::pair<std::string, at::Tensor>> masters_;  // fp32 leaves the optimizer updates
  std::vector<at::Tensor> compute_;  // the model's tensors for each master (same tensor in fp32)
  std::unique_ptr<AdamW> optimizer_;
  int64_t step_ = 0;
  int64_t skipped_ = 0;
  at::Tensor loss_scale_;      // [] fp32 (fp16 only)
  at::Tensor growth_tracker_;  // [] int32 (fp16 only)
};

at::ScalarType precision_dtype(const std::string& precision);

}  // namespace ft::train

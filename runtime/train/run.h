// A whole training run as `ft train` performs it: resolve what the preset asks for, build the
// model (random init from the preset's shape, or a Hugging Face directory), attach LoRA, pick the
// data source and strategy, train, report. Validates every input before writing anything, and never
// writes over an earlier run. Not thread-safe.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"
#include "model/llama.h"
#include "model/lora.h"

namespace ft::train {

struct RunOptions {
  nlohmann::json preset;       // resolved (config::resolve_preset)
  std::string model_dir;       // "" = random init from preset.model
  std::string data_path;       // "" = the preset's data (synthetic)
  std::string tokenizer_path;  // tokenizer.json for --data; default: <model_dir>/tokenizer.json
  std::string output_dir;      // created; must not hold an earlier run
};

struct RunSummary {
  int64_t steps = 0;
  double first_loss = 0, last_loss = 0;
  int64_t skipped_steps = 0;
};

RunSummary run_training(const RunOptions& options);

// Writes the trained model to `dir`: a PEFT adapter when `lora` is given, else HF-format
// safetensors + config.json, taking each trained tensor from its fp32 master in `masters`. Every
// file is written to a temporary name and renamed into place.
void save_final_model(model::LlamaModel& model, const model::LoraConfig* lora,
                      const std::vector<std::pair<std::string, at::Tensor>>& masters,
                      const std::string& dir);
// Writes `text` to path.tmp and renames it over `path`.
void write_text_atomic(const std::string& path, const std::string& text);

// Optimizer steps that `epochs` passes over data of `rows_per_epoch` sequences take, when each
// step takes micro_batch * grad_accum sequences on each of world_size ranks:
// ceil(epochs * rows_per_epoch / (micro_batch * grad_accum * world_size)), at least 1. Throws
// ConfigError for epochs <= 0.
int64_t steps_for_epochs(double epochs, int64_t rows_per_epoch, int64_t micro_batch,
                         int64_t grad_accum, int64_t world_size);

// The model shape a preset describes (used when no model directory is given).
model::LlamaConfig model_config_from_preset(const nlohmann::json& preset);

}  // namespace ft::train

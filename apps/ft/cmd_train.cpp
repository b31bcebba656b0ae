// `ft train --preset NAME|FILE [--model DIR] [--data PATH] [--output DIR] [--set k=v ...]`.
#include <fmt/format.h>

#include "commands.h"
#include "config/preset.h"
#include "core/error.h"
#include "dist/dist_env.h"
#include "train/run.h"

namespace ft::app {

Run add_train(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Fine-tune a Llama-family model as a preset says");
  auto preset = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  auto opts = std::make_shared<train::RunOptions>();
  cmd->add_option("--preset", *preset, "Shipped preset name or preset JSON file")->required();
  cmd->add_option("--model", opts->model_dir,
                  "Hugging Face model directory (default: random init)");
  cmd->add_option("--data", opts->data_path, "Training data (JSONL)");
  cmd->add_option("--tokenizer", opts->tokenizer_path,
                  "tokenizer.json for --data (default: the one in --model)");
  cmd->add_option("--output", opts->output_dir, "Output directory (must not hold an earlier run)")
      ->required();
  cmd->add_option("--set", *sets, "Override a preset key: --set train.lr=1e-4 (repeatable)");
  return [preset, sets, opts]() -> int {
    opts->preset = config::resolve_preset(*preset, *sets);
    opts->user_settings = config::user_settings(*preset, *sets);
    auto s = train::run_training(*opts);
    if (dist::read_dist_env().rank != 0) return 0;
    fmt::print("ft train: {} steps, loss {:.4f} -> {:.4f}{}\n", s.steps, s.first_loss, s.last_loss,
               s.skipped_steps ? fmt::format(", {} fp16 steps skipped", s.skipped_steps) : "");
    return 0;
  };
}

}  // namespace ft::app

// `ft eval --model DIR|ORG/NAME [--adapter DIR] --data PATH [--preset NAME|FILE] [--set k=v ...]`:
// prints JSON with the mean token loss, token count and perplexity over the data.
#include <fmt/format.h>

#include <chrono>

#include "commands.h"
#include "config/preset.h"
#include "config/schema.h"
#include "config/settings.h"
#include "core/host_alloc.h"
#include "train/evaluate.h"
#include "train_options.h"

namespace ft::app {

Run add_eval(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("eval", "Mean token loss and perplexity of a model over JSONL data");
  auto opts = std::make_shared<train::EvalOptions>();
  auto preset = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  cmd->add_option("--model", opts->model_dir,
                  "Hugging Face model directory, or a hub id the local hub cache holds")
      ->type_name("DIR|ORG/NAME")
      ->required();
  cmd->add_option("--adapter", opts->adapter_dir, "PEFT LoRA adapter directory");
  cmd->add_option("--data", opts->data_path,
                  "Data: JSONL (.jsonl, .jsonl.gz, .jsonl.zst), a JSON array (.json), Parquet, "
                  "Arrow, or a save_to_disk folder")
      ->required();
  cmd->add_option("--tokenizer", opts->tokenizer_path, "tokenizer.json (default: the model's)");
  cmd->add_option("--preset", *preset, "Preset whose data.* keys say how to read the data");
  cmd->add_option("--set", *sets, "Override a preset key: --set data.template=chatml");
  return [opts, preset, sets]() -> int {
    core::configure_host_malloc();  // first, before any thread: see core/host_alloc.h
    resolve_model_option(opts->model_dir, "ft eval", "--model", stdout);
    nlohmann::json resolved;
    if (preset->empty()) {
      // No preset: the schema's defaults (auto format, llama3 template) with the overrides.
      resolved = config::schema_defaults();
      config::apply_sets(resolved, *sets);
    } else {
      resolved = config::resolve_preset(*preset, *sets);
    }
    const config::Settings settings = config::settings_from_json(resolved, "resolved preset");
    opts->data = settings.data;
    opts->eval = settings.eval;
    opts->fused = train::eval_fused_ops(settings.train, settings.eval);
    opts->moe_grouped_mm = model::parse_grouped_mm(settings.moe.grouped_mm);
    opts->device = settings.hardware.device;
    opts->lora = settings.lora;
    const auto t0 = std::chrono::steady_clock::now();
    const train::EvalResult r = train::evaluate(*opts);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // A line to read, then the JSON line last (scripts take the last line).
    fmt::print(
        "ft eval: loss {:.4f} (perplexity {:.2f}) over {} tokens of {} records{} in {:.1f} s on "
        "{}\n",
        r.loss, r.perplexity, r.tokens, r.records,
        r.windowed ? fmt::format(" ({} longer than data.seq_len, split into {} windows)",
                                 r.windowed, r.windows)
                   : std::string(),
        seconds, r.device);
    fmt::print("{}\n", r.to_json().dump());
    return 0;
  };
}

}  // namespace ft::app

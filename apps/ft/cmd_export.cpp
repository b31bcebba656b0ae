// `ft export --checkpoint DIR [--step N] --output DIR [--merge-lora] [--dtype auto|fp32|bf16|fp16]
// [--max-shard-size BYTES] [--base-model DIR]`: a run's newest state (final/ or a committed
// checkpoint) as a Hugging Face model directory or a PEFT adapter (runtime/train/export.h).
#include <fmt/format.h>

#include <limits>

#include "commands.h"
#include "core/strings.h"
#include "train/export.h"
#include "train_options.h"

namespace ft::app {

Run add_export(CLI::App& app) {
  auto* cmd = app.add_subcommand("export",
                                 "Write a run (its final/ or a checkpoint) as a Hugging Face model "
                                 "directory, a PEFT adapter, or (--merge-lora) the merged model");
  cmd->footer(
      "Given a run's --output, the newest state is exported: final/ when the run finished and no "
      "checkpoint is newer, else the newest committed checkpoint; it says which. A full "
      "fine-tune gives config.json, model.safetensors (or shards + "
      "model.safetensors.index.json), the tokenizer files and the chat template the data was "
      "rendered with (chat_template.jinja); a LoRA run gives "
      "adapter_config.json + adapter_model.safetensors (fp32), or with --merge-lora the base "
      "model with the adapters merged in. Nothing is written unless everything checks out; "
      "details in docs/checkpoint-format.md#export.");
  auto opts = std::make_shared<train::ExportOptions>();
  cmd->add_option("--checkpoint", opts->checkpoint,
                  "A run's --output (its newest state), its final/, its checkpoints/, or a "
                  "step-N checkpoint directory")
      ->type_name("DIR")
      ->required();
  cmd->add_option("--step", opts->step,
                  "With a run's --output: export the committed checkpoint of this step instead "
                  "of the run's newest state")
      ->type_name("N")
      ->check(CLI::NonNegativeNumber.description(""));
  cmd->add_option("--output", opts->output_dir, "Where to write (must not exist, or be empty)")
      ->type_name("DIR")
      ->required();
  cmd->add_flag("--merge-lora", opts->merge_lora,
                "LoRA run: write the base model with W += scale * B @ A in every adapted "
                "projection, instead of the adapter");
  cmd->add_option("--dtype", opts->dtype,
                  "dtype of the weights written: auto = the run's precision.mode (fp32 for "
                  "fp64); full models only (a PEFT adapter is fp32)")
      ->check(CLI::IsMember({"auto", "fp32", "bf16", "fp16"}).description(""))
      ->type_name("auto|fp32|bf16|fp16")
      ->default_str("auto");
  cmd->add_option("--max-shard-size", opts->max_shard_bytes,
                  "Largest safetensors shard, in bytes, for full models [default: 5000000000, "
                  "transformers' 5GB]")
      ->type_name("BYTES")
      ->check(CLI::Range(uint64_t{1}, std::numeric_limits<uint64_t>::max()).description(""));
  cmd->add_option("--base-model", opts->base_model,
                  "The model directory the run was trained from, when it is no longer where the "
                  "checkpoint says (ft train --model), or its hub id in the local hub cache")
      ->type_name("DIR|ORG/NAME");
  return [opts]() -> int {
    resolve_model_option(opts->base_model, "ft export", "--base-model", stdout);
    opts->progress = [](const std::string& line) {
      fmt::print("ft export: {}\n", line);
      std::fflush(stdout);
    };
    const train::ExportSummary s = train::export_checkpoint(*opts);
    const std::string step = s.step >= 0 ? fmt::format("step {}", s.step) : "step unknown";
    fmt::print("ft export: {} of {} -> {}: {}, {} tensors in {} ({}), {} files\n", step, s.source,
               opts->output_dir, s.kind, s.tensors, s.dtype,
               human_bytes(static_cast<int64_t>(s.bytes)), s.files.size());
    return 0;
  };
}

}  // namespace ft::app

// `ft export --checkpoint DIR --output DIR [--merge-lora] [--dtype auto|fp32|bf16|fp16]
// [--max-shard-size BYTES] [--base-model DIR]`: a committed checkpoint as a Hugging Face model
// directory or a PEFT adapter (runtime/train/export.h).
#include <fmt/format.h>

#include <limits>

#include "commands.h"
#include "core/strings.h"
#include "train/export.h"

namespace ft::app {

Run add_export(CLI::App& app) {
  auto* cmd = app.add_subcommand("export",
                                 "Write a checkpoint as a Hugging Face model directory, a PEFT "
                                 "adapter, or (--merge-lora) the merged model");
  cmd->footer(
      "A full fine-tune gives config.json, model.safetensors (or shards + "
      "model.safetensors.index.json) and the tokenizer files; a LoRA checkpoint gives "
      "adapter_config.json + adapter_model.safetensors (fp32), or with --merge-lora the base "
      "model with the adapters merged in. Nothing is written unless everything checks out; "
      "details in docs/checkpoint-format.md#export.");
  auto opts = std::make_shared<train::ExportOptions>();
  cmd->add_option("--checkpoint", opts->checkpoint,
                  "A step-N checkpoint directory, or a run's --output (or its checkpoints/): "
                  "then its newest committed checkpoint")
      ->type_name("DIR")
      ->required();
  cmd->add_option("--output", opts->output_dir, "Where to write (must not exist, or be empty)")
      ->type_name("DIR")
      ->required();
  cmd->add_flag("--merge-lora", opts->merge_lora,
                "LoRA checkpoint: write the base model with W += scale * B @ A in every adapted "
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
                  "checkpoint says (ft train --model)")
      ->type_name("DIR");
  return [opts]() -> int {
    opts->progress = [](const std::string& line) {
      fmt::print("ft export: {}\n", line);
      std::fflush(stdout);
    };
    const train::ExportSummary s = train::export_checkpoint(*opts);
    fmt::print("ft export: step {} of {} -> {}: {}, {} tensors in {} ({}), {} files\n", s.step,
               s.checkpoint, opts->output_dir, s.kind, s.tensors, s.dtype,
               human_bytes(static_cast<int64_t>(s.bytes)), s.files.size());
    return 0;
  };
}

}  // namespace ft::app

// `ft export`: turns a committed checkpoint (docs/checkpoint-format.md) into what other tools load:
// a Hugging Face model directory (config.json, safetensors shards + index, tokenizer files) for a
// full fine-tune; for LoRA a PEFT adapter, or the base model with the adapters merged in. Every
// input is checked before anything is written; the files go into a temporary directory that is
// renamed to the output at the end, so a failure (a damaged chunk found while reading) leaves
// nothing behind. Weights are read, converted and written one tensor at a time. Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace ft::train {

struct ExportOptions {
  // A step-<N> directory (holding meta.json), or a run's output directory or its checkpoints/
  // folder: then the newest committed checkpoint there.
  std::string checkpoint;
  std::string output_dir;   // created; must not exist or be empty
  bool merge_lora = false;  // LoRA checkpoints: write the base with the adapters merged in
  // auto: the run's precision.mode (fp32 for fp32 and fp64) | fp32 | bf16 | fp16. Full models
  // only: a PEFT adapter is fp32.
  std::string dtype = "auto";
  uint64_t max_shard_bytes = 0;  // full models; 0: io::kDefaultMaxShardBytes (HF's 5 GB)
  std::string base_model;        // "": the --model directory the checkpoint names (if it moved)
  // Told one line per file written (a shard, the adapter).
  std::function<void(const std::string& line)> progress;
};

struct ExportSummary {
  std::string checkpoint;  // the step directory exported
  int64_t step = 0;
  std::string kind;   // "model", "adapter" or "merged model"
  std::string dtype;  // of the weights written: "float32", "bfloat16", "float16"
  int64_t tensors = 0;
  uint64_t bytes = 0;              // of tensor data
  std::vector<std::string> files;  // written into output_dir
};

// The committed checkpoint `dir` names: itself when it holds meta.json, else the newest committed
// step-<N> under dir/checkpoints, or under dir. ConfigError naming the path when there is none.
std::string find_checkpoint(const std::string& dir);

ExportSummary export_checkpoint(const ExportOptions& options);

}  // namespace ft::train

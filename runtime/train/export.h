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
  // A run's output directory (its newest state: final/ when the run finished and no checkpoint is
  // newer, else its newest committed checkpoint), its checkpoints/ folder, its final/, or a
  // step-<N> directory holding meta.json.
  std::string checkpoint;
  int64_t step = -1;        // >= 0: that step's checkpoint of the run, not its newest state
  std::string output_dir;   // created; must not exist or be empty
  bool merge_lora = false;  // LoRA runs: write the base with the adapters merged in
  // auto: the run's precision.mode (fp32 for fp32 and fp64) | fp32 | bf16 | fp16. Full models
  // only: a PEFT adapter is fp32.
  std::string dtype = "auto";
  uint64_t max_shard_bytes = 0;  // full models; 0: io::kDefaultMaxShardBytes (HF's 5 GB)
  std::string base_model;        // "": the --model directory the run names (if it moved)
  // Told one line per file written (a shard, the adapter), and which state is exported and why.
  std::function<void(const std::string& line)> progress;
};

struct ExportSummary {
  std::string source;  // the directory exported: a step-<N> checkpoint or a run's final/
  int64_t step = -1;   // the step it holds; -1 when unknown (a final/ without its run's records)
  std::string kind;    // "model", "adapter" or "merged model"
  std::string dtype;   // of the weights written: "float32", "bfloat16", "float16"
  int64_t tensors = 0;
  uint64_t bytes = 0;              // of tensor data
  std::vector<std::string> files;  // written into output_dir
};

// Which state of a run `ft export --checkpoint DIR [--step N]` takes, and why (told to the user).
struct ExportChoice {
  std::string dir;     // a committed step-<N> directory or a final/ directory
  bool final = false;  // dir is a run's final/
  int64_t step = -1;   // the step it holds; -1 when unknown
  std::string why;
};

// DIR itself when it is a committed checkpoint or a final/ (then `step` must be -1); for a run's
// output directory or its checkpoints/ folder: with `step` >= 0 that step's committed checkpoint,
// else the newest state (final/ unless a committed checkpoint is newer). ConfigError naming the
// path and what it holds when there is none.
ExportChoice choose_export_source(const std::string& dir, int64_t step = -1);

ExportSummary export_checkpoint(const ExportOptions& options);

}  // namespace ft::train

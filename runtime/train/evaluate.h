// `ft eval`: the mean token loss (and perplexity) of a model, optionally with a LoRA adapter, over
// every record of a JSONL file, each record once, rendered and masked as training would. The same
// evaluation set and batch scoring serve `ft train`'s eval.data (train/run.cpp), so the two agree.
// Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/settings.h"
#include "data/batch.h"
#include "data/jsonl_source.h"
#include "model/decoder.h"

namespace ft::train {

struct EvalOptions {
  config::DataSettings data;   // how to read the records (the preset's data section)
  config::EvalSettings eval;   // long records, tokens per forward
  std::string model_dir;       // Hugging Face directory (config.json + safetensors)
  std::string adapter_dir;     // PEFT adapter directory, or ""
  std::string data_path;       // JSONL
  std::string tokenizer_path;  // default: <model_dir>/tokenizer.json
  model::FusedOps fused;       // eval_fused_ops
  model::GroupedMm moe_grouped_mm = model::GroupedMm::kAuto;  // moe.grouped_mm
  // Its quantize_base / double_quant: the base's projections in NF4, as a QLoRA run held them (a
  // model saved in NF4 is read so whatever they say).
  config::LoraSettings lora;
  // hardware.device: where the model runs (auto: a GPU when one is visible, as ft train).
  std::string device = "cpu";
};

struct EvalResult {
  double loss = 0;        // mean token loss over every trained token
  int64_t tokens = 0;     // tokens that carried a loss
  double perplexity = 0;  // exp(loss)
  int64_t records = 0;
  int64_t windowed = 0;  // records longer than data.seq_len, split into windows
  int64_t windows = 0;   // the windows they made
  int64_t forwards = 0;  // batches run
  int64_t padding = 0;   // padding tokens in them
  std::string device;    // where it ran: "cpu", "cuda:0"
  nlohmann::json to_json() const;
};

// An eval file opened as ft eval reads it: `data`'s format and template, the tokenizer at
// `tokenizer_path` ("" for pre-tokenized records), ids checked against `vocab_size`, a bad record
// an error naming file:line.
std::unique_ptr<data::JsonlSource> open_eval_source(const config::DataSettings& data,
                                                    const std::string& path,
                                                    const std::string& tokenizer_path,
                                                    const std::string& model_dir,
                                                    int64_t vocab_size);

// What evaluation runs over: every record once, tokenized whole (in parallel), long ones split into
// windows or refused (eval.long_records), sorted by length (longest first) and batched up to
// eval.batch_tokens (rows x the longest piece in the batch), padding after each piece.
struct EvalSet {
  std::vector<data::Batch> batches;  // on the CPU
  std::vector<int64_t> tokens;       // tokens of each batch's pieces (progress)
  int64_t records = 0, windowed = 0, windows = 0, padding = 0;
  std::vector<std::string> origins;  // "FILE:LINE" of each record scored, in the given order
};
EvalSet make_eval_set(const data::JsonlSource& source, const config::EvalSettings& eval,
                      int64_t seq_len);
// The same over chosen records (eval.split's held-out ones, data/mixture.h): record `record` of
// `source` each. With `skip_malformed` (data.on_bad_record=skip) a malformed one is left out,
// else it is its FormatError naming file:line.
struct EvalRecord {
  const data::JsonlSource* source;
  int64_t record;
};
EvalSet make_eval_set(const std::vector<EvalRecord>& records, const config::EvalSettings& eval,
                      int64_t seq_len, bool skip_malformed = false);

// One batch's summed token loss and the number of tokens that carry one: no grad, no dropout, the
// head and the loss chunk by chunk. `batch` must be on the model's device.
struct BatchLoss {
  double sum = 0;
  int64_t tokens = 0;
};
BatchLoss score_batch(const model::DecoderModel& model, const data::Batch& batch);

// The fused CPU kernels an evaluation's forward runs: train.fused_*'s with eval.fused_kernels,
// else none, so that the forward is transformers' op sequence and its bits (the fused RMSNorm sums
// its squares in another order than ATen's mean; docs/training.md "Fidelity of ft eval").
model::FusedOps eval_fused_ops(const config::TrainSettings& train,
                               const config::EvalSettings& eval);

// Every record once, tokenized whole (in parallel), sorted by length and batched up to
// eval.batch_tokens with padding only to the longest record of its batch (causal attention, no
// mask); a record longer than data.seq_len is split into windows or refused (eval.long_records).
// The mean is over every token that carries a loss, each scored exactly once.
EvalResult evaluate(const EvalOptions& options);

}  // namespace ft::train

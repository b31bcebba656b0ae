// The model directories ft writes for other tools — a Hugging Face model (config.json, safetensors
// shards + index, tokenizer files) or a PEFT adapter — and the model a preset describes. Used at
// the end of `ft train` (final/) and by `ft export` (from a checkpoint). Stateless; thread-safe as
// long as two calls do not write the same directory.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/settings.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/lora.h"

namespace ft::train {

// The files a model directory's tokenizer consists of, copied beside a saved model when present.
// chat_template.jinja is where transformers 5 keeps a chat template (and reads it first).
inline constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json",
                                                  "special_tokens_map.json",
                                                  "generation_config.json", "chat_template.jinja"};
inline constexpr const char* kChatTemplateFile = "chat_template.jinja";

// The model shape a preset describes (used when no model directory is given); ConfigError when the
// preset has model.require_dir (its model must come from --model).
model::ModelConfig model_config_from_preset(const config::ModelSettings& model);
// The adapters a preset's lora section asks for, on the base `base_model` ("" = random init),
// validated; with `model`, fitted to the projections its family has (model::fit_lora_targets).
model::LoraConfig lora_config_from_preset(const config::LoraSettings& lora,
                                          const std::string& base_model,
                                          const model::ModelConfig* model = nullptr);

// QLoRA: makes `model` hold its projections in NF4 when the preset asks (lora.quantize_base=nf4,
// with lora.double_quant) or its files are already quantized (model.quant.in_files), and refuses
// what cannot be: a quantized base without lora.enabled, NF4 under precision fp64.
// `model_dir` names the model in messages ("" when from the preset).
void apply_base_quant(const config::LoraSettings& lora, const std::string& precision,
                      const std::string& model_dir, model::ModelConfig& model);
// The part of it that asks for the NF4 base (lora.quantize_base, lora.double_quant) without the
// refusals: what ft eval does, which holds a base with or without an adapter.
void ask_base_quant(const config::LoraSettings& lora, const std::string& where,
                    model::ModelConfig& model);

// Writes the trained model to `dir`: a PEFT adapter (`tensors` are the adapters) when `lora` is
// given, else HF-format safetensors + config.json (`tensors` are every weight, in the dtype to
// store, `dtype` and `torch_dtype` in config.json). Every file is written to a temporary name and
// renamed into place.
void save_final_model(const model::ModelConfig& config, const model::LoraConfig* lora,
                      const io::NamedTensors& tensors, const std::string& dir);

// A Hugging Face model directory: config.json (`dtype` and `torch_dtype` from the first tensor's
// dtype) and the weights, sharded past `max_shard_bytes` as save_pretrained does, each tensor made
// as its shard is written (io::write_sharded_deferred); a MoE layer's fused experts are written
// per expert, as transformers saves them. Returns the files written.
std::vector<std::string> save_hf_model(const model::ModelConfig& config,
                                       const io::DeferredTensors& tensors, const std::string& dir,
                                       uint64_t max_shard_bytes = io::kDefaultMaxShardBytes,
                                       const io::ShardWritten& on_written = {});

// The order in which save_hf_model(config, fused_tensors, dir, max_shard_bytes) makes the fused
// tensors (indices into `fused_tensors`, each once: a MoE layer's expert tensor when its first
// per-expert piece is written). When making a tensor is a collective, the ranks that do not write
// walk this order to take part in step with rank 0.
std::vector<size_t> hf_make_order(const model::ModelConfig& config,
                                  const io::DeferredTensors& fused_tensors,
                                  uint64_t max_shard_bytes = io::kDefaultMaxShardBytes);
// A PEFT adapter directory: adapter_config.json + adapter_model.safetensors (`tensors` in fp32).
void save_peft_adapter(const model::LoraConfig& lora, const io::NamedTensors& tensors,
                       const std::string& dir);

// Copies `files` into `dir`, each replacing its namesake durably (io::copy_file_durably);
// SystemError naming the file that failed.
void copy_files_into(const std::vector<std::string>& files, const std::string& dir);
// The tokenizer files copied into `dir`, and the chat template the run rendered its data with
// (`chat_template`, Jinja source; "" when none was rendered) written as chat_template.jinja, so
// that transformers' apply_chat_template on the saved model renders what training rendered:
// transformers reads that file before tokenizer_config.json's `chat_template`, which is dropped
// from the copy as save_pretrained drops it. Returns the names of the files written.
std::vector<std::string> write_tokenizer_files(const std::vector<std::string>& files,
                                               const std::string& chat_template,
                                               const std::string& dir);
// The tokenizer files (kTokenizerFiles) that `model_dir` holds, as paths; none for "".
std::vector<std::string> tokenizer_files_of(const std::string& model_dir);

// Writes `text` as the whole of `path`, durably (io::write_file_durably: path.tmp, fsync, rename,
// fsync of the directory; no temporary left behind on failure).
void write_text_atomic(const std::string& path, const std::string& text);

}  // namespace ft::train

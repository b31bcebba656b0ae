#include "train/saved_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/json.h"
#include "io/durable_file.h"
#include "model/moe.h"

namespace ft::train {

using nlohmann::json;
namespace fs = std::filesystem;

model::ModelConfig model_config_from_preset(const config::ModelSettings& m) {
  FT_CHECK(!m.require_dir,
           "this preset trains your own model (model.require_dir is true): give its Hugging Face "
           "directory with --model DIR (config.json, *.safetensors, tokenizer.json), or its hub id "
           "(ORG/NAME) when it is in the local Hugging Face cache; the model's "
           "shape comes from there. To try ft without a model, use --preset tiny-demo");
  model::ModelConfig c;
  c.vocab_size = m.vocab_size;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_hidden_layers = m.num_layers;
  c.num_attention_heads = m.num_heads;
  c.num_key_value_heads = m.num_kv_heads;
  FT_CHECK(c.hidden_size % c.num_attention_heads == 0, "preset: model.hidden_size (", c.hidden_size,
           ") must be a multiple of model.num_heads (", c.num_attention_heads, ")");
  c.head_dim = c.hidden_size / c.num_attention_heads;
  c.rope.theta = m.rope_theta;
  c.tie_word_embeddings = m.tie_embeddings;
  c.max_position_embeddings = m.max_seq_len;
  c.rms_norm_eps = 1e-5;
  c.validate("preset model");
  return c;
}

model::LoraConfig lora_config_from_preset(const config::LoraSettings& l,
                                          const std::string& base_model,
                                          const model::ModelConfig* model) {
  model::LoraConfig c;
  c.r = l.r;
  c.alpha = l.alpha;
  c.dropout = l.dropout;
  c.target_modules = l.target_modules;
  c.target_parameters = l.target_parameters;
  std::sort(c.target_parameters.begin(), c.target_parameters.end());
  c.target_parameters.erase(std::unique(c.target_parameters.begin(), c.target_parameters.end()),
                            c.target_parameters.end());
  c.train_router = l.train_router;
  c.use_rslora = l.rslora;
  c.base_model_name_or_path = base_model;
  c.validate("preset lora");
  if (model) model::fit_lora_targets(c, *model);
  return c;
}

void ask_base_quant(const config::LoraSettings& lora, const std::string& where,
                    model::ModelConfig& model) {
  if (lora.quantize_base != "nf4" || model.quant.in_files) return;
  model.quant.nf4 = true;
  model.quant.double_quant = lora.double_quant;
  model.validate(where);
}

void apply_base_quant(const config::LoraSettings& lora, const std::string& precision,
                      const std::string& model_dir, model::ModelConfig& model) {
  const std::string where = model_dir.empty() ? "preset model" : model_dir + "/config.json";
  ask_base_quant(lora, where, model);
  if (!model.quant.nf4) return;
  const std::string what = model.quant.in_files
                               ? model_dir + " is saved quantized (bitsandbytes 4-bit NF4)"
                               : std::string("lora.quantize_base=nf4 quantizes the base");
  FT_CHECK(lora.enabled, what,
           ", which only LoRA can train on (the base stays frozen): set lora.enabled=true, or "
           "give --model an unquantized model for a full fine-tune");
  FT_CHECK(precision != "fp64", what,
           ", which computes in fp32, bf16 or fp16, not precision.mode=", precision);
}

void write_text_atomic(const std::string& path, const std::string& text) {
  io::write_file_durably(path, text);
}

namespace {

// transformers' save_pretrained writes a MoE layer's experts one tensor per expert and weight
// (model/moe.h: expert_file_pieces): each fused expert tensor becomes its pieces, made from the
// fused tensor once (kept until its last piece is written; the writer makes tensors one at a time).
io::DeferredTensors per_expert_layout(const model::ModelConfig& config,
                                      const io::DeferredTensors& tensors) {
  struct Fused {
    std::function<at::Tensor()> make;
    at::Tensor flat;
    size_t pieces_left = 0;
  };
  io::DeferredTensors out;
  for (const auto& t : tensors) {
    const auto pieces = model::expert_file_pieces(config, t.name);
    if (pieces.empty()) {
      out.push_back(t);
      continue;
    }
    auto fused = std::make_shared<Fused>();
    fused->make = t.make;
    fused->pieces_left = pieces.size();
    for (const auto& p : pieces)
      out.push_back({p.file_name, p.shape, t.dtype, [fused, p]() {
                       if (!fused->flat.defined()) fused->flat = fused->make().reshape({-1});
                       at::Tensor piece = fused->flat.narrow(0, p.offset, p.numel()).view(p.shape);
                       piece = piece.clone();
                       if (--fused->pieces_left == 0) fused->flat = at::Tensor();
                       return piece;
                     }});
  }
  return out;
}

}  // namespace

std::vector<size_t> hf_make_order(const model::ModelConfig& config,
                                  const io::DeferredTensors& fused_tensors,
                                  uint64_t max_shard_bytes) {
  // The same expansion as per_expert_layout, each piece remembering its fused tensor.
  io::DeferredTensors expanded;
  std::vector<size_t> owner;
  for (size_t i = 0; i < fused_tensors.size(); ++i) {
    const auto& t = fused_tensors[i];
    const auto pieces = model::expert_file_pieces(config, t.name);
    if (pieces.empty()) {
      expanded.push_back({t.name, t.shape, t.dtype, {}});
      owner.push_back(i);
    }
    for (const auto& p : pieces) {
      expanded.push_back({p.file_name, p.shape, t.dtype, {}});
      owner.push_back(i);
    }
  }
  std::vector<size_t> order;
  std::vector<char> made(fused_tensors.size(), 0);
  for (const size_t k : io::write_order(expanded, max_shard_bytes))
    if (!made[owner[k]]) {
      made[owner[k]] = 1;
      order.push_back(owner[k]);
    }
  return order;
}

std::vector<std::string> save_hf_model(const model::ModelConfig& config,
                                       const io::DeferredTensors& fused_tensors,
                                       const std::string& dir, uint64_t max_shard_bytes,
                                       const io::ShardWritten& on_written) {
  FT_ASSERT(!fused_tensors.empty(), "save_hf_model: no tensors");
  const io::DeferredTensors tensors = per_expert_layout(config, fused_tensors);
  std::error_code ec;
  fs::create_directories(dir, ec);
  FT_CHECK_T(SystemError, !ec, "cannot create ", dir, ": ", ec.message());
  // Hugging Face layout: config.json + model.safetensors (sharded past max_shard_bytes).
  std::vector<std::string> files =
      io::write_sharded_deferred(dir, tensors, max_shard_bytes, {{"format", "pt"}}, on_written);
  json cj = json::parse(model::model_config_json(config));
  // The dtype the weights are stored in, under both names: transformers 5 reads `dtype` (a
  // source model's "float32" there would load bf16 weights as fp32, twice the memory), and
  // transformers 4 and other tools `torch_dtype`.
  const auto st = tensors.front().dtype;
  const char* stored = st == at::kBFloat16 ? "bfloat16" : st == at::kHalf ? "float16" : "float32";
  cj["dtype"] = stored;
  cj["torch_dtype"] = stored;
  write_text_atomic(dir + "/config.json", cj.dump(2) + "\n");
  files.push_back("config.json");
  return files;
}

void save_peft_adapter(const model::LoraConfig& lora, const io::NamedTensors& tensors,
                       const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  FT_CHECK_T(SystemError, !ec, "cannot create ", dir, ": ", ec.message());
  // PEFT's format: adapter_config.json + adapter_model.safetensors, fp32.
  io::write_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  write_text_atomic(dir + "/adapter_config.json", model::lora_config_json(lora));
}

void save_final_model(const model::ModelConfig& config, const model::LoraConfig* lora,
                      const io::NamedTensors& tensors, const std::string& dir) {
  if (lora) return save_peft_adapter(*lora, tensors, dir);
  save_hf_model(config, io::defer(tensors), dir);
}

std::vector<std::string> tokenizer_files_of(const std::string& model_dir) {
  std::vector<std::string> out;
  if (model_dir.empty()) return out;
  for (const char* f : kTokenizerFiles)
    if (fs::exists(fs::path(model_dir) / f)) out.push_back((fs::path(model_dir) / f).string());
  return out;
}

namespace {

// A JSON file with its keys in the file's order (nlohmann::json would sort them).
nlohmann::ordered_json read_ordered_json(const std::string& path) {
  const std::string text = read_text_file<FormatError>(path);
  FT_CHECK_T(FormatError, json_too_deep_at(text) == std::string_view::npos, path,
             ": JSON nested deeper than ", kMaxJsonDepth, " levels; refused");
  try {
    return nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: not valid JSON: {}", path, excerpt(e.what(), 200)));
  }
}

}  // namespace

std::vector<std::string> write_tokenizer_files(const std::vector<std::string>& files,
                                               const std::string& chat_template,
                                               const std::string& dir) {
  std::vector<std::string> written;
  for (const auto& src : files) {
    const std::string name = fs::path(src).filename().string();
    if (!chat_template.empty() && name == kChatTemplateFile) continue;  // ours replaces it
    const std::string dst = (fs::path(dir) / name).string();
    if (!chat_template.empty() && name == "tokenizer_config.json") {
      // ordered_json keeps the file's key order; only the template entry goes.
      nlohmann::ordered_json j = read_ordered_json(src);
      if (j.is_object() && j.contains("chat_template")) {
        j.erase("chat_template");
        write_text_atomic(dst, j.dump(2) + "\n");
        written.push_back(name);
        continue;
      }
    }
    io::copy_file_durably(src, dst);
    written.push_back(name);
  }
  if (!chat_template.empty()) {
    write_text_atomic((fs::path(dir) / kChatTemplateFile).string(), chat_template);
    written.push_back(kChatTemplateFile);
  }
  return written;
}

void copy_files_into(const std::vector<std::string>& files, const std::string& dir) {
  for (const auto& src : files) {
    const fs::path dst = fs::path(dir) / fs::path(src).filename();
    io::copy_file_durably(src, dst.string());
  }
}

}  // namespace ft::train

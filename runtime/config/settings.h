// The resolved preset as typed fields: one struct per section, one field per schema row. The
// schema (schema.cpp) binds each row to its field, so a setting is declared once and the rest of
// the runtime reads `settings.train.micro_batch`, never the preset's JSON. Plain values; a filled
// Settings is immutable by convention and safe to share between threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace ft::config {

// The model shape used when no --model directory is given (random init).
struct ModelSettings {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  double rope_theta = 0;
  bool tie_embeddings = false;
  int64_t max_seq_len = 0;
  bool require_dir = false;  // the shape only from --model (train/saved_model.h refuses without)
};

// Where a conversation record keeps its parts (data.columns.*, data.tags.*, data.tools), as
// LLaMA-Factory's dataset_info.json "columns" and "tags" name them; data/records.h's RecordShape
// is its resolved form. One per data source.
struct RecordShapeSettings {
  std::string messages;       // the turns' key; "": "messages" (chat), "conversations" (sharegpt)
  std::string system;         // a record's system prompt key (sharegpt; chat: a system message)
  std::string tools;          // a record's tools key: a list, or a JSON string of one
  std::string role, content;  // sharegpt: the keys of a turn's speaker and text
  // sharegpt: the speaker names of each role (LLaMA-Factory's user_tag, assistant_tag, ...).
  std::vector<std::string> user, assistant, system_tag, function_call, observation;
  std::string tools_file;  // data.tools: a JSON file of tools for records without their own
};

// A data.sources entry's own "columns", "tags" and "tools" (data.sources[].columns.messages, ...):
// each key given replaces data.columns.* / data.tags.* / data.tools for that source only.
struct RecordShapeOverrides {
  std::optional<std::string> messages, system, tools, role, content, tools_file;
  std::optional<std::vector<std::string>> user, assistant, system_tag, function_call, observation;

  RecordShapeSettings over(RecordShapeSettings base) const {
    auto take = [](auto& to, const auto& given) {
      if (given) to = *given;
    };
    take(base.messages, messages);
    take(base.system, system);
    take(base.tools, tools);
    take(base.role, role);
    take(base.content, content);
    take(base.tools_file, tools_file);
    take(base.user, user);
    take(base.assistant, assistant);
    take(base.system_tag, system_tag);
    take(base.function_call, function_call);
    take(base.observation, observation);
    return base;
  }
};

// One entry of data.sources (a weighted mixture; docs/training.md "Mixtures"), or one --data
// PATH[:WEIGHT]. Empty format / template: data.format's and data.template's.
struct DataSourceSettings {
  std::string path;            // JSONL; relative to the working directory, as --data
  std::string name;            // in metrics and the report; "" = the path's file name
  std::string format;          // "" | auto | text | alpaca | chat | sharegpt | tokenized
  std::string chat_template;   // "template": "" | auto | llama3 | llama2 | chatml | mistral | none
  double weight = 1;           // > 0; the mixture's shares are the weights over their sum
  int64_t max_records = 0;     // the file's first max_records records only; 0 = all
  RecordShapeOverrides shape;  // "columns", "tags", "tools": this source's record shape
};

struct DataSettings {
  std::string format;         // auto | text | alpaca | chat | sharegpt | tokenized | synthetic
  std::string chat_template;  // data.template: auto | llama3 | llama2 | chatml | mistral | none
  int64_t seq_len = 0;
  bool pack = false;
  bool train_on_prompt = false;
  std::string on_bad_record;  // error | skip
  RecordShapeSettings shape;
  std::vector<DataSourceSettings> sources;  // data.sources: a mixture; empty = --data

  bool synthetic() const { return format == "synthetic"; }
};

struct TrainSettings {
  int64_t micro_batch = 0;
  int64_t grad_accum = 0;
  int64_t max_steps = 0;  // 0: run for `epochs`
  double epochs = 0;
  double lr = 0;
  double min_lr_ratio = 0;
  int64_t warmup_steps = 0;
  double warmup_ratio = 0;  // used when warmup_steps is 0 (never both: config/preset.cpp)
  std::string schedule;     // cosine | linear | constant
  double weight_decay = 0;
  double beta1 = 0, beta2 = 0, eps = 0;
  double grad_clip = 0;
  int64_t seed = 0;
  int64_t log_every = 0;
  std::string activation_checkpointing;  // none | full | every_n
  int64_t checkpoint_every_n_layers = 0;
  bool fused_loss = true;      // model/fused_loss.h: the head and the loss chunk by chunk
  bool fused_rms_norm = true;  // model/fused_ops.h
  bool fused_swiglu = true;
  bool fused_rope = true;
  bool fused_attention = true;  // model/cpu_attention.h

  // The warm-up of a run of `total_steps` optimizer steps: warmup_steps, else warmup_ratio of the
  // run rounded up, as HF's Trainer rounds it, except that a product within rounding of a whole
  // number is that number (0.1 x 30 is 3, where the doubles give 3.0000000000000004).
  int64_t warmup_for(int64_t total_steps) const {
    if (warmup_steps > 0) return warmup_steps;
    const double steps = warmup_ratio * static_cast<double>(total_steps);
    const double nearest = std::round(steps);
    return static_cast<int64_t>(
        std::abs(steps - nearest) <= 1e-9 * std::max(1.0, steps) ? nearest : std::ceil(steps));
  }
};

struct PrecisionSettings {
  std::string mode;  // fp32 | bf16 | fp16 | fp64 (core/dtype.h turns it into a dtype)
  double loss_scale_init = 0;
  int64_t loss_scale_window = 0;
};

struct LoraSettings {
  bool enabled = false;
  int64_t r = 0;
  double alpha = 0;
  double dropout = 0;
  std::vector<std::string> target_modules;
  std::vector<std::string> target_parameters;  // expert weights (model/lora.h)
  bool train_router = false;
  bool rslora = false;
  std::string quantize_base;  // none | nf4 (QLoRA: model/nf4.h)
  bool double_quant = false;
};

// Mixture-of-experts models (model/moe.h); unused by dense ones.
struct MoeSettings {
  std::string aux_loss;        // auto (the model's output_router_logits) | on | off
  double aux_loss_coef = -1;   // < 0: the model's router_aux_loss_coef
  std::string aux_loss_scope;  // micro_batch | global (f_e over every rank's micro-batch)
  int64_t collapse_steps = 0;  // steps an expert may get no token before the warning
  std::string grouped_mm;      // auto | on | off: the experts' products as one grouped GEMM
};

struct HardwareSettings {
  std::string device;     // auto | cpu | cuda
  std::string preflight;  // refuse | warn | off
};

struct DdpSettings {
  double bucket_mb = 0;
};

struct Zero3Settings {
  double prefetch_bucket_size = 0;
  double param_persistence_threshold = 0;
  double reduce_bucket_size = 0;
  bool offload_optimizer = false;
  bool offload_param = false;
  bool delayed_update = false;       // ZeRO-Offload's delayed parameter update
  int64_t delayed_update_after = 0;  // steps run without the delay first
};

struct FsdpSettings {
  std::string sharding_strategy;  // FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD
  bool forward_prefetch = false;
  std::string backward_prefetch;  // BACKWARD_PRE | BACKWARD_POST | NONE
  std::string param_dtype;        // auto | fp32 | bf16 | fp16
  std::string reduce_dtype;       // fp32 | bf16 | fp16
  bool cpu_offload = false;
};

struct StrategySettings {
  std::string kind;  // ddp | zero3 | fsdp
  bool overlap_comm = true;
  bool overlap_host_step = true;  // an offloaded optimizer's update beside the next forward
  int64_t expert_parallel = 1;    // ranks each MoE layer's experts are split over (1: none)
  DdpSettings ddp;
  Zero3Settings zero3;
  FsdpSettings fsdp;
  // The keys the user set (in their preset files and --set), with where: a knob of another
  // strategy is refused rather than ignored (config::user_settings).
  std::map<std::string, std::string> user_keys;
};

struct OutputSettings {
  int64_t save_every = 0;
  double save_every_minutes = 0;
  int64_t keep_last = 0;
  bool async_save = false;
  std::string on_save_error;  // "stop" | "continue"
  int64_t profile_steps = 0;
  bool tensorboard = false;  // TensorBoard event files under <output>/tensorboard/
};

struct EvalSettings {
  std::string long_records;    // "window" | "refuse": a record longer than data.seq_len in ft eval
  int64_t batch_tokens = 0;    // tokens per evaluation forward, padding included
  std::string data;            // ft train: held-out JSONL evaluated during training; "" = none
  int64_t every = 0;           // ft train: evaluate every this many steps (0: at the end only)
  bool fused_kernels = false;  // the forward through train.fused_*'s kernels (else transformers')
  // ft train: records of the training data held out and evaluated as eval.data is: a fraction
  // (< 1) of each source, or a whole count (>= 1) spread over the sources; 0 = none.
  double split = 0;
};

struct Settings {
  std::string name;  // the preset's name
  ModelSettings model;
  DataSettings data;
  TrainSettings train;
  PrecisionSettings precision;
  LoraSettings lora;
  MoeSettings moe;
  HardwareSettings hardware;
  StrategySettings strategy;
  OutputSettings output;
  EvalSettings eval;
  // The resolved preset these fields were read from, every key present: what preset.json and a
  // checkpoint's state record (byte for byte what resolve_preset returned).
  nlohmann::json resolved;
};

// The typed view of a resolved preset (resolve_preset's result, or one a checkpoint recorded):
// every schema row's value in its field (a key missing from an older checkpoint's preset takes its
// default). ConfigError naming `where` and the key for a value of the wrong type.
Settings settings_from_json(const nlohmann::json& resolved, const std::string& where);

// resolve_preset + user_settings + settings_from_json: what `ft train` and `ft eval` start from.
Settings resolve_settings(const std::string& name_or_file, const std::vector<std::string>& sets);

}  // namespace ft::config

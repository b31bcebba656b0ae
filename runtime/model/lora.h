// LoRA adapters on a DecoderModel's projections, in PEFT's format: adapter_config.json and
// adapter_model.safetensors keys "base_model.model.<module>.lora_A.weight" [r, in] and
// "...lora_B.weight" [out, r]; scale alpha/r, or alpha/sqrt(r) with rsLoRA. The base stays frozen.
// Not thread-safe (mutates the model).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/decoder.h"

namespace ft::model {

struct LoraConfig {
  int64_t r = 16;
  double alpha = 32;
  double dropout = 0.0;
  std::vector<std::string> target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                             "gate_proj", "up_proj", "down_proj"};
  // Fused expert weights of a mixture-of-experts model that get adapters, PEFT's
  // target_parameters: kExpertParameters (model/moe.h: ExpertLora for the layout). Needs dropout 0
  // (PEFT cannot load such an adapter with dropout). Sorted.
  std::vector<std::string> target_parameters;
  // Mixture-of-experts models: every MoE layer's router (mlp.gate.weight) trained in full beside
  // the adapters, as PEFT's modules_to_save ["gate"] keeps it: saved in the adapter file as
  // "base_model.model.model.layers.L.mlp.gate.weight".
  bool train_router = false;
  bool use_rslora = false;
  std::string base_model_name_or_path;  // identity of the base, written into adapter_config.json
  double scale() const;
  // Throws ConfigError on r < 1, unknown target module names, bias other than "none"...
  void validate(const std::string& where) const;
};

// The expert weights LoRA can adapt, in the order a transformers experts module registers them
// (which fixes PEFT's nesting of their adapters: lora_parameters).
extern const std::vector<std::string> kExpertParameters;  // mlp.experts.gate_up_proj, ...down_proj

// The projections a model of `model`'s family has, in PEFT's names: q/k/v/o/gate/up/down, or
// Phi-3's qkv_proj o_proj gate_up_proj down_proj.
const std::vector<std::string>& lora_modules_of(const ModelConfig& model);
// Makes `config` name what the model has: the default list (all seven separate projections)
// becomes lora_modules_of(model); a named module the model lacks, or target_parameters on a model
// without experts, is refused (ConfigError), as PEFT refuses a target that matches nothing.
void fit_lora_targets(LoraConfig& config, const ModelConfig& model);

// Reads a PEFT adapter_config.json; refuses (FormatError naming the file and key) what ft does not
// implement: peft_type other than LORA, bias != "none", modules_to_save, per-layer rank patterns.
// target_modules entries may be the full module paths PEFT saves for "all-linear"
// ("model.layers.0.mlp.down_proj"); each becomes the projection it names.
LoraConfig load_lora_config(const std::string& path);
std::string lora_config_json(const LoraConfig& c);

// Adds adapters to every targeted projection: lora_A ~ PEFT's kaiming-uniform (bound 1/sqrt(in))
// from a CPU generator seeded with `seed`, lora_B = 0. Freezes nothing by itself; the trainer
// decides what requires grad. `shapes_only`: meta tensors, nothing drawn (the planner's model).
void attach_lora(DecoderModel& model, const LoraConfig& config, uint64_t seed,
                 bool shapes_only = false);

// The adapter tensors with their PEFT names, in a fixed order; with train_router also each MoE
// layer's router under its PEFT name (the same tensor DecoderModel::parameters() names
// "model.layers.L.mlp.gate.weight").
std::vector<NamedTensor> lora_parameters(DecoderModel& model);

// The PEFT key of a module's adapter matrix: peft_key("model.layers.0.self_attn.q_proj", 'A').
std::string peft_key(const std::string& module, char which);

// The module whose adapter `config` puts on the base parameter `param`:
// "model.layers.3.mlp.up_proj" for "model.layers.3.mlp.up_proj.weight" when up_proj is a target;
// "" for a parameter that gets none (norms, embeddings, biases, untargeted projections).
std::string lora_module_of(const std::string& param, const LoraConfig& config);

// The PEFT keys (A, B) of the adapter `config` puts on a fused expert parameter
// ("model.layers.1.mlp.experts.gate_up_proj"); empty strings when it gets none. PEFT nests one
// wrapper per targeted parameter of the experts module, the first registered innermost, so with
// both targeted gate_up_proj's keys are "...mlp.experts.base_layer.lora_A.weight" and
// down_proj's "...mlp.experts.lora_A.weight".
std::pair<std::string, std::string> expert_lora_keys(const std::string& param,
                                                     const LoraConfig& config);

// The weight with its adapter folded in, as PEFT's merge_and_unload computes it:
// W + (B @ A) * scale. weight [out, in], a [r, in], b [out, r], any float dtypes; fp32 result.
at::Tensor merge_lora(const at::Tensor& weight, const at::Tensor& a, const at::Tensor& b,
                      double scale);

}  // namespace ft::model

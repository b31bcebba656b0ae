#include "config/foreign_keys.h"

#include <fmt/format.h>

namespace ft::config {
namespace {

constexpr std::string_view kHf = "HF TrainingArguments, LLaMA-Factory and axolotl";
constexpr std::string_view kHfLf = "HF TrainingArguments and LLaMA-Factory";
constexpr std::string_view kAx = "axolotl";
constexpr std::string_view kLf = "LLaMA-Factory";
constexpr std::string_view kPeft = "PEFT's LoraConfig, LLaMA-Factory and axolotl";

}  // namespace

// Names as the tools' own documentation spells them. A name ft's schema also uses as a leaf
// (seed, max_steps, warmup_steps, weight_decay, warmup_ratio, target_modules, template) needs no
// row: the schema's leaf match already suggests it.
const std::vector<ForeignKey>& foreign_keys() {
  static const std::vector<ForeignKey> all = {
      {"learning_rate", "train.lr", kHf, ""},
      {"per_device_train_batch_size", "train.micro_batch", kHfLf, "sequences per rank"},
      {"micro_batch_size", "train.micro_batch", kAx, "sequences per rank"},
      {"gradient_accumulation_steps", "train.grad_accum", kHf, ""},
      {"num_train_epochs", "train.epochs", kHfLf, ""},
      {"num_epochs", "train.epochs", kAx, ""},
      {"lr_scheduler_type", "train.schedule", kHfLf, "cosine, linear or constant"},
      {"lr_scheduler", "train.schedule", kAx, "cosine, linear or constant"},
      {"adam_beta1", "train.beta1", kHf, ""},
      {"adam_beta2", "train.beta2", kHf, ""},
      {"adam_epsilon", "train.eps", kHf, ""},
      {"max_grad_norm", "train.grad_clip", kHf, ""},
      {"logging_steps", "train.log_every", kHf, ""},
      {"gradient_checkpointing", "train.activation_checkpointing", kHf,
       "true is train.activation_checkpointing=full"},
      {"bf16", "precision.mode", kHf, "true is precision.mode=bf16"},
      {"fp16", "precision.mode", kHf, "true is precision.mode=fp16"},
      {"save_steps", "output.save_every", kHf, ""},
      {"save_total_limit", "output.keep_last", kHf, ""},
      {"eval_steps", "eval.every", kHf, ""},
      {"cutoff_len", "data.seq_len", kLf, ""},
      {"sequence_len", "data.seq_len", kAx, ""},
      {"max_seq_length", "data.seq_len", "TRL's SFTConfig", ""},
      {"packing", "data.pack", "LLaMA-Factory and TRL's SFTConfig", ""},
      {"sample_packing", "data.pack", kAx, ""},
      {"train_on_inputs", "data.train_on_prompt", kAx, ""},
      {"chat_template", "data.template", kAx, ""},
      {"lora_rank", "lora.r", kLf, ""},
      {"lora_r", "lora.r", kAx, ""},
      {"rank", "lora.r", "common speech (PEFT says r, LLaMA-Factory lora_rank)", ""},
      {"lora_alpha", "lora.alpha", kPeft, ""},
      {"lora_dropout", "lora.dropout", kPeft, ""},
      {"lora_target", "lora.target_modules", kLf,
       "all is ft's default (every projection); else a list of PEFT names"},
      {"lora_target_modules", "lora.target_modules", kAx, ""},
      {"use_rslora", "lora.rslora", "PEFT's LoraConfig and LLaMA-Factory", ""},
      {"finetuning_type", "lora.enabled", kLf, "lora is lora.enabled=true, full is false"},
      {"adapter", "lora.enabled", kAx,
       "lora is lora.enabled=true; qlora is that with lora.quantize_base=nf4"},
      {"quantization_bit", "lora.quantize_base", kLf, "4 is lora.quantize_base=nf4"},
      {"double_quantization", "lora.double_quant", kLf, ""},
      {"load_in_4bit", "lora.quantize_base", kAx, "true is lora.quantize_base=nf4"},
      {"bnb_4bit_use_double_quant", "lora.double_quant", "transformers' BitsAndBytesConfig", ""},
      {"deepspeed", "strategy.kind", kHf,
       "ZeRO-3 is strategy.kind=zero3, knobs under strategy.zero3"},
      {"fsdp", "strategy.kind", kHf, "strategy.kind=fsdp, knobs under strategy.fsdp"},
      {"peft_use_rslora", "lora.rslora", kAx, ""},
      {"resume_from_checkpoint", "--resume DIR", kHf, ""},
      {"output_dir", "--output DIR", kHf, ""},
      {"model_name_or_path", "--model DIR|ORG/NAME", "LLaMA-Factory and the HF example scripts",
       ""},
      {"base_model", "--model DIR|ORG/NAME", kAx, ""},
      {"dataset", "--data FILE", kLf, "a JSONL file; several: --data FILE:WEIGHT each"},
      {"datasets", "data.sources", kAx,
       "a list of {\"path\", \"weight\", ...}; one file: --data FILE"},
      {"interleave_probs", "data.sources", kLf, "each source's \"weight\" (or --data FILE:WEIGHT)"},
      {"val_size", "eval.split", kLf, "a fraction below 1 or a count of records"},
      {"val_set_size", "eval.split", kAx, "a fraction below 1 or a count of records"},
  };
  return all;
}

namespace {
const ForeignKey* find(std::string_view name) {
  for (const ForeignKey& k : foreign_keys())
    if (k.name == name) return &k;
  return nullptr;
}
}  // namespace

const ForeignKey* foreign_key(std::string_view key) {
  if (const ForeignKey* whole = find(key)) return whole;
  const size_t dot = key.rfind('.');
  return dot == std::string_view::npos ? nullptr : find(key.substr(dot + 1));
}

std::string foreign_key_hint(std::string_view key) {
  const ForeignKey* k = foreign_key(key);
  if (!k) return "";
  const std::string note = k->note.empty() ? "" : fmt::format("; {}", k->note);
  if (k->ft.substr(0, 2) == "--")
    return fmt::format(" (\"{}\" is the name in {}; ft takes it on the command line: {}{})",
                       k->name, k->tools, k->ft, note);
  return fmt::format(" (did you mean \"{}\"? \"{}\" is the name in {}{})", k->ft, k->name, k->tools,
                     note);
}

}  // namespace ft::config

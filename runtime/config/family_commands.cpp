#include "config/family_commands.h"

#include <fmt/format.h>

namespace ft::config {

namespace {

// Where the commands put things: what a user replaces with their own.
constexpr const char* kData = "train.jsonl";
constexpr int kNodeGpus = 8;

struct Row {
  const char* model_type;
  const char* checkpoints;
  const char* model;
};

// The families of model/family.cpp, with the checkpoint of each that most people fine-tune.
constexpr Row kRows[] = {
    {"llama", "Llama 2, Llama 3 / 3.1 / 3.2", "meta-llama/Llama-3.1-8B-Instruct"},
    {"mistral", "Mistral 7B v0.1-v0.3, Mistral NeMo", "mistralai/Mistral-7B-Instruct-v0.3"},
    {"ministral", "Ministral 8B", "mistralai/Ministral-8B-Instruct-2410"},
    {"qwen2", "Qwen2, Qwen2.5 (0.5B-72B)", "Qwen/Qwen2.5-7B-Instruct"},
    {"qwen3", "Qwen3 dense (0.6B-32B)", "Qwen/Qwen3-8B"},
    {"gemma2", "Gemma 2 (2B, 9B, 27B)", "google/gemma-2-9b-it"},
    {"gemma3_text", "Gemma 3 1B and 270M (text-only checkpoints)", "google/gemma-3-1b-it"},
    {"phi3", "Phi-3, Phi-3.5, Phi-4, Phi-4-mini", "microsoft/Phi-4-mini-instruct"},
    {"olmo2", "OLMo 2 (1B, 7B, 13B, 32B)", "allenai/OLMo-2-1124-7B"},
    {"granite", "Granite 3.x dense (2B, 8B)", "ibm-granite/granite-3.1-8b-instruct"},
};

// runs/<the hub name's last part>-<kind>: one output directory per model and kind of run.
std::string output_of(const std::string& model, const char* kind) {
  return fmt::format("runs/{}-{}", model.substr(model.rfind('/') + 1), kind);
}

FamilyCommands commands_of(const Row& r) {
  FamilyCommands c{r.model_type, r.checkpoints, r.model, "", ""};
  c.lora = fmt::format("ft train --preset lora --model {} --data {} --output {}", c.model, kData,
                       output_of(c.model, "lora"));
  c.full = fmt::format(
      "ft launch --standalone --nproc-per-node {} --preset full --model {} --data {} --output {}",
      kNodeGpus, c.model, kData, output_of(c.model, "full"));
  return c;
}

}  // namespace

const std::vector<FamilyCommands>& family_commands() {
  static const std::vector<FamilyCommands> rows = [] {
    std::vector<FamilyCommands> out;
    for (const Row& r : kRows) out.push_back(commands_of(r));
    return out;
  }();
  return rows;
}

std::string family_commands_text() {
  std::string s = fmt::format(
      "Commands per model family: LoRA on one process, full fine-tune on the {} GPUs of one "
      "node.\n--model takes a model directory or a hub id in the local Hugging Face cache (`hf "
      "download ORG/NAME` first); {} is your JSONL data.\n",
      kNodeGpus, kData);
  for (const FamilyCommands& c : family_commands())
    s += fmt::format("\n{:<12} {}\n  {}\n  {}\n", c.model_type, c.checkpoints, c.lora, c.full);
  return s;
}

}  // namespace ft::config

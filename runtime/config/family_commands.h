// The commands `ft presets` and docs/training.md ("Commands per model family") show for each model
// family ft trains: a LoRA fine-tune on one process (the `lora` preset) and a full fine-tune on the
// eight GPUs of one node (the `full` preset under `ft launch`), of a popular checkpoint named as on
// the Hugging Face hub. Declared once here, so the command and the page cannot drift apart (the
// test checks the page quotes every command). Immutable; thread-safe.
#pragma once

#include <string>
#include <vector>

namespace ft::config {

struct FamilyCommands {
  std::string model_type;   // config.json "model_type" of the family
  std::string checkpoints;  // the releases of the family, for people: "Qwen2, Qwen2.5 (0.5B-72B)"
  std::string model;        // the hub name the commands use: "Qwen/Qwen2.5-7B-Instruct"
  std::string lora;         // `ft train --preset lora --model <model> ...`, complete
  std::string full;         // `ft launch ... --preset full --model <model> ...`, complete
};

// One row per family, in the order of model/family.cpp's table.
const std::vector<FamilyCommands>& family_commands();

// What `ft presets` prints after the preset list: a heading, then per family its model_type and
// checkpoints, and the two commands indented on their own lines.
std::string family_commands_text();

}  // namespace ft::config

// The names other fine-tuning tools give ft's settings (HF TrainingArguments, PEFT's LoraConfig,
// LLaMA-Factory, axolotl, TRL), so that an unknown key a user brings from them is answered with
// ft's own key (or the command-line option that takes it) rather than "unknown key" alone. One
// static table; pure functions; thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ft::config {

struct ForeignKey {
  std::string_view name;   // the other tools' name: "learning_rate"
  std::string_view ft;     // ft's schema key ("train.lr"), or its option ("--output DIR")
  std::string_view tools;  // who call it so: "HF TrainingArguments, LLaMA-Factory and axolotl"
  std::string_view note;   // how the value translates, where it does not one to one ("" if it does)
};

// Every name the table knows (a test checks that each points at a schema key or an option).
const std::vector<ForeignKey>& foreign_keys();

// The entry for `key`, matched whole (a dotted key) or by its last component
// ("train.learning_rate" finds learning_rate); nullptr when no tool ft knows uses that name.
const ForeignKey* foreign_key(std::string_view key);

// The suggestion an unknown-key error appends for `key`: ` (did you mean "train.lr"?
// "learning_rate" is the name in ...)`, or "" when `key` is no other tool's name.
std::string foreign_key_hint(std::string_view key);

}  // namespace ft::config

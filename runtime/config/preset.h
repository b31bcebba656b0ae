// Presets: resolving a shipped preset name or a user file (with "base" inheritance and --set
// overrides) into one validated JSON object holding every schema key, and the typed view the
// runtime reads. Shipped presets are compiled into the binary, so `ft` works from any directory.
// Pure functions; thread-safe.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ft::config {

struct ShippedPreset {
  std::string name;
  std::string json_text;
};
const std::vector<ShippedPreset>& shipped_presets();

// Resolves NAME (a shipped preset) or FILE (a path to a .json; may say "base": NAME|FILE), applies
// `sets` ("a.b=value", typed by the schema) and fills every other key with its default. Throws
// ConfigError naming the file or "--set" and the dotted key.
nlohmann::json resolve_preset(const std::string& name_or_file,
                              const std::vector<std::string>& sets);

// The settings the user wrote (in their own preset files, following "base" until a shipped preset,
// and in --set), as dotted key -> where ("--set" or the file): what a strategy checks for knobs
// that do not apply to it (shipped presets' own knobs are not the user's doing).
std::map<std::string, std::string> user_settings(const std::string& name_or_file,
                                                 const std::vector<std::string>& sets);

// Applies `--set key.path=value` overrides (typed by the schema) to a resolved preset.
void apply_sets(nlohmann::json& resolved, const std::vector<std::string>& sets);

// With --model, the model's shape comes from its config.json: a --set of a preset's shape key
// (model.hidden_size, model.num_layers, ...) would be ignored, so one that differs from config.json
// is refused (ConfigError naming the key); one equal to it is accepted. model.max_seq_len and model.require_dir still apply.
void refuse_shape_sets(const std::vector<std::string>& sets, const std::string& model_dir);

// One-line description of a shipped preset.
std::string preset_description(const std::string& name);

}  // namespace ft::config

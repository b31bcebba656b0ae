// The preset schema: every training setting declared once (dotted key, type, default, range or
// choices, help, and the field of Settings it fills). The table drives preset validation, `--set`
// parsing, the typed Settings, `ft presets show` and docs/presets.md. Pure data and functions;
// thread-safe.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/settings.h"

namespace ft::config {

// kObjectList: a list of objects whose keys are `fields` (data.sources).
enum class Kind { kInt, kFloat, kBool, kString, kChoice, kStringList, kObjectList };

// What another value of a key does to a run continued in the same --output (train/run_changes.h
// compares a command with the run a directory holds).
enum class OnResume {
  kComputes,  // changes what the run computes: refused unless --resume-changed
  kState,     // the saved state has another shape: refused (a new --output)
  kBatch,     // a factor of the global batch: free while micro_batch x grad_accum x ranks stays
  kFree,      // how or how long, not what: cadence, length, speed knobs; allowed and said
};

struct Setting {
  std::string key;  // dotted path, "train.micro_batch"
  Kind kind;
  nlohmann::json default_value;
  std::string help;
  double min = 0, max = 0;           // kInt / kFloat range, inclusive; unused when min > max
  std::vector<std::string> choices;  // kChoice (and allowed items of kStringList when non-empty)
  // Stores a validated value of this key into its field of Settings.
  std::function<void(Settings&, const nlohmann::json&)> bind;
  bool above_min = false;  // kFloat: the value must be > min, not >= min
  // kObjectList: the keys of each entry (their `bind` unused), and whether each must be given.
  std::vector<Setting> fields;
  bool required = false;
  OnResume on_resume = OnResume::kComputes;
};

const std::vector<Setting>& preset_schema();
const Setting* find_setting(const std::string& key);

// A JSON object holding every schema key at its default, nested by the dotted paths.
nlohmann::json schema_defaults();

// Validates a (nested) preset object: unknown keys (with "did you mean"), wrong types and values
// out of range or choices are ConfigErrors naming `where` (a file or "--set") and the dotted key.
void validate_preset(const nlohmann::json& preset, const std::string& where);

// Parses the text of `--set key=value` by the key's declared type.
nlohmann::json parse_setting_value(const Setting& s, const std::string& text,
                                   const std::string& where);

// "computes", "state", "batch" or "free" (docs/presets.md's column, the resume check's records).
const char* on_resume_name(OnResume r);

// Markdown reference of the schema (docs/presets.md).
std::string schema_markdown();

}  // namespace ft::config

#include "config/preset.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>

#include "config/schema.h"
#include "core/error.h"
#include "core/json.h"

namespace ft::config {

using nlohmann::json;

namespace detail {
extern const ShippedPreset kShippedPresets[];
extern const size_t kShippedPresetCount;
}  // namespace detail

const std::vector<ShippedPreset>& shipped_presets() {
  static const std::vector<ShippedPreset> all(
      detail::kShippedPresets, detail::kShippedPresets + detail::kShippedPresetCount);
  return all;
}

namespace {

// Objects merge key by key; anything else (lists included) is replaced.
void merge_into(json& dst, const json& src) {
  for (const auto& [k, v] : src.items()) {
    if (v.is_object() && dst.contains(k) && dst[k].is_object())
      merge_into(dst[k], v);
    else
      dst[k] = v;
  }
}

bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

json parse_text(const std::string& text, const std::string& where) {
  json j = parse_json<ConfigError>(text, where);
  FT_CHECK(j.is_object(), where, ": a preset must be a JSON object");
  return j;
}

// train.warmup_steps and train.warmup_ratio are one setting written two ways. A layer (a preset
// file, or all the --set given) that writes either states it whole: the other becomes 0 in
// `target`, whatever an earlier layer gave it. A layer that writes both non-zero is refused.
void take_warmup(const json& layer_train, json& target, const std::string& where) {
  const char* const keys[] = {"warmup_steps", "warmup_ratio"};
  auto nonzero = [&](const char* k) { return layer_train.contains(k) && layer_train[k] != 0; };
  FT_CHECK(!(nonzero(keys[0]) && nonzero(keys[1])), where, ": train.warmup_steps (",
           layer_train.value(keys[0], json()).dump(), ") and train.warmup_ratio (",
           layer_train.value(keys[1], json()).dump(),
           ") are both set, but warm-up is one or the other: keep one (or set the other to 0)");
  if (!layer_train.contains(keys[0]) && !layer_train.contains(keys[1])) return;
  for (const char* k : keys)
    if (!layer_train.contains(k))
      target["train"][k] = find_setting(std::string("train.") + k)->default_value;
}

// Loads one layer and, recursively, its bases; returns the merged object (without defaults).
json load_layer(const std::string& ref, const std::string& relative_to,
                std::vector<std::string>& chain) {
  std::string where, text;
  auto shipped = std::find_if(shipped_presets().begin(), shipped_presets().end(),
                              [&](const ShippedPreset& p) { return p.name == ref; });
  std::string path = ref;
  if (!relative_to.empty() && !ref.empty() && ref[0] != '/' && !is_file(ref)) {
    std::string dir = relative_to.substr(0, relative_to.rfind('/') + 1);
    if (is_file(dir + ref)) path = dir + ref;
  }
  if (is_file(path)) {
    std::ifstream in(path);
    text.assign(std::istreambuf_iterator<char>(in), {});
    where = path;
  } else if (shipped != shipped_presets().end()) {
    text = shipped->json_text;
    where = "preset " + ref;
  } else {
    std::vector<std::string> names;
    for (const auto& p : shipped_presets()) names.push_back(p.name);
    throw ConfigError(fmt::format("no preset named '{}' and no such file; shipped presets: {}",
                                  excerpt(ref), fmt::join(names, ", ")));
  }
  FT_CHECK(std::find(chain.begin(), chain.end(), where) == chain.end(),
           "preset base cycle: ", fmt::format("{}", fmt::join(chain, " -> ")), " -> ", where);
  chain.push_back(where);
  json layer = parse_text(text, where);
  validate_preset(layer, where);
  json merged = json::object();
  if (layer.contains("base")) {
    FT_CHECK(layer["base"].is_string(), where, ": \"base\" must be a preset name or file");
    merged = load_layer(layer["base"].get<std::string>(), is_file(path) ? path : "", chain);
  }
  layer.erase("base");
  if (layer.contains("train")) take_warmup(layer["train"], merged, where);
  merge_into(merged, layer);
  return merged;
}

void flatten_keys(const json& j, const std::string& prefix, const std::string& where,
                  std::map<std::string, std::string>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (prefix.empty() && (it.key() == "base" || it.key() == "name" || it.key() == "description"))
      continue;
    if (it->is_object())
      flatten_keys(*it, key, where, out);
    else
      out.emplace(key, where);
  }
}

}  // namespace

std::map<std::string, std::string> user_settings(const std::string& name_or_file,
                                                 const std::vector<std::string>& sets) {
  std::map<std::string, std::string> out;
  for (const auto& set : sets) out[set.substr(0, set.find('='))] = "--set";
  std::string ref = name_or_file, relative_to;
  for (int depth = 0; depth < 64 && is_file(ref); ++depth) {
    std::ifstream in(ref);
    std::string text(std::istreambuf_iterator<char>(in), {});
    json layer = parse_text(text, ref);
    flatten_keys(layer, "", ref, out);  // nearer layers were added first and win
    if (!layer.contains("base") || !layer["base"].is_string()) break;
    std::string base = layer["base"].get<std::string>();
    std::string dir = ref.substr(0, ref.rfind('/') + 1);
    ref = base[0] != '/' && !is_file(base) && is_file(dir + base) ? dir + base : base;
  }
  return out;
}

namespace {

// The value config.json gives the shape key `hf_key` (rope_theta may sit in rope_parameters, and
// num_key_value_heads defaults to num_attention_heads), or null when it gives none.
json config_shape_value(const json& config, const std::string& hf_key) {
  if (config.contains(hf_key)) return config[hf_key];
  if (hf_key == "rope_theta" && config.contains("rope_parameters") &&
      config["rope_parameters"].is_object() && config["rope_parameters"].contains("rope_theta"))
    return config["rope_parameters"]["rope_theta"];
  if (hf_key == "num_key_value_heads" && config.contains("num_attention_heads"))
    return config["num_attention_heads"];
  return nullptr;
}

// Whether the --set text `value` says what config.json's `given` does (1 and 1.0, true and true).
bool same_shape_value(const std::string& value, const json& given) {
  if (given.is_null()) return false;
  json v;
  try {
    v = json::parse(value);
  } catch (const json::exception&) {
    return false;
  }
  if (v.is_number() && given.is_number()) return v.get<double>() == given.get<double>();
  return v == given;
}

}  // namespace

void refuse_shape_sets(const std::vector<std::string>& sets, const std::string& model_dir) {
  // ft's shape key and the config.json key that gives it.
  static const std::pair<const char*, const char*> kShape[] = {
      {"model.vocab_size", "vocab_size"},
      {"model.hidden_size", "hidden_size"},
      {"model.intermediate_size", "intermediate_size"},
      {"model.num_layers", "num_hidden_layers"},
      {"model.num_heads", "num_attention_heads"},
      {"model.num_kv_heads", "num_key_value_heads"},
      {"model.rope_theta", "rope_theta"},
      {"model.tie_embeddings", "tie_word_embeddings"}};
  json config;  // read on the first shape key; a file that cannot be read leaves it null
  bool read = false;
  for (const std::string& set : sets) {
    const size_t eq = set.find('=');
    const std::string key = set.substr(0, eq);
    for (const auto& [shape, hf_key] : kShape) {
      if (key != shape) continue;
      if (!read) {
        read = true;
        try {
          config = parse_json<ConfigError>(read_text_file<ConfigError>(model_dir + "/config.json"),
                                           model_dir + "/config.json");
        } catch (const ConfigError&) {
          config = nullptr;  // the model loader names that file's fault itself
        }
      }
      // A value equal to the model's own says nothing new: a command line kept from a run
      // without --model stays valid.
      if (config.is_object() && eq != std::string::npos &&
          same_shape_value(set.substr(eq + 1), config_shape_value(config, hf_key)))
        continue;
      throw ConfigError(fmt::format(
          "--set {}: the model's shape comes from --model {}/config.json, which this key would "
          "not change; drop it (or edit that file)",
          key, model_dir));
    }
  }
}

void apply_sets(json& resolved, const std::vector<std::string>& sets) {
  json warmup = json::object();  // the warm-up the --set give, as a layer's train section
  for (const auto& set : sets) {
    size_t eq = set.find('=');
    FT_CHECK(eq != std::string::npos && eq > 0, "--set expects key.path=value, got '", excerpt(set),
             "'");
    std::string key = set.substr(0, eq);
    const Setting* s = find_setting(key);
    if (!s) {
      // Let the validator phrase the error (with its suggestion). The probe nests objects by
      // hand: a JSON pointer would read "~" as an escape and a number as an array index (so
      // "x.99999999999" asked for an array that long).
      json probe = json::object();
      json* at = &probe;
      for (size_t start = 0, dot;; start = dot + 1) {
        dot = key.find('.', start);
        at = &(*at)[key.substr(start, dot == std::string::npos ? dot : dot - start)];
        if (dot == std::string::npos) break;
      }
      *at = 0;
      validate_preset(probe, "--set");
      throw ConfigError(fmt::format("--set: \"{}\" is a section, not a setting", excerpt(key)));
    }
    std::string pointer = "/" + key;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    resolved[json::json_pointer(pointer)] = parse_setting_value(*s, set.substr(eq + 1), "--set");
    if (key == "train.warmup_steps" || key == "train.warmup_ratio")
      warmup[key.substr(6)] = resolved[json::json_pointer(pointer)];
  }
  take_warmup(warmup, resolved, "--set");
}

json resolve_preset(const std::string& name_or_file, const std::vector<std::string>& sets) {
  std::vector<std::string> chain;
  json resolved = schema_defaults();
  json layers = load_layer(name_or_file, "", chain);
  merge_into(resolved, layers);
  resolved["name"] = layers.value("name", name_or_file);
  apply_sets(resolved, sets);
  validate_preset(resolved, "resolved preset");
  return resolved;
}

std::string preset_description(const std::string& name) {
  for (const auto& p : shipped_presets()) {
    if (p.name != name) continue;
    json j = json::parse(p.json_text, nullptr, /*allow_exceptions=*/false);
    return j.is_object() ? j.value("description", "") : "";
  }
  return "";
}

}  // namespace ft::config

#include "config/schema.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "config/foreign_keys.h"
#include "core/error.h"
#include "core/json.h"
#include "core/strings.h"

namespace ft::config {

using nlohmann::json;

namespace {
constexpr double kNoRange = 1, kNoRangeMax = 0;  // min > max: no range check
const double kInf = std::numeric_limits<double>::infinity();
// Upper bounds of the integer keys that count steps or events (10^12: far beyond any run, and
// products with other settings stay inside int64) and of the seed (any non-negative int64).
const double kMaxCount = 1e12;
const double kMaxSeed = 9223372036854775807.0;

// The field of Settings a row fills: FIELD(data.chat_template) for the key data.template.
template <class T>
using Field = T& (*)(Settings&);
#define FIELD(path) \
  [](Settings & s) -> auto& { return s.path; }
// A row whose key is its field's path: KEY(train.micro_batch).
#define KEY(path) #path, FIELD(path)

template <class T>
std::function<void(Settings&, const json&)> binder(Field<T> field) {
  return [field](Settings& s, const json& v) { field(s) = v.get<T>(); };
}

// A row; above_min, fields and required keep their defaults.
Setting row(std::string key, Kind kind, json def, std::string help, double lo, double hi,
            std::vector<std::string> choices, std::function<void(Settings&, const json&)> bind) {
  Setting s;
  s.key = std::move(key);
  s.kind = kind;
  s.default_value = std::move(def);
  s.help = std::move(help);
  s.min = lo;
  s.max = hi;
  s.choices = std::move(choices);
  s.bind = std::move(bind);
  return s;
}

Setting I(std::string key, Field<int64_t> f, int64_t def, double lo, double hi, std::string help) {
  return row(std::move(key), Kind::kInt, def, std::move(help), lo, hi, {}, binder(f));
}
Setting F(std::string key, Field<double> f, double def, double lo, double hi, std::string help) {
  return row(std::move(key), Kind::kFloat, def, std::move(help), lo, hi, {}, binder(f));
}
Setting B(std::string key, Field<bool> f, bool def, std::string help) {
  return row(std::move(key), Kind::kBool, def, std::move(help), kNoRange, kNoRangeMax, {},
             binder(f));
}
Setting S(std::string key, Field<std::string> f, std::string def, std::string help) {
  return row(std::move(key), Kind::kString, def, std::move(help), kNoRange, kNoRangeMax, {},
             binder(f));
}
Setting C(std::string key, Field<std::string> f, std::string def, std::vector<std::string> choices,
          std::string help) {
  return row(std::move(key), Kind::kChoice, def, std::move(help), kNoRange, kNoRangeMax,
             std::move(choices), binder(f));
}
Setting L(std::string key, Field<std::vector<std::string>> f, std::vector<std::string> def,
          std::vector<std::string> allowed, std::string help) {
  return row(std::move(key), Kind::kStringList, def, std::move(help), kNoRange, kNoRangeMax,
             std::move(allowed), binder(f));
}

// A key of each entry of a list of objects (its `bind` unused: the list's binder reads entries).
Setting field(std::string key, Kind kind, json def, std::string help, double lo = kNoRange,
              double hi = kNoRangeMax, std::vector<std::string> choices = {}) {
  return row(std::move(key), kind, std::move(def), std::move(help), lo, hi, std::move(choices), {});
}

// A data.sources entry's "columns", "tags" and "tools" (validated) into `shape`: only the keys
// given, so the others stay data.columns.* / data.tags.* / data.tools.
void bind_source_shape(const json& entry, config::RecordShapeOverrides& shape) {
  auto text = [](const json& obj, const char* key, std::optional<std::string>& to) {
    if (obj.is_object() && obj.contains(key)) to = obj[key].get<std::string>();
  };
  auto list = [](const json& obj, const char* key, std::optional<std::vector<std::string>>& to) {
    if (obj.is_object() && obj.contains(key)) to = obj[key].get<std::vector<std::string>>();
  };
  const json none = json::object();
  const json& columns = entry.contains("columns") ? entry["columns"] : none;
  const json& tags = entry.contains("tags") ? entry["tags"] : none;
  text(columns, "messages", shape.messages);
  text(columns, "system", shape.system);
  text(columns, "tools", shape.tools);
  text(tags, "role", shape.role);
  text(tags, "content", shape.content);
  list(tags, "user", shape.user);
  list(tags, "assistant", shape.assistant);
  list(tags, "system", shape.system_tag);
  list(tags, "function_call", shape.function_call);
  list(tags, "observation", shape.observation);
  text(entry, "tools", shape.tools_file);
}

// data.sources: each entry's keys, and the binder that turns the validated list into
// Settings::data.sources.
Setting data_sources_row() {
  Setting path = field("path", Kind::kString, "",
                       "the JSONL file, relative to the working directory as --data is");
  path.required = true;
  Setting weight =
      field("weight", Kind::kFloat, 1.0,
            "the source's share of the records drawn is its weight over the sum of the "
            "weights",
            0, kInf);
  weight.above_min = true;
  std::vector<Setting> fields = {
      path,
      field("name", Kind::kString, "",
            "its name in metrics.jsonl's source_tokens and the report (\"\": the file name)"),
      field("format", Kind::kChoice, "", "as data.format (\"\": data.format's)", kNoRange,
            kNoRangeMax, {"auto", "text", "alpaca", "chat", "sharegpt", "tokenized"}),
      field("template", Kind::kChoice, "", "as data.template (\"\": data.template's)", kNoRange,
            kNoRangeMax, {"auto", "llama3", "llama2", "chatml", "mistral", "none"}),
      weight,
      field("max_records", Kind::kInt, 0, "only the file's first max_records records (0: all)", 0,
            kMaxCount),
      field("columns.messages", Kind::kString, "", "as data.columns.messages, for this source"),
      field("columns.system", Kind::kString, "", "as data.columns.system, for this source"),
      field("columns.tools", Kind::kString, "", "as data.columns.tools, for this source"),
      field("tags.role", Kind::kString, "", "as data.tags.role, for this source"),
      field("tags.content", Kind::kString, "", "as data.tags.content, for this source"),
      field("tags.user", Kind::kStringList, json::array(), "as data.tags.user, for this source"),
      field("tags.assistant", Kind::kStringList, json::array(),
            "as data.tags.assistant, for this source"),
      field("tags.system", Kind::kStringList, json::array(),
            "as data.tags.system, for this source"),
      field("tags.function_call", Kind::kStringList, json::array(),
            "as data.tags.function_call, for this source"),
      field("tags.observation", Kind::kStringList, json::array(),
            "as data.tags.observation, for this source"),
      field("tools", Kind::kString, "", "as data.tools, for this source"),
  };
  auto bind = [](Settings& s, const json& v) {
    s.data.sources.clear();
    for (const json& e : v) {
      config::DataSourceSettings d;
      d.path = e.at("path").get<std::string>();
      d.name = e.value("name", std::string());
      d.format = e.value("format", std::string());
      d.chat_template = e.value("template", std::string());
      d.weight = e.value("weight", 1.0);
      d.max_records = e.value("max_records", int64_t{0});
      bind_source_shape(e, d.shape);
      s.data.sources.push_back(std::move(d));
    }
  };
  Setting list = row("data.sources", Kind::kObjectList, json::array(),
                     "A weighted mixture of data files, each {\"path\", \"weight\", \"name\", "
                     "\"format\", \"template\", \"max_records\", \"columns\", \"tags\", "
                     "\"tools\"} (the rows data.sources[].KEY "
                     "below): records are drawn from the sources by weight, reproducibly from "
                     "train.seed (docs/training.md \"Mixtures of several files\"). The same as "
                     "--data PATH:WEIGHT given once per source; give one or the other. []: "
                     "--data.",
                     kNoRange, kNoRangeMax, {}, bind);
  list.fields = std::move(fields);
  return list;
}

const std::vector<std::string> kProjections = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                               "gate_proj", "up_proj", "down_proj"};
// Phi-3's fused projections too (model/lora.h: fit_lora_targets maps the default per family).
const std::vector<std::string> kAdaptable = {"q_proj",   "k_proj",       "v_proj",
                                             "qkv_proj", "o_proj",       "gate_proj",
                                             "up_proj",  "gate_up_proj", "down_proj"};

std::string kind_name(const Setting& s) {
  switch (s.kind) {
    case Kind::kInt:
      return "integer";
    case Kind::kFloat:
      return "number";
    case Kind::kBool:
      return "boolean";
    case Kind::kString:
      return "string";
    case Kind::kChoice:
      return "one of " + fmt::format("{}", fmt::join(s.choices, "|"));
    case Kind::kStringList:
      return "list of strings";
    case Kind::kObjectList:
      return "list of objects";
  }
  return "?";
}

// The suggestion for an unknown key: ft's name for another tool's key (foreign_keys.h), else the
// nearest schema key by edit distance.
std::string did_you_mean(const std::string& key) {
  if (std::string hint = foreign_key_hint(key); !hint.empty()) return hint;
  std::string best;
  size_t best_d = std::max<size_t>(3, key.size() / 4);
  const std::string key_leaf = key.substr(key.rfind('.') + 1);
  for (const auto& s : preset_schema()) {
    // A right leaf under the wrong section ("lr" vs "train.lr") is a good guess too.
    const std::string leaf = s.key.substr(s.key.rfind('.') + 1);
    size_t d = leaf == key_leaf ? 1 : best_d;
    // The distance is at least the difference in length: a key far longer than any setting (a
    // 10 MB one) is not compared letter by letter.
    const size_t longer = std::max(key.size(), s.key.size()) - std::min(key.size(), s.key.size());
    if (longer < best_d) d = std::min(d, edit_distance(key, s.key));
    if (d < best_d) {
      best_d = d;
      best = s.key;
    }
  }
  return best.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", best);
}

void check_entry(const Setting& list, const json& entry, size_t i, const std::string& where);

void check_value(const Setting& s, const json& v, const std::string& where) {
  const std::string got = excerpt_json(v);
  auto fail = [&](const std::string& what) {
    throw ConfigError(fmt::format("{}: \"{}\" must be {}, got {}", where, s.key, what, got));
  };
  switch (s.kind) {
    case Kind::kInt:
      if (!v.is_number_integer()) fail("an integer");
      break;
    case Kind::kFloat:
      if (!v.is_number()) fail("a number");
      break;
    case Kind::kBool:
      if (!v.is_boolean()) fail("true or false");
      break;
    case Kind::kString:
      if (!v.is_string()) fail("a string");
      break;
    case Kind::kChoice:
      if (!v.is_string() ||
          std::find(s.choices.begin(), s.choices.end(), v.get<std::string>()) == s.choices.end())
        fail(kind_name(s));
      break;
    case Kind::kStringList:
      if (!v.is_array()) fail("a list of strings");
      for (const auto& item : v) {
        if (!item.is_string()) fail("a list of strings");
        if (!s.choices.empty() && std::find(s.choices.begin(), s.choices.end(),
                                            item.get<std::string>()) == s.choices.end())
          fail(fmt::format("a list drawn from {}", fmt::join(s.choices, ", ")));
      }
      break;
    case Kind::kObjectList:
      if (!v.is_array()) fail("a list of objects");
      for (size_t i = 0; i < v.size(); ++i) check_entry(s, v[i], i, where);
      break;
  }
  auto range = [&] {
    return s.max == kInf || s.max >= kMaxSeed
               ? fmt::format("an integer in [{:.0f}, {}]", s.min, INT64_MAX)
               : fmt::format("in [{:.0f}, {:.0f}]", s.min, s.max);
  };
  if (s.kind == Kind::kInt) {
    // In integers: a value past INT64_MAX parses as unsigned and would wrap to a negative one.
    if (v.is_number_unsigned() &&
        v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(range());
    const int64_t x = v.get<int64_t>();
    const bool above = s.max<kMaxSeed&& static_cast<double>(x)> s.max;
    if (static_cast<double>(x) < s.min || above) fail(range());
  } else if (s.kind == Kind::kFloat && s.min <= s.max) {
    const double x = v.get<double>();
    if (!std::isfinite(x)) fail("a finite number");
    if (s.above_min && !(x > s.min)) fail(fmt::format("> {}", s.min));
    if (!(x >= s.min && x <= s.max))
      fail(s.max == kInf ? fmt::format(">= {}", s.min) : fmt::format("in [{}, {}]", s.min, s.max));
  }
}

// Entry i of a list of objects: every key one of the list's fields (an unknown one named with
// the nearest field), each value checked as its field's, the required ones present.
// An entry's keys with the objects of its dotted fields opened ({"columns": {"system": "s"}} is
// "columns.system"); `at` names the entry in errors.
std::vector<std::pair<std::string, json>> entry_items(const Setting& list, const json& entry,
                                                      const std::string& at,
                                                      const std::string& where) {
  std::vector<std::pair<std::string, json>> out;
  for (const auto& [k, v] : entry.items()) {
    std::vector<std::string> inner;
    for (const Setting& f : list.fields)
      if (f.key.rfind(k + ".", 0) == 0) inner.push_back(f.key.substr(k.size() + 1));
    if (inner.empty()) {
      out.emplace_back(k, v);
      continue;
    }
    if (!v.is_object())
      throw ConfigError(fmt::format("{}: \"{}.{}\" must be an object with the keys {}, got {}",
                                    where, at, k, fmt::join(inner, ", "), excerpt_json(v)));
    for (const auto& [sub, x] : v.items()) out.emplace_back(k + "." + sub, x);
  }
  return out;
}

void check_entry(const Setting& list, const json& entry, size_t i, const std::string& where) {
  const std::string at = fmt::format("{}[{}]", list.key, i);
  std::vector<std::string> keys;
  for (const Setting& f : list.fields) keys.push_back(f.key);
  if (!entry.is_object())
    throw ConfigError(fmt::format("{}: \"{}\" must be an object with the keys {}, got {}", where,
                                  at, fmt::join(keys, ", "), excerpt_json(entry)));
  for (const auto& item : entry_items(list, entry, at, where)) {
    const std::string& k = item.first;  // a name, not a binding: lambdas capture it (C++17)
    const json& v = item.second;
    const auto f = std::find_if(list.fields.begin(), list.fields.end(),
                                [&](const Setting& x) { return x.key == k; });
    if (f == list.fields.end()) {
      std::string near;
      for (const std::string& key : keys)
        if (k.size() < key.size() + 4 &&
            edit_distance(k, key) <= std::max<size_t>(2, key.size() / 3))
          near = fmt::format(" (did you mean \"{}\"?)", key);
      throw ConfigError(fmt::format("{}: unknown key \"{}.{}\"{}; an entry of {} has the keys {}",
                                    where, at, excerpt(k), near, list.key, fmt::join(keys, ", ")));
    }
    Setting named = *f;
    named.key = at + "." + f->key;
    check_value(named, v, where);
  }
  for (const Setting& f : list.fields)
    if (f.required && !entry.contains(f.key))
      throw ConfigError(fmt::format("{}: \"{}\" has no \"{}\", which every entry needs ({})", where,
                                    at, f.key, f.help));
}

void walk(const json& node, const std::string& prefix, const std::string& where) {
  FT_CHECK(node.is_object(), where, ": \"", prefix, "\" must be an object");
  for (const auto& [k, v] : node.items()) {
    std::string key = prefix.empty() ? k : prefix + "." + k;
    if (prefix.empty() && (k == "name" || k == "description"))
      FT_CHECK(v.is_string(), where, ": \"", k, "\" must be a string, got ", excerpt_json(v));
    if (prefix.empty() && (k == "base" || k == "name" || k == "description")) continue;
    if (const Setting* s = find_setting(key)) {
      check_value(*s, v, where);
      continue;
    }
    // A section: some setting lives below it.
    bool is_section = false;
    const std::string section = key + ".";
    for (const auto& s : preset_schema())
      if (s.key.rfind(section, 0) == 0) is_section = true;
    if (is_section && v.is_object()) {
      walk(v, key, where);
      continue;
    }
    if (is_section)
      throw ConfigError(
          fmt::format("{}: \"{}\" is a section: set its keys (see `ft presets show`)", where, key));
    throw ConfigError(
        fmt::format("{}: unknown key \"{}\"{}", where, excerpt(key), did_you_mean(key)));
  }
}

// What another value of each key does to a run continued in the same --output (OnResume). Keys
// not named here change what the run computes (the data, the batch's rows, the optimizer and its
// schedule, the precision, LoRA's scaling, the strategy's numerics). The model's shape keys are
// the shape only without --model (train/run_changes.cpp then compares config.json instead).
const std::map<std::string, OnResume>& resume_effects() {
  static const std::map<std::string, OnResume> effects = {
      {"model.vocab_size", OnResume::kState},
      {"model.hidden_size", OnResume::kState},
      {"model.intermediate_size", OnResume::kState},
      {"model.num_layers", OnResume::kState},
      {"model.num_heads", OnResume::kState},
      {"model.num_kv_heads", OnResume::kState},
      {"model.tie_embeddings", OnResume::kState},
      {"model.require_dir", OnResume::kFree},
      {"lora.enabled", OnResume::kState},
      {"lora.r", OnResume::kState},
      {"lora.target_modules", OnResume::kState},
      {"lora.target_parameters", OnResume::kState},
      {"lora.train_router", OnResume::kState},
      {"train.micro_batch", OnResume::kBatch},
      {"train.grad_accum", OnResume::kBatch},
      // The run's length: a longer run continues, a shorter one is finished sooner.
      {"train.max_steps", OnResume::kFree},
      {"train.epochs", OnResume::kFree},
      {"train.log_every", OnResume::kFree},
      // Memory and speed: the same products, recomputed or fused.
      {"train.activation_checkpointing", OnResume::kFree},
      {"train.checkpoint_every_n_layers", OnResume::kFree},
      {"train.fused_loss", OnResume::kFree},
      {"train.fused_rms_norm", OnResume::kFree},
      {"train.fused_swiglu", OnResume::kFree},
      {"train.fused_rope", OnResume::kFree},
      {"train.fused_attention", OnResume::kFree},
      {"moe.grouped_mm", OnResume::kFree},
      {"moe.collapse_steps", OnResume::kFree},
      {"hardware.device", OnResume::kFree},
      {"hardware.preflight", OnResume::kFree},
      // Where the state lives and when it moves; checkpoints reshard between layouts.
      {"strategy.kind", OnResume::kFree},
      {"strategy.expert_parallel", OnResume::kFree},
      {"strategy.overlap_host_step", OnResume::kFree},
      {"strategy.overlap_comm", OnResume::kFree},
      {"strategy.ddp.bucket_mb", OnResume::kFree},
      {"strategy.zero3.prefetch_bucket_size", OnResume::kFree},
      {"strategy.zero3.param_persistence_threshold", OnResume::kFree},
      {"strategy.zero3.reduce_bucket_size", OnResume::kFree},
      {"strategy.zero3.offload_optimizer", OnResume::kFree},
      {"strategy.zero3.offload_param", OnResume::kFree},
      {"strategy.fsdp.forward_prefetch", OnResume::kFree},
      {"strategy.fsdp.backward_prefetch", OnResume::kFree},
      {"strategy.fsdp.cpu_offload", OnResume::kFree},
      {"output.save_every", OnResume::kFree},
      {"output.save_every_minutes", OnResume::kFree},
      {"output.keep_last", OnResume::kFree},
      {"output.async_save", OnResume::kFree},
      {"output.on_save_error", OnResume::kFree},
      {"output.profile_steps", OnResume::kFree},
      {"output.tensorboard", OnResume::kFree},
      // Evaluation reads the model; it does not change it (eval.split does: it holds records out).
      {"eval.long_records", OnResume::kFree},
      {"eval.batch_tokens", OnResume::kFree},
      {"eval.data", OnResume::kFree},
      {"eval.every", OnResume::kFree},
      {"eval.fused_kernels", OnResume::kFree},
  };
  return effects;
}

std::vector<Setting> with_resume_effects(std::vector<Setting> rows) {
  for (Setting& s : rows)
    if (auto it = resume_effects().find(s.key); it != resume_effects().end())
      s.on_resume = it->second;
  return rows;
}

}  // namespace

const char* on_resume_name(OnResume r) {
  switch (r) {
    case OnResume::kComputes:
      return "computes";
    case OnResume::kState:
      return "state";
    case OnResume::kBatch:
      return "batch";
    case OnResume::kFree:
      return "free";
  }
  return "?";
}

const std::vector<Setting>& preset_schema() {
  // clang-format off
  static const std::vector<Setting> schema = with_resume_effects({
    // model: the shape used when no --model directory is given (random init, for demos/benchmarks)
    I(KEY(model.vocab_size), 32000, 1, 16777216, "Vocabulary size of a randomly initialised model."),
    I(KEY(model.hidden_size), 4096, 1, 1048576, "Hidden size."),
    I(KEY(model.intermediate_size), 11008, 1, 4194304, "MLP inner size."),
    I(KEY(model.num_layers), 32, 1, 4096, "Transformer blocks."),
    I(KEY(model.num_heads), 32, 1, 4096, "Attention heads."),
    I(KEY(model.num_kv_heads), 32, 1, 4096, "Key/value heads (GQA when fewer than num_heads)."),
    F(KEY(model.rope_theta), 10000.0, 1, kInf, "Rotary base."),
    B(KEY(model.tie_embeddings), false, "Share the embedding and the LM head."),
    I(KEY(model.max_seq_len), 4096, 1, 16777216, "Longest sequence the model is used with."),
    B(KEY(model.require_dir), false,
      "The model is the user's own: its shape comes only from --model DIR (config.json), and "
      "ft train, launch, plan and doctor refuse to start without one (the model.* keys above are "
      "then unused). Set by the lora and full presets."),
    // data
    C(KEY(data.format), "auto", {"auto", "text", "alpaca", "chat", "sharegpt", "tokenized", "synthetic"},
      "Record format of the JSONL data; auto detects it from the first record (\"messages\": chat, \"conversations\": sharegpt, \"instruction\": alpaca, \"text\", \"input_ids\": tokenized)."),
    S("data.columns.messages", FIELD(data.shape.messages), "",
      "The key of a conversation record's turns (LLaMA-Factory's columns.messages); \"\": messages for chat, conversations for sharegpt."),
    S("data.columns.system", FIELD(data.shape.system), "system",
      "The key of a sharegpt record's system prompt (LLaMA-Factory's columns.system); used when the first turn is not a system turn."),
    S("data.columns.tools", FIELD(data.shape.tools), "tools",
      "The key of a record's tool list given to the chat template as apply_chat_template(tools=...): a list of tool schemas, or a JSON string of one (LLaMA-Factory's columns.tools)."),
    S("data.tags.role", FIELD(data.shape.role), "from", "sharegpt: the key of a turn's speaker (LLaMA-Factory's role_tag)."),
    S("data.tags.content", FIELD(data.shape.content), "value", "sharegpt: the key of a turn's text (LLaMA-Factory's content_tag)."),
    L("data.tags.user", FIELD(data.shape.user), {"human", "user"}, {}, "sharegpt: speaker names of user turns (LLaMA-Factory's user_tag)."),
    L("data.tags.assistant", FIELD(data.shape.assistant), {"gpt", "assistant"}, {}, "sharegpt: speaker names of assistant turns, trained (assistant_tag)."),
    L("data.tags.system", FIELD(data.shape.system_tag), {"system"}, {}, "sharegpt: speaker names of a first system turn (system_tag)."),
    L("data.tags.function_call", FIELD(data.shape.function_call), {"function_call"}, {},
      "sharegpt: speaker names of tool-call turns (function_tag), whose value is a JSON tool call {\"name\", \"arguments\"} or a list of them; trained as assistant tool calls."),
    L("data.tags.observation", FIELD(data.shape.observation), {"observation"}, {},
      "sharegpt: speaker names of tool-result turns (observation_tag), rendered as tool turns; not trained."),
    S("data.tools", FIELD(data.shape.tools_file), "",
      "A JSON file holding a list of tools (function schemas) given to the chat template for every conversation record without its own tools (\"\": none)."),
    C("data.template", FIELD(data.chat_template), "auto", {"auto", "llama3", "llama2", "chatml", "mistral", "none"},
      "Chat/instruction template used to render alpaca, chat and sharegpt records; auto: the model's own (tokenizer_config.json chat_template or chat_template.jinja), else the built-in of the tokenizer's family."),
    I(KEY(data.seq_len), 2048, 8, 16777216, "Tokens per training sequence."),
    B(KEY(data.pack), true, "Pack several records into one sequence (attention stays within each record)."),
    B(KEY(data.train_on_prompt), false, "Also train on prompt tokens (by default only responses count)."),
    C(KEY(data.on_bad_record), "error", {"error", "skip"},
      "A malformed JSONL line stops the run (error) or is skipped and counted (skip)."),
    data_sources_row(),
    // train
    I(KEY(train.micro_batch), 1, 1, 1048576, "Sequences per micro-batch on each rank."),
    I(KEY(train.grad_accum), 1, 1, 1048576, "Micro-batches per optimizer step."),
    I(KEY(train.max_steps), 0, 0, kMaxCount, "Optimizer steps; 0 = run for train.epochs."),
    F(KEY(train.epochs), 1.0, 0, kInf, "Passes over the data when max_steps is 0."),
    F(KEY(train.lr), 2e-5, 0, kInf, "Peak learning rate."),
    F(KEY(train.min_lr_ratio), 0.1, 0, 1, "Final learning rate as a fraction of the peak."),
    I(KEY(train.warmup_steps), 0, 0, kMaxCount,
      "Linear warmup steps (0: train.warmup_ratio decides). With warmup_ratio, one setting "
      "written two ways: a preset file (or the --set list) that sets one resets the other to 0; "
      "one that sets both non-zero is refused."),
    F(KEY(train.warmup_ratio), 0.0, 0, 1,
      "Linear warmup as a fraction of the run's optimizer steps, rounded up (HF's warmup_ratio); "
      "used when train.warmup_steps is 0."),
    C(KEY(train.schedule), "cosine", {"cosine", "linear", "constant"}, "Decay after warmup."),
    F(KEY(train.weight_decay), 0.0, 0, kInf, "AdamW decoupled weight decay (never on norms and biases)."),
    F(KEY(train.beta1), 0.9, 0, 0.999999, "AdamW beta1."),
    F(KEY(train.beta2), 0.999, 0, 0.99999999, "AdamW beta2."),
    F(KEY(train.eps), 1e-8, 0, 1, "AdamW epsilon."),
    F(KEY(train.grad_clip), 1.0, 0, kInf, "Global gradient-norm clip; 0 disables."),
    I(KEY(train.seed), 42, 0, kMaxSeed, "Seed for initialisation, data order, dropout."),
    I(KEY(train.log_every), 1, 1, kMaxCount, "Optimizer steps between log lines."),
    C(KEY(train.activation_checkpointing), "none", {"none", "full", "every_n"},
      "Recompute layer activations in backward instead of keeping them: none; full (every "
      "layer); every_n (layers whose index % checkpoint_every_n_layers == 0). Same gradients, "
      "less memory, one more forward of those layers per step."),
    I(KEY(train.checkpoint_every_n_layers), 2, 1, 4096,
      "n for activation_checkpointing = every_n: layers 0, n, 2n, ... are checkpointed."),
    B(KEY(train.fused_loss), true,
      "Compute the LM head and the cross-entropy chunk by chunk of tokens, never holding the "
      "whole step's logits (tokens x vocabulary); false: the unfused path. Same loss and "
      "gradients within rounding."),
    B(KEY(train.fused_rms_norm), true,
      "RMSNorm (and the residual add before the second norm of a layer) as one fused kernel "
      "(CPU and CUDA) with its own backward; false: transformers' op sequence. Same values within "
      "rounding."),
    B(KEY(train.fused_swiglu), true,
      "silu(gate) * up as one fused kernel (CPU and CUDA) with its own backward (keeps two tensors for "
      "backward instead of three); false: the unfused ops."),
    B(KEY(train.fused_rope), true,
      "The rotary embedding of queries and keys as one fused kernel (CPU and CUDA) with its "
      "own backward; false: transformers' x * cos + rotate_half(x) * sin."),
    B(KEY(train.fused_attention), true,
      "fp32 attention on the CPU by ft's blocked kernel (products of 64-query blocks against the "
      "keys they see, the causal triangle skipped; faster than LibTorch's CPU flash kernel at "
      "training shapes); false: at::scaled_dot_product_attention, as transformers' sdpa. Same "
      "values within rounding. GPUs always use scaled_dot_product_attention."),
    // moe
    C(KEY(moe.aux_loss), "auto", {"auto", "on", "off"},
      "Mixture-of-experts models: add the router's load-balancing loss (transformers' "
      "load_balancing_loss_func over all MoE layers, E x sum_e f_e P_e) times moe.aux_loss_coef "
      "to the step's objective; auto: as the model's config.json says (output_router_logits)."),
    F(KEY(moe.aux_loss_coef), -1.0, -1, kInf,
      "The load-balancing loss's weight; -1: the model's router_aux_loss_coef (0.001 unless its "
      "config.json says otherwise)."),
    C(KEY(moe.aux_loss_scope), "micro_batch", {"micro_batch", "global"},
      "What f_e (each expert's share of the picks) is counted over: each rank's micro-batch "
      "(transformers), or the micro-batch of every data-parallel rank together (global-batch "
      "balancing, as Qwen trained; one all-reduce of E + 1 numbers per micro-batch)."),
    I(KEY(moe.collapse_steps), 100, 1, kMaxCount,
      "An expert of a MoE layer that receives no token for this many optimizer steps in a row "
      "is named in a warning (once per run): its router has collapsed."),
    C(KEY(moe.grouped_mm), "auto", {"auto", "on", "off"},
      "The experts' products as LibTorch's grouped GEMM (at::_grouped_mm: one call per weight for "
      "all of a layer's experts) instead of one product per expert. auto: on a CUDA GPU in bf16 "
      "when hidden_size and moe_intermediate_size are multiples of 8; on: wherever LibTorch has "
      "it (CPU and CUDA, fp32, bf16 or fp16), an error where the sizes do not fit; off: one "
      "product per expert (on the CPU ft's expert node, the faster there)."),
    // precision
    C(KEY(precision.mode), "bf16", {"fp32", "bf16", "fp16", "fp64"},
      "Compute dtype; bf16/fp16 keep fp32 master weights and optimizer state; fp64 is for exact numerical checks."),
    F(KEY(precision.loss_scale_init), 65536.0, 1, kInf, "fp16: initial dynamic loss scale."),
    I(KEY(precision.loss_scale_window), 1000, 1, kMaxCount, "fp16: overflow-free steps before the scale doubles."),
    // lora
    B(KEY(lora.enabled), false, "Train LoRA adapters on a frozen base instead of every weight."),
    I(KEY(lora.r), 16, 1, 4096, "Adapter rank."),
    F(KEY(lora.alpha), 32.0, 1e-6, kInf, "Adapter scale numerator (alpha/r, or alpha/sqrt(r) with rslora)."),
    F(KEY(lora.dropout), 0.05, 0, 0.99, "Dropout on the adapter input."),
    L(KEY(lora.target_modules), kProjections, kAdaptable, "Projections that get adapters (PEFT names). The default, all seven, means every projection the model has: Phi-3's qkv_proj o_proj gate_up_proj down_proj."),
    L(KEY(lora.target_parameters), {}, {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}, "Mixture-of-experts models: the fused expert weights that get adapters too (PEFT's target_parameters: one adapter per weight holding every expert's, loadable by PEFT). Needs lora.dropout 0. The router stays frozen."),
    B(KEY(lora.train_router), false, "Mixture-of-experts models: train every MoE layer's router in full beside the adapters (PEFT's modules_to_save [\"gate\"]: saved in the adapter file, loaded by PEFT); false keeps the routers frozen."),
    B(KEY(lora.rslora), false, "Rank-stabilised scaling alpha/sqrt(r)."),
    C(KEY(lora.quantize_base), "none", {"none", "nf4"},
      "QLoRA: nf4 holds the frozen base's decoder projections in 4-bit NF4 as bitsandbytes does "
      "(blocks of 64 values, an fp32 absmax each: 0.56 byte per parameter), quantized as they are "
      "read, and dequantizes each into precision.mode (the compute dtype) for its products; "
      "embeddings, norms, the head and a mixture-of-experts model's experts and routers stay in "
      "precision.mode (as transformers + bitsandbytes quantize). Needs lora.enabled. A model saved "
      "quantized by transformers + bitsandbytes (NF4) is read as it is, whatever this says."),
    B(KEY(lora.double_quant), false,
      "With lora.quantize_base=nf4: quantize the absmax values too (bitsandbytes' "
      "bnb_4bit_use_double_quant), so the weights take the values a bitsandbytes run with it "
      "computes with. ft keeps the absmax dequantized in fp32 either way, so this saves no memory."),
    // hardware
    C(KEY(hardware.device), "auto", {"auto", "cpu", "cuda"},
      "Where each rank trains: cuda = GPU LOCAL_RANK of its node, collectives over NCCL (refused "
      "when no GPU is visible or ft was built without CUDA); cpu = host memory, Gloo; auto = cuda "
      "when a GPU is visible and ft has CUDA, else cpu."),
    C(KEY(hardware.preflight), "refuse", {"refuse", "warn", "off"},
      "Before anything is allocated, every rank checks the job's plan (ft plan) against what its "
      "node has: GPU free memory, host memory for all local ranks, free disk under --output. "
      "refuse = a job that will not fit exits 2 naming the node, the resource and the first fix; "
      "warn = print that and run anyway; off = skip the check."),
    // strategy (consumed by the distributed strategies)
    C(KEY(strategy.kind), "ddp", {"ddp", "zero3", "fsdp"}, "How parameters, gradients and optimizer state are spread over ranks."),
    I(KEY(strategy.expert_parallel), 1, 1, 65536, "Mixture-of-experts models: split each MoE layer's experts over this many ranks (contiguous ranks, so inside a node when it divides the ranks per node); tokens travel to their experts' ranks and back by all-to-all. Must divide the world size and the number of experts. The other parameters follow strategy.kind over the whole world; the experts are split over the ranks that hold the same ones under zero3 and fsdp (gathered with their layer), replicated over them under ddp. 1: every rank holds every expert."),
    B(KEY(strategy.overlap_host_step), true, "Jobs whose optimizer runs on the host (zero3 offload_optimizer, fsdp cpu_offload), without zero3's delayed_update: the host AdamW step runs on its own thread, unit by unit in the order the next forward needs them, each unit's parameters going back to the GPU as soon as they are updated; the next step starts at once and its forward waits at a unit only until that unit is updated. With train.grad_clip 0 (no fp16) it begins during the backward, each unit as soon as its gradient is final on the host. The same parameters and bits as false (the whole update first, then the next step); metrics record time.overlapped_update (how long it ran, how long the forward waited, whether it began during the backward)."),
    B(KEY(strategy.overlap_comm), true, "Overlap communication with compute (gathers ahead of use, gradient reductions while backward runs). false waits for every collective as soon as it is issued: slower, but comm.wait_s in the metrics is then the whole communication time, to measure what overlap hides."),
    F(KEY(strategy.ddp.bucket_mb), 25.0, 0.001, kInf, "ddp: gradient all-reduce bucket size (MiB); a bucket is all-reduced as soon as backward has filled it."),
    F(KEY(strategy.zero3.prefetch_bucket_size), 5e7, 0, kInf, "zero3: elements prefetched ahead of use."),
    F(KEY(strategy.zero3.param_persistence_threshold), 1e5, 0, kInf, "zero3: parameters with fewer elements stay whole."),
    F(KEY(strategy.zero3.reduce_bucket_size), 5e8, 1, kInf, "zero3: elements per gradient reduce-scatter bucket."),
    B(KEY(strategy.zero3.offload_optimizer), false,
      "zero3, GPU jobs: masters, gradients and optimizer state in host memory; AdamW on the CPU."),
    B(KEY(strategy.zero3.delayed_update), false,
      "zero3 with offload_optimizer: ZeRO-Offload's delayed parameter update. The host optimizer step of step t runs on its own thread during step t+1's forward and backward, so step t+1 computes its gradients with the parameters of step t-1 (one step stale); checkpoints, evaluations and the end wait for it. Off: every step uses the parameters of the step before."),
    I(KEY(strategy.zero3.delayed_update_after), 10, 0, 1000000000, "zero3 delayed_update: the steps run without the delay first (DeepSpeed's advice: let the first steps, where the parameters change fastest, update at once)."),
    B(KEY(strategy.zero3.offload_param), false,
      "zero3, GPU jobs: parameter shards in host memory, copied to the GPU to be gathered."),
    C(KEY(strategy.fsdp.sharding_strategy), "FULL_SHARD", {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"},
      "fsdp: what is sharded and when it is regathered."),
    B(KEY(strategy.fsdp.forward_prefetch), false, "fsdp: gather the next layer while the current one runs forward."),
    C(KEY(strategy.fsdp.backward_prefetch), "BACKWARD_PRE", {"BACKWARD_PRE", "BACKWARD_POST", "NONE"}, "fsdp: BACKWARD_PRE gathers the next layer before computing the current one's gradients; BACKWARD_POST after them, before their reduce-scatter; NONE when needed."),
    C(KEY(strategy.fsdp.param_dtype), "auto", {"auto", "fp32", "bf16", "fp16"}, "fsdp mixed precision: gather/compute dtype; must equal precision.mode (auto: that)."),
    C(KEY(strategy.fsdp.reduce_dtype), "fp32", {"fp32", "bf16", "fp16"}, "fsdp mixed precision: gradient reduction dtype."),
    B(KEY(strategy.fsdp.cpu_offload), false,
      "fsdp, GPU jobs: both zero3 offloads (parameter shards, gradients, optimizer on the host)."),
    // output
    I(KEY(output.save_every), 0, 0, kMaxCount, "Optimizer steps between checkpoints (0: none by steps); a run that checkpoints also saves at its last step."),
    F(KEY(output.save_every_minutes), 0.0, 0, kInf, "Minutes between checkpoints (0: none by time); with save_every, whichever comes first."),
    I(KEY(output.keep_last), 2, 1, 1000000, "Committed checkpoints kept; older ones are deleted only after a newer one is committed."),
    B(KEY(output.async_save), true, "Copy the state to host memory and write it on a background thread while training goes on."),
    C(KEY(output.on_save_error), "stop", {"stop", "continue"},
      "When a checkpoint cannot be saved (a full disk, on any rank): stop = every rank stops with "
      "exit 74 and the error naming the file and the free space; the newest committed checkpoint "
      "is intact and the same command continues from it once there is room; continue = warn, "
      "train on, and try again at the next save (the steps since the last commit are then at risk)."),
    I(KEY(output.profile_steps), 0, 0, 1000000, "Profile this many optimizer steps after the first 3 with LibTorch's profiler: rank 0 writes profile.json (a Chrome trace) and profile.txt, and prints where the step time went by kernel or op (0: off)."),
    B(KEY(output.tensorboard), false, "Rank 0 also writes each step's scalars (loss, lr, grad norm, tokens/s, MFU, step time, memory) as TensorBoard event files under <output>/tensorboard/ (docs/report.md)."),
    // eval
    C(KEY(eval.long_records), "window", {"window", "refuse"},
      "ft eval, a record longer than data.seq_len: window = split into windows of seq_len tokens "
      "(each overlapping the previous by one token, so every token is scored once, with at most "
      "seq_len tokens of context); refuse = stop, naming the record. Never cut silently."),
    I(KEY(eval.batch_tokens), 16384, 8, 1073741824, "ft eval: tokens per forward (rows x the longest in the batch); records are sorted by length and not padded to data.seq_len."),
    S(KEY(eval.data), "", "ft train: a held-out JSONL file (the formats of data.format; auto with the synthetic task) evaluated as ft eval does, each rank its share: the mean token loss over the whole file goes into that step's metrics.jsonl record (eval_loss), the console and the report; every eval.every steps and at the last step (\"\": none)."),
    F(KEY(eval.split), 0.0, 0, kMaxCount,
      "ft train: hold records of the training data out of training and evaluate them as "
      "eval.data is: a fraction below 1 of each source's records (0.02; at least one record "
      "each), or a whole count of records (500) spread over the sources by their sizes; chosen "
      "from train.seed, the same on every rank, world size and restart (0: none; not with "
      "eval.data)."),
    I(KEY(eval.every), 0, 0, kMaxCount, "ft train: optimizer steps between evaluations of eval.data (0: at the last step only)."),
    B(KEY(eval.fused_kernels), false,
      "ft eval and eval.data: the forward through the fused CPU kernels that train.fused_* "
      "choose; false: transformers' op sequence, so the hidden states are transformers' bits and "
      "the loss equals its within 1e-8 (about 1% of an evaluation's time on the CPU; "
      "docs/training.md)."),
  });
  // clang-format on
  return schema;
}

const Setting* find_setting(const std::string& key) {
  for (const auto& s : preset_schema())
    if (s.key == key) return &s;
  return nullptr;
}

json schema_defaults() {
  json out = json::object();
  for (const auto& s : preset_schema()) {
    std::string pointer = "/" + s.key;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    out[json::json_pointer(pointer)] = s.default_value;
  }
  return out;
}

void validate_preset(const json& preset, const std::string& where) { walk(preset, "", where); }

json parse_setting_value(const Setting& s, const std::string& text, const std::string& where) {
  // A preset is JSON text, so its strings are UTF-8 (nlohmann refuses to write anything else).
  try {
    (void)json(text).dump();
  } catch (const json::type_error&) {
    throw ConfigError(fmt::format("{}: the value of \"{}\" is not valid UTF-8", where, s.key));
  }
  json v;
  switch (s.kind) {
    case Kind::kString:
    case Kind::kChoice:
      v = text;
      break;
    case Kind::kObjectList:
      try {
        v = parse_json<ConfigError>(text, where);
      } catch (const ConfigError&) {
        throw ConfigError(
            fmt::format("{}: \"{}\" = {} is not a JSON list of objects ([{{\"path\": \"a.jsonl\", "
                        "\"weight\": 0.7}}, ...])",
                        where, s.key, excerpt(text)));
      }
      break;
    case Kind::kStringList: {
      if (!text.empty() && text.front() == '[') {
        try {
          v = parse_json<ConfigError>(text, where);
        } catch (const ConfigError&) {
          throw ConfigError(
              fmt::format("{}: \"{}\" = {} is not a JSON list", where, s.key, excerpt(text)));
        }
      } else {
        v = json::array();
        size_t start = 0;
        while (start <= text.size()) {
          size_t comma = text.find(',', start);
          std::string item =
              text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
          if (!item.empty()) v.push_back(item);
          if (comma == std::string::npos) break;
          start = comma + 1;
        }
      }
      break;
    }
    default:
      try {
        v = parse_json<ConfigError>(text, where);
      } catch (const ConfigError&) {
        throw ConfigError(fmt::format("{}: \"{}\" must be {}, got '{}'", where, s.key,
                                      s.kind == Kind::kInt     ? "an integer"
                                      : s.kind == Kind::kFloat ? "a number"
                                                               : "true or false",
                                      excerpt(text)));
      }
      if (s.kind == Kind::kFloat && v.is_number_integer()) v = v.get<double>();
  }
  check_value(s, v, where);
  return v;
}

namespace {

// A row's type column: its kind, range, and (an entry's key) whether it must be given.
std::string type_text(const Setting& s) {
  std::string type = kind_name(s);
  if (s.above_min)
    type += fmt::format(", > {}", s.min);
  else if ((s.kind == Kind::kInt || s.kind == Kind::kFloat) && s.min <= s.max)
    type += s.max == kInf || s.max >= kMaxSeed ? fmt::format(", >= {}", s.min)
                                               : fmt::format(", {}..{}", s.min, s.max);
  if (s.required) type += ", required";
  std::string t;
  for (char c : type) t += c == '|' ? std::string("\\|") : std::string(1, c);
  return t;
}

}  // namespace

std::string schema_markdown() {
  std::string md = "| key | type | default | on resume | meaning |\n|---|---|---|---|---|\n";
  for (const auto& s : preset_schema()) {
    md += fmt::format("| `{}` | {} | `{}` | {} | {} |\n", s.key, type_text(s),
                      s.default_value.dump(), on_resume_name(s.on_resume), s.help);
    for (const Setting& f : s.fields)
      md += fmt::format("| `{}[].{}` | {} | `{}` | {} | {} |\n", s.key, f.key, type_text(f),
                        f.default_value.dump(), on_resume_name(s.on_resume), f.help);
  }
  return md;
}

}  // namespace ft::config

#include "train/run_changes.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ckpt/crc32c.h"
#include "core/error.h"
#include "core/json.h"
#include "data/jsonl_source.h"
#include "data/mixture.h"

namespace ft::train {

using nlohmann::json;
namespace fs = std::filesystem;
using config::OnResume;

namespace {

std::string absolute_path(const std::string& path) {
  if (path.empty()) return "";
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::absolute(path), ec);
  return ec ? fs::absolute(path).lexically_normal().string() : p.string();
}

std::optional<std::string> read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  std::ostringstream text;
  text << f.rdbuf();
  return text.str();
}

// A file's size, a folder's (a save_to_disk dataset) the sum of its files'; -1 when unreadable.
int64_t bytes_of(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    const auto n = fs::file_size(path, ec);
    return ec ? -1 : static_cast<int64_t>(n);
  }
  if (!fs::is_directory(path, ec)) return -1;
  int64_t total = 0;
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_regular_file(ec)) total += static_cast<int64_t>(it->file_size(ec));
  return ec ? -1 : total;
}

json read_json_file(const fs::path& path) {
  try {
    return parse_json<ConfigError>(read_text_file<ConfigError>(path.string()), path.string());
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.what()) +
                      "; it records the run this directory holds: restore it, or choose another "
                      "--output");
  }
}

json value_at(const json& preset, const config::Setting& s) {
  std::string pointer = "/" + s.key;
  std::replace(pointer.begin(), pointer.end(), '.', '/');
  const json::json_pointer p(pointer);
  return preset.contains(p) ? preset.at(p) : s.default_value;
}

int64_t int_at(const json& preset, const std::string& key) {
  const json v = value_at(preset, *config::find_setting(key));
  return v.is_number_integer() ? v.get<int64_t>() : 1;
}

std::string batch_text(int64_t micro, int64_t accum, int64_t ranks) {
  return fmt::format("{} x {} x {} = {}", micro, accum, ranks, micro * accum * ranks);
}

// The kBatch keys, judged together: the global batch (sequences per optimizer step) is what the
// run computes with; how it is split over ranks and micro-batches is not.
void add_batch_changes(const RunInputs& was, const RunInputs& now, bool launcher_restart,
                       std::vector<SettingChange>& out) {
  const int64_t wm = int_at(was.preset, "train.micro_batch"),
                wa = int_at(was.preset, "train.grad_accum"),
                nm = int_at(now.preset, "train.micro_batch"),
                na = int_at(now.preset, "train.grad_accum");
  const int64_t wr = was.has_inputs ? was.world_size : now.world_size, nr = now.world_size;
  // An elastic launcher's later round may have other ranks than the command was started with:
  // the job goes on as torchrun's would, with the global batch those ranks make.
  if (launcher_restart && wr != nr && wm * wa == nm * na) {
    out.push_back({"ranks", wr, nr, OnResume::kFree,
                   fmt::format("a restart of the launcher: the global batch is {} sequences now",
                               nm * na * nr)});
    return;
  }
  if (wm * wa * wr != nm * na * nr) {
    out.push_back({"global batch", batch_text(wm, wa, wr), batch_text(nm, na, nr),
                   OnResume::kComputes, "train.micro_batch x train.grad_accum x ranks"});
    return;
  }
  const std::string kept = fmt::format("the global batch stays {} sequences", nm * na * nr);
  if (wm != nm) out.push_back({"train.micro_batch", wm, nm, OnResume::kFree, kept});
  if (wa != na) out.push_back({"train.grad_accum", wa, na, OnResume::kFree, kept});
  if (wr != nr) out.push_back({"ranks", wr, nr, OnResume::kFree, kept});
}

void add_input_changes(const RunInputs& was, const RunInputs& now,
                       std::vector<SettingChange>& out) {
  if (!was.has_inputs) return;
  if (was.model.empty() != now.model.empty()) {
    out.push_back({"model", was.model.empty() ? "random init" : was.model,
                   now.model.empty() ? "random init" : now.model, OnResume::kState,
                   "another model's tensors"});
  } else if (!was.model.empty()) {
    if (!was.model_config.empty() && !now.model_config.empty() &&
        was.model_config != now.model_config)
      out.push_back({"model", was.model, now.model, OnResume::kState,
                     "its config.json differs: another model"});
    else if (was.model != now.model)
      out.push_back({"model", was.model, now.model, OnResume::kComputes,
                     "the same config.json in another directory: other weights may be there"});
  }
  if (was.data != now.data)
    out.push_back({"data", was.data, now.data, OnResume::kComputes,
                   "other files, weights or sizes: other records"});
  if (was.tokenizer != now.tokenizer)
    out.push_back({"tokenizer", was.tokenizer, now.tokenizer, OnResume::kComputes, ""});
}

// The command-line words that give a change's earlier value back, "" where none does.
std::string restore_words(const SettingChange& c) {
  if (c.key == "model") return c.was == "random init" ? "no --model" : "--model " + c.was.dump();
  if (c.key == "tokenizer") return "--tokenizer " + c.was.dump();
  if (c.key == "data") {
    std::string words;
    for (const json& d : c.was)
      words += fmt::format("{}--data {}:{}", words.empty() ? "" : " ",
                           d.value("path", std::string()), d.value("weight", 1.0));
    return words;
  }
  const config::Setting* s = config::find_setting(c.key);
  if (!s || s->kind == config::Kind::kObjectList) return "";
  const std::string value = c.was.is_string() ? c.was.get<std::string>() : c.was.dump();
  return "--set " + c.key + "=" + value;
}

}  // namespace

RunInputs inputs_of(const RunOptions& o, int64_t world_size) {
  RunInputs in;
  in.preset = o.settings.resolved;
  in.model = absolute_path(o.model_dir);
  if (!o.model_dir.empty())
    if (const auto text = read_file(fs::path(o.model_dir) / "config.json"))
      in.model_config = fmt::format("{:08x}", ckpt::crc32c(text->data(), text->size()));
  for (const std::string& arg : o.data_paths) {
    const data::SourceSpec spec = data::parse_data_arg(arg);
    in.data.push_back({{"path", absolute_path(spec.settings.path)},
                       {"weight", spec.settings.weight},
                       {"bytes", bytes_of(spec.settings.path)}});
  }
  const bool reads_data = !o.data_paths.empty() || !o.settings.data.sources.empty();
  if (reads_data)
    in.tokenizer = absolute_path(data::tokenizer_path_of(o.tokenizer_path, o.model_dir));
  in.world_size = world_size;
  return in;
}

json to_json(const RunInputs& in) {
  return {{"model", in.model},
          {"model_config_crc32c", in.model_config},
          {"data", in.data},
          {"tokenizer", in.tokenizer},
          {"world_size", in.world_size}};
}

std::optional<RunInputs> recorded_inputs(const std::string& output_dir) {
  const fs::path dir(output_dir);
  std::error_code ec;
  if (!fs::is_regular_file(dir / "preset.json", ec)) return std::nullopt;
  RunInputs in;
  in.preset = read_json_file(dir / "preset.json");
  FT_CHECK(in.preset.is_object(), (dir / "preset.json").string(),
           " is not a JSON object; it records the run this directory holds: restore it, or "
           "choose another --output");
  in.has_inputs = fs::is_regular_file(dir / kRunInputsFile, ec);
  if (!in.has_inputs) return in;
  const fs::path path = dir / kRunInputsFile;
  const json j = read_json_file(path);
  try {
    in.model = j.at("model").get<std::string>();
    in.model_config = j.at("model_config_crc32c").get<std::string>();
    in.data = j.at("data");
    in.tokenizer = j.at("tokenizer").get<std::string>();
    in.world_size = j.at("world_size").get<int64_t>();
  } catch (const json::exception& e) {
    throw ConfigError(
        fmt::format("{}: not the record ft writes ({}); restore it, or choose "
                    "another --output",
                    path.string(), e.what()));
  }
  return in;
}

std::vector<SettingChange> changes_between(const RunInputs& was, const RunInputs& now,
                                           bool launcher_restart) {
  std::vector<SettingChange> out;
  // With --model the model section's shape is unused: config.json is compared instead.
  const bool shape_from_files = !now.model.empty() && (!was.has_inputs || !was.model.empty());
  for (const config::Setting& s : config::preset_schema()) {
    if (s.on_resume == OnResume::kBatch) continue;
    if (shape_from_files && s.on_resume == OnResume::kState && s.key.rfind("model.", 0) == 0)
      continue;
    const json a = value_at(was.preset, s), b = value_at(now.preset, s);
    if (a != b) out.push_back({s.key, a, b, s.on_resume, ""});
  }
  add_batch_changes(was, now, launcher_restart, out);
  add_input_changes(was, now, out);
  return out;
}

std::string change_text(const SettingChange& c) {
  auto text = [](const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
  return fmt::format("{} {} -> {}{}", c.key, text(c.was), text(c.now),
                     c.note.empty() ? "" : " (" + c.note + ")");
}

json change_json(const SettingChange& c) {
  return {
      {"key", c.key}, {"was", c.was}, {"now", c.now}, {"effect", config::on_resume_name(c.effect)}};
}

std::vector<SettingChange> judge_changes(const std::vector<SettingChange>& changes,
                                         const std::string& output_dir, bool resume_changed) {
  std::vector<const SettingChange*> refused, state;
  for (const auto& c : changes) {
    if (c.effect == OnResume::kFree) continue;
    refused.push_back(&c);
    if (c.effect == OnResume::kState) state.push_back(&c);
  }
  if (refused.empty() || (resume_changed && state.empty())) return changes;
  std::string list, restore;
  for (const SettingChange* c : refused) {
    list += "\n  " + change_text(*c) +
            (c->effect == OnResume::kState ? " [the saved state has another shape]" : "");
    if (const std::string w = restore_words(*c); !w.empty())
      restore += (restore.empty() ? "" : " ") + w;
  }
  const std::string forced =
      state.empty()
          ? "; or continue it with these changes on purpose: add --resume-changed (recorded in "
            "events.jsonl)"
          : fmt::format(
                "; --resume-changed cannot continue it: {} changes the shape of the "
                "state its checkpoints hold",
                state.front()->key);
  throw ConfigError(fmt::format(
      "--output {} holds a run with other settings than this command's, which would change what "
      "it computes; nothing was loaded or written:{}\nTo train these settings, give another "
      "--output DIR; to continue the run as it was, {}{}",
      output_dir, list,
      restore.empty() ? std::string("give its settings again (its preset.json)")
                      : "give " + restore,
      forced));
}

}  // namespace ft::train

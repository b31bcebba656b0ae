#include "train_options.h"

#include <fmt/format.h>

#include "config/preset.h"
#include "core/error.h"
#include "io/hub_cache.h"

namespace ft::app {

const std::vector<TrainOptionSpec>& train_option_specs() {
  // clang-format off
  static const std::vector<TrainOptionSpec> specs = {
      {"preset", "NAME|FILE", "Shipped preset name or preset JSON file", true, false},
      {"model", "DIR|ORG/NAME",
       "Hugging Face model directory, or a hub id the local hub cache holds (default: random "
       "init)",
       false, false},
      {"data", "PATH[:WEIGHT]",
       "Training data: JSONL (.jsonl, .jsonl.gz, .jsonl.zst), a JSON array (.json), Parquet, "
       "Arrow, or a save_to_disk folder; several sources: once each with a weight, --data "
       "a.jsonl:0.7 --data b.parquet:0.3 (docs/training.md \"Mixtures of several files\")",
       false, true},
      {"tokenizer", "PATH", "tokenizer.json for --data (default: the one in --model)", false, false},
      {"data-cache", "DIR",
       "Where ft data prepare put the tokenized --data (default: PATH.ftcache beside it)", false,
       false},
      {"output", "DIR", "Output directory (must not hold an earlier run unless resuming it)", true,
       false},
      {"resume", "auto|none|DIR",
       "auto (default): continue from the newest good checkpoint in --output if there is one; "
       "none: start afresh; DIR: continue from that checkpoint (a step-N directory)",
       false, false},
      {"resume-changed", "",
       "Continue the run --output holds although settings that change what it computes differ "
       "from its own (learning rate, data, batch...; docs/training.md); recorded in "
       "events.jsonl. Without it such a command is refused and nothing is written",
       false, false, true},
      {"set", "KEY=VALUE", "Override a preset key: --set train.lr=1e-4 (repeatable)", false, true},
  };
  // clang-format on
  return specs;
}

void TrainCommandLine::add_to(CLI::App* cmd, bool require, const std::string& group) {
  for (const auto& spec : train_option_specs()) {
    CLI::Option* o;
    if (spec.flag) {
      o = cmd->add_flag("--" + spec.name, flags_[spec.name], spec.help);
    } else if (spec.repeatable) {
      // One value per occurrence, so `--set a=1 PROGRAM` never takes PROGRAM as a second value.
      o = cmd->add_option("--" + spec.name, repeated_[spec.name], spec.help)
              ->allow_extra_args(false);
    } else {
      o = cmd->add_option("--" + spec.name, single_[spec.name], spec.help);
    }
    if (!spec.flag) o->type_name(spec.value_name);
    o->group(group);
    if (require && spec.required) o->required();
    options_[spec.name] = o;
  }
}

bool TrainCommandLine::any_given() const { return !first_given().empty(); }

std::string TrainCommandLine::first_given() const {
  for (const auto& spec : train_option_specs())
    if (options_.at(spec.name)->count() > 0) return "--" + spec.name;
  return "";
}

std::vector<std::string> TrainCommandLine::missing_required() const {
  std::vector<std::string> out;
  for (const auto& spec : train_option_specs())
    if (spec.required && options_.at(spec.name)->count() == 0) out.push_back("--" + spec.name);
  return out;
}

const std::string& TrainCommandLine::value(const std::string& name) const {
  auto it = single_.find(name);
  FT_ASSERT(it != single_.end(), "not a single-valued ft train option: ", name);
  return it->second;
}

bool TrainCommandLine::flag(const std::string& name) const {
  auto it = flags_.find(name);
  FT_ASSERT(it != flags_.end(), "not a flag of ft train: ", name);
  return it->second;
}

const std::vector<std::string>& TrainCommandLine::values(const std::string& name) const {
  auto it = repeated_.find(name);
  FT_ASSERT(it != repeated_.end(), "not a repeatable ft train option: ", name);
  return it->second;
}

std::vector<std::string> TrainCommandLine::train_argv() const {
  std::vector<std::string> argv;
  for (const auto& spec : train_option_specs()) {
    if (options_.at(spec.name)->count() == 0) continue;
    if (spec.flag) {
      argv.push_back("--" + spec.name);
    } else if (spec.repeatable) {
      for (const auto& v : values(spec.name)) argv.insert(argv.end(), {"--" + spec.name, v});
    } else {
      argv.insert(argv.end(), {"--" + spec.name, value(spec.name)});
    }
  }
  return argv;
}

train::RunOptions TrainCommandLine::run_options() const {
  train::RunOptions o;
  o.model_dir = value("model");
  o.data_paths = values("data");
  o.tokenizer_path = value("tokenizer");
  o.data_cache_dir = value("data-cache");
  o.output_dir = value("output");
  o.resume = value("resume").empty() ? "auto" : value("resume");
  o.resume_changed = flag("resume-changed");
  return o;
}

void TrainCommandLine::resolve_model(const std::string& who, std::FILE* note_to) {
  resolve_model_option(single_["model"], who, "--model", note_to);
  if (!single_["model"].empty()) config::refuse_shape_sets(values("set"), single_["model"]);
}

void resolve_model_option(std::string& value, const std::string& who, const std::string& option,
                          std::FILE* note_to) {
  const io::ModelDir m = io::resolve_model_dir(value, option);
  if (note_to != nullptr && !m.note.empty()) {
    fmt::print(note_to, "{}: {}\n", who, m.note);
    std::fflush(note_to);
  }
  value = m.dir;
}

}  // namespace ft::app

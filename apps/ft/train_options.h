// The options of `ft train`, declared once: `ft train` parses them, and `ft launch` accepts the
// same ones and forwards them to `ft train` on every worker. One TrainCommandLine per subcommand
// holds what its command line gave; not thread-safe (filled by CLI11 while parsing).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "train/run.h"

namespace ft::app {

struct TrainOptionSpec {
  std::string name;        // the flag without dashes: "preset"
  std::string value_name;  // for --help: "NAME|FILE"
  std::string help;
  bool required = false;    // ft train cannot run without it
  bool repeatable = false;  // may be given more than once (--set); order kept
  bool flag = false;        // takes no value (--resume-changed)
};

// The table, in the order --help shows it and train_argv() writes it.
const std::vector<TrainOptionSpec>& train_option_specs();

class TrainCommandLine {
 public:
  // Adds every option of the table to `cmd` under the --help heading `group`. With `require`, CLI11
  // enforces the required ones (ft train); otherwise the caller checks missing_required().
  void add_to(CLI::App* cmd, bool require, const std::string& group);

  // Whether any option of the table was given, and the first one given (for messages).
  bool any_given() const;
  std::string first_given() const;
  // Required options not given, as "--output".
  std::vector<std::string> missing_required() const;

  // A single-valued option's value ("" when not given), a repeatable one's values, in order, and
  // whether a flag was given.
  const std::string& value(const std::string& name) const;
  const std::vector<std::string>& values(const std::string& name) const;
  bool flag(const std::string& name) const;

  // The given options as `ft train` arguments, in table order: {"--preset", "tiny-demo", "--set",
  // "train.lr=1e-4", ...}.
  std::vector<std::string> train_argv() const;

  // The paths ft train reads and writes (RunOptions without the resolved preset).
  train::RunOptions run_options() const;

  // Replaces --model's value by the directory it names (resolve_model_option), so that every
  // later reader, the arguments forwarded to workers and the run's records included, sees that
  // directory.
  void resolve_model(const std::string& who, std::FILE* note_to);

 private:
  std::map<std::string, std::string> single_;
  std::map<std::string, std::vector<std::string>> repeated_;
  std::map<std::string, bool> flags_;
  std::map<std::string, CLI::Option*> options_;
};

// `value`, a model directory option as given (--model, --base-model: `option`), becomes the
// directory it names: itself, or a hub id's snapshot in the Hugging Face hub cache
// (io/hub_cache.h), which a line "WHO: --model ORG/NAME: DIR (...)" on `note_to` reports (nothing
// when it is nullptr). Every command that takes a model directory calls this once, after parsing.
void resolve_model_option(std::string& value, const std::string& who, const std::string& option,
                          std::FILE* note_to);

}  // namespace ft::app

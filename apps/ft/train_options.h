// The options of `ft train`, declared once: `ft train` parses them, and `ft launch` accepts the
// same ones and forwards them to `ft train` on every worker. One TrainCommandLine per subcommand
// holds what its command line gave; not thread-safe (filled by CLI11 while parsing).
#pragma once

#include <CLI/CLI.hpp>
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

  // A single-valued option's value ("" when not given) and a repeatable one's values, in order.
  const std::string& value(const std::string& name) const;
  const std::vector<std::string>& values(const std::string& name) const;

  // The given options as `ft train` arguments, in table order: {"--preset", "tiny-demo", "--set",
  // "train.lr=1e-4", ...}.
  std::vector<std::string> train_argv() const;

  // The paths ft train reads and writes (RunOptions without the resolved preset).
  train::RunOptions run_options() const;

 private:
  std::map<std::string, std::string> single_;
  std::map<std::string, std::vector<std::string>> repeated_;
  std::map<std::string, CLI::Option*> options_;
};

}  // namespace ft::app

// Subcommands of the `ft` binary. Each registers its options on the CLI11 app and returns the
// function that runs it (parse -> validate -> init -> run -> report); logic lives in the libraries.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace ft::app {

using Run = std::function<int()>;

// `program` receives what follows `--` on the command line (split off before CLI11 parses).
Run add_launch(CLI::App& app, const std::vector<std::string>& program);
Run add_comm_check(CLI::App& app);
Run add_presets(CLI::App& app);
Run add_train(CLI::App& app);
Run add_eval(CLI::App& app);
Run add_export(CLI::App& app);
Run add_plan(CLI::App& app);
Run add_data(CLI::App& app);
Run add_doctor(CLI::App& app);
Run add_report(CLI::App& app);

}  // namespace ft::app

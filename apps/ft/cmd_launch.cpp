// `ft launch [options] -- PROGRAM [ARGS...]`: torchrun-compatible multi-node launcher.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <memory>

#include "agent.h"
#include "commands.h"
#include "core/build_info.h"
#include "core/error.h"
#include "options.h"

namespace ft::app {

Run add_launch(CLI::App& app, const std::vector<std::string>& program) {
  auto* cmd = app.add_subcommand(
      "launch",
      "Rendezvous with the other nodes, run PROGRAM once per worker with torchrun's environment, "
      "supervise and restart.\nUsage: ft launch [options] -- PROGRAM [ARGS...]");
  // Everything from the first positional on is the program (torchrun's form, without `--`).
  cmd->prefix_command();
  auto values = std::make_shared<std::map<std::string, std::string>>();
  auto opts = std::make_shared<std::map<std::string, CLI::Option*>>();
  auto print_md = std::make_shared<bool>(false);
  for (const auto& spec : launcher::launch_option_specs()) {
    std::string names = "--" + spec.name;
    std::string underscore = spec.name;
    std::replace(underscore.begin(), underscore.end(), '-', '_');
    if (underscore != spec.name) names += ",--" + underscore;
    std::string help = spec.help;
    if (!spec.default_value.empty()) help += fmt::format(" [default: {}]", spec.default_value);
    if (!spec.env.empty()) help += fmt::format(" [env: {}]", fmt::join(spec.env, ", "));
    if (!spec.scheduler.empty())
      help += fmt::format(" [SLURM: {}]", fmt::join(spec.scheduler, ", "));
    CLI::Option* o;
    if (spec.is_flag()) {
      o = cmd->add_flag(names)->description(help);
    } else {
      o = cmd->add_option(names, (*values)[spec.name], help)->type_name(spec.value_name);
    }
    (*opts)[spec.name] = o;
  }
  cmd->add_flag("--print-options-md", *print_md, "Print the option table as Markdown (docs)")
      ->group("");

  return [cmd, values, opts, print_md, program]() -> int {
    if (*print_md) {
      std::fputs(launcher::options_markdown().c_str(), stdout);
      return 0;
    }
    std::map<std::string, std::string> given;
    for (const auto& [name, opt] : *opts) {
      if (opt->count() == 0) continue;
      given[name] = launcher::launch_option_spec(name).is_flag() ? "1" : (*values)[name];
    }
    // prefix_command() hands back everything from the first token it does not know: that is the
    // program, unless it looks like an option (a typo, or a torchrun flag ft does not have).
    std::vector<std::string> rest = cmd->remaining();
    if (!rest.empty() && (rest.front().rfind("-", 0) == 0 || !program.empty())) {
      throw ConfigError(fmt::format("ft launch: unknown option '{}'{}. See `ft launch --help`",
                                    rest.front(), launcher::suggest_option(rest.front())));
    }
    std::vector<std::string> prog = program.empty() ? rest : program;
    auto resolved = launcher::resolve_options(given, launcher::current_environment());
    BuildInfo bi = build_info(true);
    long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
    auto cfg = launcher::make_launch_config(resolved, prog, bi.cuda_devices,
                                            static_cast<int>(std::max(1L, cores)));
    if (cfg.dry_run) {
      std::fputs(launcher::dry_run_text(cfg).c_str(), stdout);
      return 0;
    }
    return launcher::run_launch(cfg, bi);
  };
}

}  // namespace ft::app

// `ft launch [options] -- PROGRAM [ARGS...]`: torchrun-compatible multi-node launcher.
// `ft launch [options] --preset NAME [ft train options]`: the same launcher running `ft train`
// (this binary) on every worker, with the ft train options given to it.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "agent.h"
#include "commands.h"
#include "config/preset.h"
#include "config/settings.h"
#include "core/build_info.h"
#include "core/error.h"
#include "cuda/device.h"
#include "io/storage.h"
#include "options.h"
#include "plan/preflight.h"
#include "train/run_dir.h"
#include "train_options.h"

namespace ft::app {
namespace {

// This binary, so the workers run the same ft as the launcher whatever PATH holds.
std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  FT_CHECK_T(SystemError, !ec, "cannot find ft's own path (/proc/self/exe): ", ec.message());
  return p.string();
}

}  // namespace

Run add_launch(CLI::App& app, const std::vector<std::string>& program) {
  auto* cmd = app.add_subcommand(
      "launch",
      "Rendezvous with the other nodes, run PROGRAM once per worker with torchrun's environment, "
      "supervise and restart.\nUsage: ft launch [options] -- PROGRAM [ARGS...]\n"
      "       ft launch [options] --preset NAME|FILE --output DIR [ft train options]\n"
      "         runs `ft train` (this ft) on every worker with the ft train options; no PROGRAM");
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
      help += fmt::format(" [scheduler: {}]", fmt::join(spec.scheduler, ", "));
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
  auto train_args = std::make_shared<TrainCommandLine>();
  train_args->add_to(
      cmd, /*require=*/false,
      "ft train options (any of them: ft launch runs `ft train` on every worker, no PROGRAM)");

  return [cmd, values, opts, print_md, program, train_args]() -> int {
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
    if (train_args->any_given()) {
      const std::string given = train_args->first_given();
      FT_CHECK(prog.empty(), "ft launch: ", given,
               " is an ft train option, so ft launch runs `ft train` on every worker, but a "
               "program was given too ('",
               prog.empty() ? "" : prog.front(),
               "'): give either ft train's options (ft launch [options] --preset NAME --output "
               "DIR ...) or a program (ft launch [options] -- PROGRAM ...), not both");
      const auto missing = train_args->missing_required();
      FT_CHECK(missing.empty(), "ft launch: ", given,
               " runs `ft train` on every worker, which needs ",
               fmt::format("{}", fmt::join(missing, " and ")),
               " too: ft launch [options] --preset NAME|FILE --output DIR [--set key=value ...]");
      // A bad preset or --set is refused once, here, rather than by every worker.
      config::resolve_preset(train_args->value("preset"), train_args->values("set"));
      // Each node's launcher finds a hub id in its own cache once; its workers get the directory.
      train_args->resolve_model("ft launch", stdout);
      prog = {self_exe(), "train"};
      const auto forwarded = train_args->train_argv();
      prog.insert(prog.end(), forwarded.begin(), forwarded.end());
    }
    auto resolved = launcher::resolve_options(given, launcher::current_environment());
    BuildInfo bi = build_info(true);
    long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
    auto cfg = launcher::make_launch_config(resolved, prog, bi.cuda_devices,
                                            static_cast<int>(std::max(1L, cores)));
    if (cfg.dry_run) {
      std::fputs(launcher::dry_run_text(cfg).c_str(), stdout);
      return 0;
    }
    if (train_args->any_given()) {
      // Every launcher checks the job's plan against its own node before starting workers (each
      // worker checks again, with what the node has then). Elastic jobs plan for the fewest nodes.
      plan::PreflightOptions po;
      po.settings =
          config::resolve_settings(train_args->value("preset"), train_args->values("set"));
      po.model_dir = train_args->value("model");
      po.output_dir = train_args->value("output");
      io::check_writable_dir(po.output_dir, "--output");
      // A directory holding another run, or this run with changes it cannot continue with, is
      // refused by every node's launcher before the rendezvous (its workers would each refuse).
      comm::DistEnv job;
      job.world_size = cfg.min_nodes * cfg.nproc_per_node;
      job.rank = 1;  // the workers' rank 0 says what it goes on with
      train::RunOptions run = train_args->run_options();
      run.settings = po.settings;
      if (const train::OutputPlan out = train::plan_output(run, job); out.finished) {
        fmt::print("ft launch: {}\n", train::finished_text(out, run.output_dir));
        return 0;
      }
      po.layout = {cfg.min_nodes, cfg.nproc_per_node,
                   cuda::choose_device(po.settings.hardware.device, 0).device.is_cuda()};
      po.node_rank = cfg.node_rank.value_or(-1);
      po.running = 0;
      po.who = "ft launch";
      const plan::Plan p = plan::preflight(po);
      // The node's memory bandwidth, measured here while no worker runs: the workers' plans
      // share it out among them (plan::machine_budget).
      if (p.host_memory_bps > 0)
        ::setenv(plan::kHostMemoryEnv, fmt::format("{:.0f}", p.host_memory_bps).c_str(), 1);
    }
    return launcher::run_launch(cfg, bi);
  };
}

}  // namespace ft::app

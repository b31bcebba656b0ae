// Every `ft launch` setting, declared once: flag, default, help and the environment variables that
// mirror it. The table drives CLI parsing, `--help`, `--dry-run` and docs/launcher.md, and
// `resolve()` applies ft's precedence: flag > FT_* / PET_* > plain env > scheduler (SLURM, or
// mpirun's task variables: core/scheduler_env.h) > default. Pure data and functions over it;
// thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/scheduler_env.h"

namespace ft::launcher {

struct OptionSpec {
  std::string name;           // canonical flag name without dashes: "nproc-per-node"
  std::string value_name;     // "N|auto" for help; empty for boolean flags
  std::string default_value;  // "" means unset
  std::string help;
  std::vector<std::string> env;  // FT_*/PET_* first, then plain variables, in precedence order
  // Scheduler variables that can supply it (SLURM's, mpirun's: core/scheduler_env.h reads them).
  std::vector<std::string> scheduler;
  bool is_flag() const { return value_name.empty(); }
};

// The option table, in the order `--help` shows it.
const std::vector<OptionSpec>& launch_option_specs();
const OptionSpec& launch_option_spec(const std::string& name);

// A resolved value and where it came from, e.g. {"2", "env NNODES"}.
struct Resolved {
  std::string value;
  std::string
      source;  // "flag --nnodes", "env PET_NNODES", "SLURM_NNODES", "default", "--standalone"
  bool set() const { return !value.empty(); }
};

// Environment lookup, injectable for tests.
using sched::current_environment;
using sched::EnvMap;

// Applies precedence. `flags` holds the values given on the command line, keyed by canonical name.
std::map<std::string, Resolved> resolve_options(const std::map<std::string, std::string>& flags,
                                                const EnvMap& env);

// The typed, validated launch configuration. Throws ConfigError naming the option and its source.
struct LaunchConfig {
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;        // resolved from "auto"/"gpu"/"cpu" too
  std::string nproc_spec;        // as given: "auto", "4"...
  std::optional<int> node_rank;  // unset: assigned in join order
  std::string rdzv_host;         // the store's host as every node reaches it
  uint16_t rdzv_port = 29500;    // 0: pick a free port (single node only)
  std::string rdzv_id = "none";
  double rdzv_timeout_s = 600;
  double rdzv_last_call_s = 30;  // --nnodes MIN:MAX: wait this long for more nodes after MIN
  bool standalone = false;
  int max_restarts = 0;
  double monitor_interval_s = 0.1;
  std::string log_dir;                 // "" = console only
  std::string advertise_addr;          // "" = the address this node uses to reach the store
  std::optional<double> term_grace_s;  // --term-grace as a number; unset: auto (grace.h)
  double heartbeat_timeout_s = 10;     // a node silent this long is lost
  double hang_timeout_s = 600;         // a worker whose progress stops this long is hung (0: off)
  bool dry_run = false;
  bool bind_cores = false;  // each local worker on its own share of the launcher's cores
  std::string role = "default";
  std::vector<std::string> program;         // PROGRAM ARGS...
  std::map<std::string, Resolved> sources;  // for --dry-run
};

// `visible_gpus` is what "auto"/"gpu" resolve to; `cpu_cores` is what "cpu" resolves to.
LaunchConfig make_launch_config(const std::map<std::string, Resolved>& resolved,
                                std::vector<std::string> program, int visible_gpus, int cpu_cores);

// "N" or "MIN:MAX".
std::pair<int, int> parse_nnodes(const std::string& text, const std::string& source);

// " (did you mean --nproc-per-node?)" for a mistyped flag, "" when nothing is close.
std::string suggest_option(const std::string& given);

// Markdown table of the options, for docs/launcher.md (`ft launch --print-options-md`).
std::string options_markdown();

}  // namespace ft::launcher

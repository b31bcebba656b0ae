// Fuzzes what a launcher and a worker read from their environment. The input's first line is a
// SLURM host list (expand_hostlist); each further line is a flag ("--nnodes=2") or an environment
// variable ("SLURM_JOB_NODELIST=gpu[01-04]"), resolved as `ft launch` resolves them
// (resolve_options: flag > FT_* / PET_* > plain > scheduler > default, then make_launch_config),
// and as a worker reads them (read_dist_env: torchrun's variables, or mpirun's or srun's).
#include <map>

#include "comm/dist_env.h"
#include "core/hostlist.h"
#include "fuzz_support.h"
#include "options.h"

using namespace ft;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto lines = fuzz::split(fuzz::as_text(data, size), "\n", 64);
  fuzz::expect_ft_errors([&] {
    const std::vector<std::string> hosts = expand_hostlist(std::string(lines[0]));
    fuzz::require(!hosts.empty(), "an accepted host list names a host");
  });

  std::map<std::string, std::string> flags;
  launcher::EnvMap env;
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::string_view line = lines[i];
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) continue;
    if (line.rfind("--", 0) == 0) {
      // The "did you mean" of a mistyped flag: once, as `ft launch` stops at the first.
      if (flags.empty()) (void)launcher::suggest_option(std::string(line.substr(0, eq)));
      flags[std::string(line.substr(2, eq - 2))] = std::string(line.substr(eq + 1));
    } else {
      env[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
    }
  }
  fuzz::expect_ft_errors([&] {
    const auto resolved = launcher::resolve_options(flags, env);
    const launcher::LaunchConfig c =
        launcher::make_launch_config(resolved, {"train.py", "--lr", "1"}, int(size % 3), 2);
    fuzz::require(c.min_nodes >= 1 && c.min_nodes <= c.max_nodes && c.nproc_per_node >= 1 &&
                      (!c.node_rank || *c.node_rank < c.max_nodes),
                  "an accepted launch configuration is consistent");
  });

  fuzz::expect_ft_errors([&] {
    const comm::DistEnv e = comm::read_dist_env(env);
    fuzz::require(e.rank < e.world_size && e.local_rank < e.local_world_size,
                  "an accepted worker environment is consistent");
  });
  return 0;
}

// `ft comm-check`: a real collective across every worker of a launch, to prove the wiring (store,
// process group, transport) before a long job, and the program `make demo` launches until the
// training runtime lands. Collective; call on every rank.
#pragma once

#include <string>

#include "comm/dist_env.h"

namespace ft::comm {

struct CommCheckResult {
  int rank = 0;
  int world_size = 1;
  double sum = 0;       // all-reduced sum of (rank + 1)
  double expected = 0;  // world_size * (world_size + 1) / 2
  double seconds = 0;   // time of `iters` all-reduces of `numel` floats
  bool ok() const { return sum == expected; }
};

CommCheckResult run_comm_check(const DistEnv& env, int iters, int64_t numel);

}  // namespace ft::comm

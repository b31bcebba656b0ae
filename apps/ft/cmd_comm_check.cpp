// `ft comm-check`: all-reduce across every worker of the launch and report the result and
// bandwidth.
#include <fmt/format.h>

#include "comm/comm_check.h"
#include "commands.h"

namespace ft::app {

Run add_comm_check(CLI::App& app) {
  auto* cmd = app.add_subcommand("comm-check",
                                 "Check communication: all-reduce across all workers (run under "
                                 "`ft launch`), print the sum and "
                                 "the bandwidth");
  auto iters = std::make_shared<int>(10);
  auto numel = std::make_shared<int64_t>(1 << 20);
  cmd->add_option("--iters", *iters, "Timed all-reduces")->check(CLI::Range(0, 100000));
  cmd->add_option("--numel", *numel, "Floats per timed all-reduce")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  return [iters, numel]() -> int {
    auto env = comm::read_dist_env();
    auto r = comm::run_comm_check(env, *iters, *numel);
    double bytes = static_cast<double>(*numel) * 4;
    // Bus bandwidth as nccl-tests defines it for all-reduce: 2 (n-1)/n of the payload per op.
    double busbw = r.seconds > 0 && r.world_size > 1
                       ? bytes * *iters * 2.0 * (r.world_size - 1) / r.world_size / r.seconds / 1e9
                       : 0;
    fmt::print(
        "comm-check rank {}/{}: all-reduce sum = {} (expected {}) {}; {} x {:.1f} MiB all-reduce "
        "in {:.1f} ms, bus bandwidth {:.2f} GB/s\n",
        r.rank, r.world_size, r.sum, r.expected, r.ok() ? "OK" : "MISMATCH", *iters,
        bytes / (1 << 20), r.seconds * 1e3, busbw);
    std::fflush(stdout);
    return r.ok() ? 0 : 1;
  };
}

}  // namespace ft::app

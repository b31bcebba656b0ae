#include "plan/preflight.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>

#include "core/error.h"
#include "core/strings.h"

namespace ft::plan {

namespace {
std::string node_name(int node_rank) {
  return node_rank >= 0 ? fmt::format("node {}", node_rank) : std::string("this node");
}

// The node's memory bandwidth for the host step (Budget::host_memory_bps); see machine_budget. A
// worker takes its launcher's figure; a process alone on the node measures it.
void host_memory(Budget& b, int running) {
  if (const char* env = running > 0 ? std::getenv(kHostMemoryEnv) : nullptr) {
    char* end = nullptr;
    const double v = std::strtod(env, &end);
    FT_CHECK(end != env && *end == '\0' && v > 0 && std::isfinite(v), kHostMemoryEnv, "=", env,
             ": not a positive number of bytes per second (ft launch sets it for its workers; "
             "unset it)");
    b.host_memory_bps = v;
    b.host_memory_from = "measured by this node's ft launch";
  } else if (running <= 1) {
    b.host_memory_bps = measure_host_memory_bps();
    b.host_memory_from = "measured on this machine";
  }  // (else workers beside each other, not started by ft launch: unknown)
}
}  // namespace

Budget machine_budget(const Machine& m, int running, const std::string& model_dir, bool host_step) {
  Budget b;
  b.gpu_bytes = m.gpu_free;
  b.gpu_from = m.gpu_from;
  if (m.host_available > 0) {
    b.host_bytes = m.host_available + static_cast<int64_t>(running) * m.process_bytes;
    b.host_from = running > 0 ? fmt::format(
                                    "{} + the {} ft process(es) of this job already "
                                    "running",
                                    m.host_from, running)
                              : m.host_from;
  }
  b.disk_bytes = m.disk_free;
  b.disk_from = m.disk_from;
  b.process_bytes = m.process_bytes;
  b.process_from = fmt::format("this ft process's resident memory before it allocates ({})",
                               human_bytes(m.process_bytes));
  b.disk_read_bytes_per_s = measure_read_throughput(model_dir, &b.disk_read_from);
  b.init_elements_per_s = model_dir.empty() ? measure_init_rate() : 0;
  b.host_adamw_ns = measure_host_adamw_ns();
  b.host_cores = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  if (host_step) host_memory(b, running);
  return b;
}

Plan preflight(const PreflightOptions& o) {
  const std::string& mode = o.settings.hardware.preflight;
  PlanInputs in;
  in.settings = o.settings;
  in.model_dir = o.model_dir;
  in.layout = o.layout;
  const Machine machine = probe_machine(o.output_dir);
  in.budget = machine_budget(machine, o.running, o.model_dir, host_step(o.settings.strategy));
  if (mode == "off") {
    // Still planned (the expected start-up time), never checked.
    in.budget.gpu_bytes = in.budget.host_bytes = in.budget.disk_bytes = 0;
    return make_plan(in, false);
  }
  const Plan p = make_plan(in);
  if (p.fits()) {
    if (o.print)
      fmt::print(
          "{}: preflight on {}: fits ({} per rank on its {}, {} host memory per node, "
          "{} disk; first step in about {:.0f} s)\n",
          o.who, node_name(o.node_rank), human_bytes(p.device_peak), p.device_name,
          human_bytes(p.host_peak), human_bytes(p.disk_need), p.first_step_s);
    std::fflush(stdout);
    return p;
  }
  char host[256] = "";
  ::gethostname(host, sizeof(host) - 1);
  const std::string msg = fmt::format(
      "preflight: {} ({}): this job {}. `ft plan` shows every figure; "
      "hardware.preflight=warn runs anyway",
      node_name(o.node_rank), host, verdict(p));
  FT_CHECK(mode == "warn", msg);
  if (o.print) fmt::print(stderr, "{}: warning: {}\n", o.who, msg);
  return p;
}

}  // namespace ft::plan

#include "plan/preflight.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/strings.h"

namespace ft::plan {

namespace {
std::string node_name(int node_rank) {
  return node_rank >= 0 ? fmt::format("node {}", node_rank) : std::string("this node");
}
}  // namespace

Budget machine_budget(const Machine& m, int running, const std::string& model_dir) {
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
  return b;
}

Plan preflight(const PreflightOptions& o) {
  const std::string& mode = o.settings.hardware.preflight;
  PlanInputs in;
  in.settings = o.settings;
  in.model_dir = o.model_dir;
  in.layout = o.layout;
  const Machine machine = probe_machine(o.output_dir);
  in.budget = machine_budget(machine, o.running, o.model_dir);
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

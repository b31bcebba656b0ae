// Preflight: the plan of this job checked against what this node really has, before anything is
// allocated or written. Used by every rank of `ft train` (under `ft launch` or alone) and by every
// `ft launch` before it starts its workers. Not thread-safe (prints).
#pragma once

#include <string>

#include "comm/dist_env.h"
#include "config/settings.h"
#include "plan/plan.h"
#include "plan/resources.h"

namespace ft::plan {

// The budget of one node from what this machine has: `running` ft processes of the job are
// already resident on it (their memory is in use, and the plan counts it), `model_dir`'s read
// throughput is measured. With `host_step` (the optimizer is offloaded) the memory's bandwidth
// too: measured by a process that is alone on the node (`running` at most 1: ft plan, ft launch,
// a single ft train), else taken from kHostMemoryEnv, which ft launch sets for its workers.
Budget machine_budget(const Machine& machine, int running, const std::string& model_dir,
                      bool host_step);
// The strategy runs the optimizer step on the host (zero3 offload_optimizer, fsdp cpu_offload).
inline bool host_step(const config::StrategySettings& st) {
  return (st.kind == "zero3" && st.zero3.offload_optimizer) ||
         (st.kind == "fsdp" && st.fsdp.cpu_offload);
}
// The node's memory bandwidth in bytes per second, as ft launch measured it before starting its
// workers (their host steps then share it; a worker measuring beside the others would not see it).
inline constexpr const char* kHostMemoryEnv = "FT_HOST_MEMORY_BPS";

struct PreflightOptions {
  config::Settings settings;
  std::string model_dir, output_dir;
  Layout layout;
  int node_rank = 0;
  int running = 1;    // ft processes of this job already running on this node
  bool print = true;  // print the verdict (one process per node)
  std::string who;    // "ft train", "ft launch"
};

// Plans the job and checks it against this node (hardware.preflight: refuse, warn or off). A job
// that will not fit under `refuse` is a ConfigError (exit 2) naming the node, the resource, needed
// against available and the first suggestion; under `warn` that is printed and the plan returned.
Plan preflight(const PreflightOptions& o);

}  // namespace ft::plan

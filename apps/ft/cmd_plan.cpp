// `ft plan --preset NAME|FILE [--model DIR] [--set k=v ...] [--nnodes N] [--nproc-per-node G]
// [--gpu-memory SIZE] [--host-memory SIZE] [--disk-throughput SIZE] [--output DIR] [--json]`: what
// the job needs per rank, per node, on disk and on the wire, against what this machine (or the
// sizes given) has.
#include <fmt/format.h>

#include "commands.h"
#include "config/settings.h"
#include "core/error.h"
#include "cuda/device.h"
#include "plan/preflight.h"

namespace ft::app {

Run add_plan(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plan",
      "Show the memory, disk, communication and start-up time a job needs, and whether "
      "it fits (before anything is allocated)");
  struct Args {
    std::string preset, model, output, gpu_memory, host_memory, disk_throughput;
    std::vector<std::string> sets;
    int nnodes = 1, nproc = 0;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--preset", a->preset, "Shipped preset name or a preset JSON file")->required();
  cmd->add_option("--model", a->model,
                  "Hugging Face model directory: its config.json and safetensors headers are "
                  "read (never the weights); default: the preset's model shape");
  cmd->add_option("--set", a->sets, "Override a key: --set train.micro_batch=2 (repeatable)");
  cmd->add_option("--nnodes", a->nnodes, "Nodes of the job")->check(CLI::Range(1, 100000));
  cmd->add_option("--nproc-per-node", a->nproc,
                  "Ranks per node (default: the GPUs visible here for a GPU job, else 1)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--gpu-memory", a->gpu_memory,
                  "Memory of each GPU, e.g. 80GiB (default: the least free memory of this "
                  "machine's GPUs); plans for GPUs even on a machine without one");
  cmd->add_option("--host-memory", a->host_memory,
                  "Host memory of each node, e.g. 768GiB (default: this machine's MemAvailable "
                  "or cgroup limit)");
  cmd->add_option("--disk-throughput", a->disk_throughput,
                  "Read throughput of the model files per second, e.g. 2GB (default: measured on "
                  "--model's largest file, else 1 GB/s)");
  cmd->add_option("--output", a->output, "Where the run would write: its free disk is checked");
  cmd->add_flag("--json", a->json, "Print the plan as one JSON object");
  return [a]() -> int {
    const int64_t gpu_bytes =
        a->gpu_memory.empty() ? 0 : plan::parse_size(a->gpu_memory, "--gpu-memory");
    const int64_t host_bytes =
        a->host_memory.empty() ? 0 : plan::parse_size(a->host_memory, "--host-memory");
    plan::PlanInputs in;
    in.settings = config::resolve_settings(a->preset, a->sets);
    in.model_dir = a->model;
    const std::string& dev = in.settings.hardware.device;
    int visible = 0;
    if (dev != "cpu") {
      const cuda::DeviceProbe probe = cuda::probe_devices();
      if (probe.cuda_compiled) visible = probe.visible_gpus;
    }
    // auto: GPUs when this machine has them, when --gpu-memory asks for them, or when the preset
    // offloads to host memory (a GPU-only setting).
    const auto& st = in.settings.strategy;
    const bool offloads =
        st.zero3.offload_optimizer || st.zero3.offload_param || st.fsdp.cpu_offload;
    in.layout.gpu =
        dev == "cuda" || (dev == "auto" && (!a->gpu_memory.empty() || visible > 0 || offloads));
    FT_CHECK(!(dev == "cpu" && !a->gpu_memory.empty()),
             "--gpu-memory plans for GPUs but hardware.device is cpu; drop one of them");
    in.layout.nnodes = a->nnodes;
    in.layout.nproc_per_node = a->nproc > 0 ? a->nproc : (in.layout.gpu ? std::max(1, visible) : 1);
    const plan::Machine machine = plan::probe_machine(a->output);
    in.budget = plan::machine_budget(machine, 0, a->model);
    if (a->output.empty()) in.budget.disk_bytes = 0;  // checked only where the run would write
    if (gpu_bytes > 0) {
      in.budget.gpu_bytes = gpu_bytes;
      in.budget.gpu_from = "--gpu-memory";
    }
    if (!a->disk_throughput.empty()) {
      in.budget.disk_read_bytes_per_s =
          static_cast<double>(plan::parse_size(a->disk_throughput, "--disk-throughput"));
      in.budget.disk_read_from = "--disk-throughput";
    }
    if (host_bytes > 0) {
      in.budget.host_bytes = host_bytes;
      in.budget.host_from = "--host-memory";
    }
    const plan::Plan p = plan::make_plan(in);
    if (a->json)
      fmt::print("{}\n", plan::plan_json(p).dump(2));
    else
      fmt::print("{}", plan::plan_text(p));
    return p.fits() ? 0 : 1;
  };
}

}  // namespace ft::app

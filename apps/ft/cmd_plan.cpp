// `ft plan --preset NAME|FILE [every other ft train option] [--nnodes N] [--nproc-per-node G]
// [--gpu-memory SIZE] [--host-memory SIZE] [--disk-throughput SIZE] [--host-bandwidth SIZE]
// [--host-cores N] [--json]`: what the job needs
// per rank, per node, on disk and on the wire, against what this machine (or the sizes given) has.
// It takes ft train's options (train_options.h), so a train command pastes into it.
#include <fmt/format.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "config/settings.h"
#include "core/error.h"
#include "core/strings.h"
#include "cuda/device.h"
#include "data/mixture.h"
#include "plan/preflight.h"
#include "train_options.h"

namespace ft::app {

namespace {

// ft plan runs on one machine (a laptop, a login node) and plans for others: the per-node figures
// not given on the command line are this machine's. Said, with the options that give the nodes'
// own, when the plan is for several nodes or for GPUs this machine does not have; "" otherwise.
std::string borrowed_figures_note(const plan::Budget& b, const plan::Plan& p, bool host_memory,
                                  bool gpu_memory, bool elsewhere) {
  if (!elsewhere) return "";
  std::vector<std::pair<std::string, std::string>> borrowed;  // figure, the option that gives it
  if (!host_memory && b.host_bytes > 0)
    borrowed.push_back(
        {fmt::format("host memory ({})", human_bytes(b.host_bytes)), "--host-memory"});
  if (p.layout.gpu && !gpu_memory && b.gpu_bytes > 0)
    borrowed.push_back({fmt::format("GPU memory ({})", human_bytes(b.gpu_bytes)), "--gpu-memory"});
  if (b.host_cores_from.empty() && b.host_cores > 0)
    borrowed.push_back({fmt::format("cores ({})", b.host_cores), "--host-cores"});
  if (b.host_memory_from == "measured on this machine" && b.host_memory_bps > 0)
    borrowed.push_back({fmt::format("memory bandwidth ({}/s)",
                                    human_bytes(static_cast<int64_t>(b.host_memory_bps))),
                        "--host-bandwidth"});
  if (borrowed.empty()) return "";
  std::string figures, options;
  for (size_t i = 0; i < borrowed.size(); ++i) {
    const char* sep = i == 0 ? "" : i + 1 == borrowed.size() ? " and " : ", ";
    figures += sep + borrowed[i].first;
    options += sep + borrowed[i].second;
  }
  return fmt::format(
      "this plan is for {} node(s){} but runs here: each node's {} {} this machine's; give the "
      "nodes' own with {}",
      p.layout.nnodes, p.layout.gpu ? fmt::format(" of {} GPU(s)", p.layout.nproc_per_node) : "",
      figures, borrowed.size() == 1 ? "is" : "are", options);
}

}  // namespace

Run add_plan(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plan",
      "Show the memory, disk, communication and start-up time a job needs, and whether "
      "it fits (before anything is allocated)");
  struct Args {
    TrainCommandLine train;  // --preset, --model, --data, --output, --set, ... as ft train's
    std::string gpu_memory, host_memory, disk_throughput, host_bandwidth;
    int nnodes = 1, nproc = 0, host_cores = 0;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  cmd->footer(
      "Takes every ft train option, so a train command pastes in: --preset (required), --model "
      "(a directory or a hub id in the local hub cache; its config.json and safetensors headers "
      "are read, never the weights; with config.json alone, before the download, the files' "
      "size is estimated from its shapes; default: the preset's model shape), --set, --output "
      "(its free disk is checked), --data (must exist), --tokenizer, --data-cache and --resume.");
  a->train.add_to(cmd, /*require=*/false, "Training options (as ft train takes them)");
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
  cmd->add_option("--host-bandwidth", a->host_bandwidth,
                  "Memory bandwidth of each node per second, e.g. 300GB, which its ranks' host "
                  "optimizer steps share (default: measured on this machine when the optimizer "
                  "is offloaded)");
  cmd->add_option("--host-cores", a->host_cores,
                  "CPU cores of each node, shared out among its ranks' host optimizer steps "
                  "(default: this machine's)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_flag("--json", a->json, "Print the plan as one JSON object");
  return [a]() -> int {
    FT_CHECK(!a->train.value("preset").empty(),
             "--preset is required (a shipped name or a preset JSON file)");
    for (const std::string& arg : a->train.values("data")) {
      const std::string data = data::parse_data_arg(arg).settings.path;
      FT_CHECK(std::filesystem::exists(data), "--data ", data, ": no such file");
    }
    a->train.resolve_model("ft plan", a->json ? stderr : stdout);  // --json: stdout is the JSON
    const std::string model = a->train.value("model"), output = a->train.value("output");
    const int64_t gpu_bytes =
        a->gpu_memory.empty() ? 0 : plan::parse_size(a->gpu_memory, "--gpu-memory");
    const int64_t host_bytes =
        a->host_memory.empty() ? 0 : plan::parse_size(a->host_memory, "--host-memory");
    plan::PlanInputs in;
    in.settings = config::resolve_settings(a->train.value("preset"), a->train.values("set"));
    in.model_dir = model;
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
    const plan::Machine machine = plan::probe_machine(output);
    in.budget =
        plan::machine_budget(machine, 0, model, plan::host_step(st) && a->host_bandwidth.empty());
    if (!a->host_bandwidth.empty()) {
      in.budget.host_memory_bps =
          static_cast<double>(plan::parse_size(a->host_bandwidth, "--host-bandwidth"));
      in.budget.host_memory_from = "--host-bandwidth";
    }
    if (a->host_cores > 0) {
      in.budget.host_cores = a->host_cores;
      in.budget.host_cores_from = "--host-cores";
    }
    if (output.empty()) in.budget.disk_bytes = 0;  // checked only where the run would write
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
    plan::Plan p = plan::make_plan(in);
    // Several nodes, or GPUs this machine does not have: the nodes are elsewhere.
    const bool elsewhere = a->nnodes > 1 || (in.layout.gpu && visible == 0);
    if (const std::string note =
            borrowed_figures_note(in.budget, p, host_bytes > 0, gpu_bytes > 0, elsewhere);
        !note.empty())
      p.notes.push_back(note);
    if (a->json)
      fmt::print("{}\n", plan::plan_json(p).dump(2));
    else
      fmt::print("{}", plan::plan_text(p));
    return p.fits() ? 0 : 1;
  };
}

}  // namespace ft::app

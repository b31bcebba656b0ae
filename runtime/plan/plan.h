// The preflight plan of a training job: from the settings, the model's config.json and safetensors
// headers (never the weight data; config.json alone before the download) or the preset's shape,
// and the job's layout (nodes x ranks per node, GPU or CPU), what each rank needs on its device,
// what each node needs in host memory, the disk a run's checkpoints take, the bytes each rank
// communicates per step, and the time to the first step. Model-state figures come from the
// engine's own layout (parallel/units.h), so they equal the runtime's accounting; activations,
// logits and buffers follow the formulas of docs/planning.md. Pure apart from reading config.json
// and the headers; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/settings.h"
#include "model/config.h"

namespace ft::plan {

// The job the plan is for.
struct Layout {
  int nnodes = 1;
  int nproc_per_node = 1;
  bool gpu = false;  // ranks train on GPUs (else on CPU: device memory is host memory)
  int world() const { return nnodes * nproc_per_node; }
};

// What a rank or a node may use. 0: unknown (not checked).
struct Budget {
  int64_t gpu_bytes = 0;   // free memory of each rank's GPU
  int64_t host_bytes = 0;  // host memory of each node (all local ranks together)
  int64_t disk_bytes = 0;  // free space where --output goes
  std::string gpu_from, host_from, disk_from;  // "--gpu-memory", "this machine: MemAvailable", ...
  double disk_read_bytes_per_s = 0;            // model files' read throughput (0: assume 1 GB/s)
  std::string disk_read_from;
  double init_elements_per_s = 0;  // random-init draws per second (0: assume 2e8)
  // The host AdamW step (clip factor, zeroing and copy-out in its pass) per parameter on one
  // thread of this machine, and this machine's cores (0: assume 0.5 ns and the cores of none).
  double host_adamw_ns = 0;
  int host_cores = 0;
  std::string host_cores_from;  // "" (this machine's) or "--host-cores"
  // Bytes per second through a node's memory in the host step's pattern, on all its cores
  // (measure_host_memory_bps), which the node's ranks share when their host steps run at once
  // (0: unknown; the host step is then planned from its time per thread alone).
  double host_memory_bps = 0;
  std::string host_memory_from;
  // Resident memory of one ft process before it allocates anything (LibTorch, threads, code):
  // measured on this machine by the caller (0: assume 200 MiB).
  int64_t process_bytes = 0;
  std::string process_from;
};

struct PlanInputs {
  config::Settings settings;
  std::string model_dir;  // "": the preset's model shape, random init
  Layout layout;
  Budget budget;
};

// One figure with the inputs it came from.
struct Item {
  std::string key;    // "optimizer_state"
  std::string label;  // "optimizer state (AdamW exp_avg, exp_avg_sq, step)"
  int64_t bytes = 0;
  std::string from;  // "2 x 4 B x 437,207,040 elements + 4 B per group"
};

struct Check {
  std::string resource;  // "GPU memory" | "host memory" | "disk"
  std::string where;     // "each GPU (rank 0 needs most)" | "each node" | "--output's filesystem"
  int64_t need = 0, have = 0;
  std::string have_from;
  bool known() const { return have > 0; }
  bool fits() const { return !known() || need <= have; }
};

struct Suggestion {
  std::string what;               // "activation checkpointing of every layer"
  std::vector<std::string> sets;  // --set arguments that apply it
  int nnodes = 0;                 // > 0: run on this many nodes instead
  int64_t device_bytes = 0, host_bytes = 0;
  bool fits = false;
  int changes = 1;  // how many changes it makes together (0: the node count alone)
};

struct Plan {
  // What was planned.
  std::string model_from;  // "--model DIR/config.json" or "preset tiny-demo's model section"
  // --model holds config.json but no weight files yet: their bytes (reading them at start-up, the
  // loading buffers) are estimated from its shapes and dtype.
  bool model_files_estimated = false;
  std::string strategy;  // the strategy's label
  int64_t parameters = 0, trained_parameters = 0;
  // QLoRA (lora.quantize_base=nf4, or a model saved in NF4): the projections' parameters held in
  // NF4, their bytes (packed codes and fp32 absmax) and the largest one's (elements).
  int64_t nf4_parameters = 0, nf4_bytes = 0, largest_nf4 = 0;
  int64_t tokens_per_micro_batch = 0;
  Layout layout;
  // The rank that needs most, and why.
  int rank = 0;
  std::string rank_why;
  // Per rank on its device (a GPU; the host on a CPU job), and its peak.
  std::vector<Item> device;
  int64_t device_peak = 0;
  int64_t step_peak = 0;    // during a training step (the peak metrics.jsonl's steps measure)
  int64_t save_peak = 0;    // while rank 0 writes the final model
  std::string device_name;  // "GPU" | "host (CPU job)"
  // Per node in host memory (all local ranks), and its peak.
  std::vector<Item> host;
  int64_t host_peak = 0;
  // Model state of one rank, as the runtime accounts it (metrics.jsonl's memory section).
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  std::vector<Item> disk;
  int64_t disk_need = 0;
  std::vector<Item> comm;  // bytes per rank per optimizer step
  std::vector<Item> startup;
  double first_step_s = 0;
  // With the optimizer offloaded: the host's part of each step, per rank (its items' bytes are
  // those moved), and the model FLOPs per rank per step it compares with. With only the
  // parameter shards offloaded (offload_params_only; GPUs): their copies up.
  std::vector<Item> offload_step;
  double offload_step_s = 0;
  bool offload_delayed = false;  // strategy.zero3.delayed_update: the update overlaps the next step
  // strategy.overlap_host_step (without a delay): the update runs beside the next step's forward;
  // with train.grad_clip 0 (not fp16) it begins during the backward
  bool offload_overlapped = false, offload_during_backward = false;
  bool offload_params_only = false;
  double step_flops = 0;
  double host_memory_bps = 0;  // the budget's, which ft launch hands to its workers
  std::vector<Check> checks;
  std::vector<Suggestion> suggestions;  // when something does not fit
  // What the reader must know about the figures (ft plan's: a plan for nodes it does not run on
  // that takes this machine's figures for theirs), printed before the verdict.
  std::vector<std::string> notes;
  bool fits() const;
  // The first check that fails (nullptr when all fit).
  const Check* shortfall() const;
};

// The plan of `in`. ConfigError / FormatError for settings or model files it cannot plan (naming
// the file and key). With `suggest`, a plan that does not fit gets its suggestions, each
// re-planned.
Plan make_plan(const PlanInputs& in, bool suggest = true);

// Expert parallelism's token exchanges in one micro-batch of `mc` trained with `s`: dispatch and
// combine of every MoE layer in forward and backward, and again in the recompute of a layer under
// full activation checkpointing. The plan's all-to-all bytes and the doctor's call count.
int64_t expert_exchanges_per_micro_batch(const model::ModelConfig& mc, const config::Settings& s);

// The plan as text (what `ft plan` prints) and as one JSON object (`ft plan --json`).
std::string plan_text(const Plan& plan);
nlohmann::json plan_json(const Plan& plan);

// "needs 1.2 TiB of host memory on each node but 755 GiB is available (MemAvailable): 467 GiB
// short; first: <suggestion>" for the first failing check; "" when the plan fits.
std::string verdict(const Plan& plan);

}  // namespace ft::plan

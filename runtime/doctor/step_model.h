// The step-time model of `ft doctor --preset`: from the plan's communication per step, the FLOPs
// of the model and what this machine measured (one device's forward, backward and update of the
// preset's model; each collective's time against its size over each kind of group), the time of
// an optimizer step at the job's layout, split into compute, optimizer and communication with what
// overlap can hide; tokens/s against one device; and, when the scaling efficiency is below 70%,
// why and the alternatives re-predicted with the same figures (docs/doctor.md has the formulas).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/settings.h"
#include "plan/plan.h"

namespace ft::doctor {

// One collective's measured time per call against its size (nccl-tests' size: the whole buffer,
// the gathered output of an all-gather, the input of a reduce-scatter), sizes ascending.
struct Curve {
  std::vector<int64_t> bytes;
  std::vector<double> seconds;
  bool empty() const { return bytes.empty(); }
  // Log-log interpolation between the measured sizes; below the smallest, its time (latency);
  // above the largest, the largest's rate.
  double time(int64_t size) const;
};

// The collectives over one kind of group. all_to_all: the bytes each rank sends, in equal shares
// (expert parallelism's token exchange).
struct Curves {
  std::string what;  // "across nodes (2 ranks)"
  int ranks = 0;
  Curve all_reduce, all_gather, reduce_scatter, all_to_all;
  bool empty() const { return all_reduce.empty(); }
};

// One device training the preset's model alone, measured (or extrapolated from 1 and 2 layers).
struct ComputeProbe {
  double fwd_bwd_s = 0;        // forward + backward of one micro-batch, the whole model
  double optimizer_s = 0;      // clipping and AdamW over every trained parameter
  int64_t trained = 0;         // trained parameters it updated
  double flops_per_token = 0;  // the probed model's training FLOPs per token (model/flops.h)
  std::string from;
};

struct Measured {
  ComputeProbe probe;
  Curves world;  // all ranks of the job
  Curves intra;  // the ranks of one node (empty with one rank per node)
  Curves inter;  // one rank per node (empty on one node)
};

// One collective kind of the step.
struct CommPart {
  std::string op;     // "all-reduce" | "all-gather" | "reduce-scatter" | "all-to-all" | "scalars"
  std::string group;  // the curves' `what`
  int64_t calls = 0;
  int64_t bytes_per_call = 0;
  double seconds = 0;  // all calls
};

struct Prediction {
  double compute_s = 0;    // forward + backward of every micro-batch
  double optimizer_s = 0;  // this rank's update
  double comm_s = 0;       // all communication
  double hidden_s = 0;     // of comm_s, what overlap hides under compute
  double exposed_s = 0;    // comm_s - hidden_s
  double step_s = 0;
  double tokens_per_s = 0;  // the whole job
  double one_device_tokens_per_s =
      0;                  // one device with the same per-device batch, no communication
  double efficiency = 0;  // tokens_per_s / (world x one device)
  std::vector<CommPart> comm;
  std::string bottleneck;  // the collective and group that cost most
};

// The job as `ft doctor` sees it: settings, model directory ("" = the preset's shape), layout.
struct Job {
  config::Settings settings;
  std::string model_dir;
  plan::Layout layout;
};

// Throws ConfigError for settings the plan refuses.
Prediction predict(const Job& job, const Measured& m);

// An alternative, re-predicted.
struct Alternative {
  std::string what;  // "train.grad_accum=8 (8x the global batch per optimizer step)"
  Prediction prediction;
};
// The alternatives a job below 70% efficiency has: more gradient accumulation, fewer GPUs on one
// node, HYBRID_SHARD across nodes, LoRA, another strategy; each the same model with the same
// measurements. Those the settings refuse are left out.
std::vector<Alternative> alternatives(const Job& job, const Measured& m);

// The prediction (and alternatives, when below 70%) as the text `ft doctor` prints.
std::string prediction_text(const Job& job, const Prediction& p,
                            const std::vector<Alternative>& alts);

}  // namespace ft::doctor

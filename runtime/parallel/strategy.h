// The preset's strategy settings turned into an engine layout for this job: which ranks shard a
// parameter together (shard group), which hold copies of the same shard (replica group), and the
// knobs of ddp / zero3 / fsdp. Knobs that do not apply to the chosen strategy, or combinations this
// job cannot honour, are ConfigErrors. Pure functions; thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/dist_env.h"
#include "config/settings.h"
#include "parallel/engine.h"

namespace ft::parallel {

struct StrategyPlan {
  EngineOptions engine;
  std::string label;  // "fsdp HYBRID_SHARD: shard over 2 ranks x 2 replicas"
  int replicas = 1;   // copies of each shard (HYBRID_SHARD: the number of nodes)
  // Group-rank lists of this rank's shard and replica groups (world ranks).
  std::vector<int> shard_ranks, replica_ranks;
};

// The plan of `strategy` (its user_keys: the keys the user set, with where, for the knob checks)
// for this job; `precision_mode` is precision.mode (the compute dtype).
StrategyPlan plan_strategy(const config::StrategySettings& strategy,
                           const std::string& precision_mode, const comm::DistEnv& env,
                           at::Device device);

// The expert-parallel groups of a job (strategy.expert_parallel = N): the E experts of each MoE
// layer split over the N ranks of an EP group, EP rank p holding experts [p * E/N, (p + 1) * E/N).
// EP groups are contiguous world ranks ({g * N, ..., g * N + N - 1}), so with ranks numbered node
// by node they stay inside a node whenever N divides the ranks per node; the ranks that hold the
// same experts ({p, p + N, p + 2N, ...}: the expert-data-parallel group) reduce their gradients.
struct ExpertParallelLayout {
  int ep_size = 1;
  int ep_rank = 0;                   // this rank's place in its EP group
  int ep_group = 0;                  // which EP group (g), 0 .. world / N - 1
  std::vector<int> ep_ranks;         // world ranks of this rank's EP group, in EP-rank order
  std::vector<int> expert_dp_ranks;  // world ranks with this rank's EP rank, ascending
  bool within_node = true;           // every EP group lies on one node
};

// The layout for `rank` of `world_size` ranks, `ranks_per_node` per node (LOCAL_WORLD_SIZE).
// FT_CHECKs that `ep_size` is >= 1 and divides the world size, naming the divisors that would.
ExpertParallelLayout expert_parallel_layout(int world_size, int rank, int ep_size,
                                            int ranks_per_node);

// `mc` with rank env.rank's experts placed (ModelConfig::moe's ep_size and ep_rank) under
// strategy.expert_parallel = `n`, and that rank's layout in `layout`; `mc` itself for n == 1.
// FT_CHECKs, naming the key, that the model has MoE layers and that n divides the world size
// and the experts.
model::ModelConfig place_experts(const model::ModelConfig& mc, int64_t n, const comm::DistEnv& env,
                                 ExpertParallelLayout* layout = nullptr);

// Every parameter of `model` in file order (base, then LoRA adapters when `lora`), trained: the
// adapters for LoRA, every base weight otherwise. AdamW decays neither norms nor biases.
std::vector<ParamSpec> param_specs(model::DecoderModel& model, bool lora);

// A ParamSource reading the values the specs' tensors hold right now (a materialised model, or
// the CPU adapters of a meta model): copies nothing until asked.
ParamSource current_values(const std::vector<ParamSpec>& specs);

// A loaded engine for one process (world size 1, no communication) over a materialised model:
// what tests and benchmarks use.
std::unique_ptr<Engine> single_process_engine(model::DecoderModel& model, bool lora,
                                              at::ScalarType compute_dtype);

}  // namespace ft::parallel

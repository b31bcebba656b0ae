#include "parallel/strategy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <set>

#include "core/dtype.h"
#include "core/error.h"
#include "model/lora.h"

namespace ft::parallel {

StrategyPlan plan_strategy(const config::StrategySettings& strategy,
                           const std::string& precision_mode, const comm::DistEnv& env,
                           at::Device device) {
  const std::string& kind = strategy.kind;
  // A knob of another strategy is a mistake (a copied config, a typo in kind), not something to
  // ignore.
  for (const auto& [key, where] : strategy.user_keys) {
    // strategy.kind, strategy.overlap_comm ... (no further dot) apply to every kind.
    if (key.rfind("strategy.", 0) != 0 || key.find('.', 9) == std::string::npos) continue;
    const std::string owner = key.substr(9, key.find('.', 9) - 9);
    FT_CHECK(owner == kind, key, " (set in ", where, ") is a ", owner,
             " knob but strategy.kind is ", kind, "; remove it, or set strategy.kind=", owner);
  }
  const int W = env.world_size;
  StrategyPlan plan;
  EngineOptions& e = plan.engine;
  e.kind = kind;
  e.device = device;
  e.overlap_comm = strategy.overlap_comm;
  e.compute_dtype = parse_dtype(precision_mode);
  e.master_dtype = e.compute_dtype == at::kDouble ? at::kDouble : at::kFloat;
  e.reduce_dtype = e.master_dtype;
  for (int r = 0; r < W; ++r) plan.shard_ranks.push_back(r);
  // Offloading moves state from the GPU to host memory; a CPU job has nothing to move. Tests of
  // the offload code path on CPU say so with FT_ALLOW_CPU_OFFLOAD=1 (nothing is saved there).
  auto offload = [&](const char* key) {
    const char* allow = std::getenv("FT_ALLOW_CPU_OFFLOAD");
    FT_CHECK(device.is_cuda() || (allow && std::string(allow) == "1"), key,
             ": this run is on CPU, where parameters and optimizer state already live in host "
             "memory; remove it (it is for GPU runs)");
    return true;
  };
  // What is in host memory, and zero3's delayed update of it.
  auto offload_label = [&] {
    if (!e.offload_params && !e.offload_optimizer) return std::string();
    const bool delayed = kind == "zero3" && strategy.zero3.delayed_update;
    return fmt::format(
        "; in host memory: {}{}",
        e.offload_params && e.offload_optimizer
            ? "parameter shards, masters, gradients and optimizer state"
        : e.offload_params ? "parameter shards"
                           : "masters, gradients and optimizer state",
        delayed ? fmt::format("; delayed update after step {}", strategy.zero3.delayed_update_after)
                : std::string());
  };

  if (kind == "ddp") {
    e.shard_size = 1;
    e.buckets = true;
    e.bucket_bytes = static_cast<int64_t>(strategy.ddp.bucket_mb * 1024 * 1024);
    plan.label = fmt::format("ddp: replicated on {} ranks, {} MiB gradient buckets", W,
                             strategy.ddp.bucket_mb);
  } else if (kind == "zero3") {
    const config::Zero3Settings& z = strategy.zero3;
    e.offload_optimizer = z.offload_optimizer && offload("strategy.zero3.offload_optimizer");
    e.offload_params = z.offload_param && offload("strategy.zero3.offload_param");
    FT_CHECK(!z.delayed_update || z.offload_optimizer,
             "strategy.zero3.delayed_update delays the host optimizer step of "
             "strategy.zero3.offload_optimizer, which is off; set "
             "strategy.zero3.offload_optimizer=true or remove strategy.zero3.delayed_update");
    // fp32 with both offloads: the masters are the parameter shards the next step reads.
    FT_CHECK(!z.delayed_update || !z.offload_param || e.compute_dtype != e.master_dtype,
             "strategy.zero3.delayed_update with strategy.zero3.offload_param in ", precision_mode,
             ": the delayed step would write the parameter shards the next step reads (they are "
             "its masters); use bf16 or fp16, or remove one of the two");
    e.shard_size = W;
    e.reshard_after_forward = true;
    e.prefetch_elements = static_cast<int64_t>(z.prefetch_bucket_size);
    e.persistence_threshold = static_cast<int64_t>(z.param_persistence_threshold);
    e.reduce_bucket_elements = static_cast<int64_t>(z.reduce_bucket_size);
    plan.label = fmt::format(
        "zero3: every parameter of >= {} elements split over {} ranks, prefetch {} elements, "
        "reduce buckets of {} elements{}",
        e.persistence_threshold, W, e.prefetch_elements, e.reduce_bucket_elements, offload_label());
  } else {
    FT_CHECK(kind == "fsdp", "strategy.kind must be ddp, zero3 or fsdp, got '", kind, "'");
    const config::FsdpSettings& f = strategy.fsdp;
    // PyTorch's CPUOffload(offload_params=True): parameter shards and gradients in host memory,
    // the optimizer step on the CPU.
    e.offload_params = e.offload_optimizer = f.cpu_offload && offload("strategy.fsdp.cpu_offload");
    const std::string& param_dtype = f.param_dtype;
    const std::string& mode = precision_mode;
    FT_CHECK(param_dtype == "auto" || param_dtype == mode,
             "strategy.fsdp.param_dtype=", param_dtype, " differs from precision.mode=", mode,
             ": they are one policy (compute in param_dtype, fp32 masters); set precision.mode=",
             param_dtype, " or strategy.fsdp.param_dtype=auto");
    e.reduce_dtype = parse_dtype(f.reduce_dtype, "strategy.fsdp.reduce_dtype");
    if (e.compute_dtype == at::kDouble) e.reduce_dtype = at::kDouble;
    e.forward_prefetch = f.forward_prefetch;
    const std::string& bp = f.backward_prefetch;
    e.backward_prefetch = bp == "BACKWARD_PRE"    ? BackwardPrefetch::kPre
                          : bp == "BACKWARD_POST" ? BackwardPrefetch::kPost
                                                  : BackwardPrefetch::kNone;
    const std::string& ss = f.sharding_strategy;
    if (ss == "NO_SHARD") {
      e.shard_size = 1;
      e.buckets = true;
    } else if (ss == "HYBRID_SHARD") {
      FT_CHECK(env.nnodes >= 2 && env.local_world_size >= 2,
               "strategy.fsdp.sharding_strategy=HYBRID_SHARD shards inside a node and replicates "
               "across nodes, but this job has ",
               env.nnodes, " node(s) x ", env.local_world_size, " rank(s); use ",
               env.nnodes < 2 ? "FULL_SHARD on one node" : "NO_SHARD with one rank per node",
               " (or launch with --nnodes >= 2 and --nproc-per-node >= 2)");
      FT_CHECK(W == env.nnodes * env.local_world_size,
               "HYBRID_SHARD needs the same number of ranks on every node (world size ", W, ", ",
               env.nnodes, " nodes x ", env.local_world_size, ")");
      e.shard_size = env.local_world_size;
      plan.replicas = env.nnodes;
      const int node = env.rank / env.local_world_size, local = env.rank % env.local_world_size;
      plan.shard_ranks.clear();
      for (int r = 0; r < env.local_world_size; ++r)
        plan.shard_ranks.push_back(node * env.local_world_size + r);
      for (int n = 0; n < env.nnodes; ++n)
        plan.replica_ranks.push_back(n * env.local_world_size + local);
    } else {
      e.shard_size = W;
      e.reshard_after_forward = ss == "FULL_SHARD";
    }
    plan.label = fmt::format(
        "fsdp {}: {}{}", ss,
        e.shard_size > 1
            ? fmt::format("layers sharded over {} ranks x {} replicas", e.shard_size, plan.replicas)
            : std::string("replicated"),
        offload_label());
  }
  if (W == 1) {
    e.shard_size = 1;
    e.buckets = true;
    plan.label = kind + " on a single rank" + offload_label();
  }
  // Only shards are offloaded: with nothing split, the parameters would silently stay put.
  FT_CHECK(!e.offload_params || e.shard_size > 1,
           kind == "fsdp" ? "strategy.fsdp.cpu_offload" : "strategy.zero3.offload_param",
           " keeps parameter shards in host memory, but this job (", W, " rank(s), ",
           kind == "fsdp" ? strategy.fsdp.sharding_strategy : std::string("zero3"),
           ") splits nothing; run on 2 or more ranks with a sharding strategy, or remove it");
  return plan;
}

ExpertParallelLayout expert_parallel_layout(int world_size, int rank, int ep_size,
                                            int ranks_per_node) {
  FT_ASSERT(world_size >= 1 && rank >= 0 && rank < world_size && ranks_per_node >= 1, "rank ", rank,
            " of world size ", world_size, ", ", ranks_per_node, " per node");
  std::vector<int> divisors;
  for (int d = 1; d <= world_size; ++d)
    if (world_size % d == 0) divisors.push_back(d);
  FT_CHECK(ep_size >= 1 && world_size % ep_size == 0, "strategy.expert_parallel=", ep_size,
           " must divide the world size (", world_size, " ranks); use one of ",
           fmt::format("{}", fmt::join(divisors, ", ")));
  ExpertParallelLayout l;
  l.ep_size = ep_size;
  l.ep_rank = rank % ep_size;
  l.ep_group = rank / ep_size;
  for (int p = 0; p < ep_size; ++p) l.ep_ranks.push_back(l.ep_group * ep_size + p);
  for (int r = l.ep_rank; r < world_size; r += ep_size) l.expert_dp_ranks.push_back(r);
  // Nodes hold ranks_per_node consecutive ranks; a contiguous group of N fits in one exactly when
  // N divides that (or the whole job is one node).
  l.within_node = ranks_per_node >= world_size || ranks_per_node % ep_size == 0;
  return l;
}

model::ModelConfig place_experts(const model::ModelConfig& mc, int64_t n, const comm::DistEnv& env,
                                 ExpertParallelLayout* layout) {
  model::ModelConfig placed = mc;
  if (n == 1) return placed;
  FT_CHECK(mc.moe.enabled(), "strategy.expert_parallel=", n, ": the model (", mc.model_type,
           ") has no mixture-of-experts layers, so there are no experts to split; remove it");
  const ExpertParallelLayout l =
      expert_parallel_layout(env.world_size, env.rank, static_cast<int>(n), env.local_world_size);
  FT_CHECK(mc.moe.num_experts % n == 0, "strategy.expert_parallel=", n, " must divide the ",
           mc.moe.num_experts, " experts of each MoE layer; use a divisor of both ",
           mc.moe.num_experts, " and the world size (", env.world_size, " ranks)");
  placed.moe.ep_size = n;
  placed.moe.ep_rank = l.ep_rank;
  if (layout) *layout = l;
  return placed;
}

std::vector<ParamSpec> param_specs(model::DecoderModel& model, bool lora) {
  std::vector<ParamSpec> specs;
  auto decays = [](const std::string& n) {
    const bool bias = n.size() > 5 && n.compare(n.size() - 5, 5, ".bias") == 0;
    return n.find("norm") == std::string::npos && !bias;
  };
  const model::MoeConfig& moe = model.config().moe;
  // A LoRA run's fully trained tensors (the routers with lora.train_router) go by their PEFT
  // names among the adapters, not by their base names.
  std::set<const at::Tensor*> by_adapter_name;
  if (lora)
    for (auto& p : model::lora_parameters(model)) by_adapter_name.insert(p.tensor);
  for (auto& p : model.parameters()) {
    if (by_adapter_name.count(p.tensor)) continue;
    ParamSpec spec;
    spec.name = p.name;
    spec.slot = p.tensor;
    spec.trained = !lora;
    spec.decay = decays(p.name);
    // Expert parallelism: the model holds its local experts of each [E, ...] expert tensor.
    const bool expert = p.name.find(".mlp.experts.") != std::string::npos;
    if (moe.ep_size > 1 && expert) {
      spec.expert = true;
      spec.full_shape = p.tensor->sizes().vec();
      spec.full_shape[0] = moe.num_experts;
      spec.source_offset = moe.first_local_expert() * (p.tensor->numel() / moe.local_experts());
    }
    specs.push_back(std::move(spec));
  }
  if (lora)
    for (auto& p : model::lora_parameters(model)) {
      ParamSpec spec;
      spec.name = p.name;
      spec.slot = p.tensor;
      spec.trained = true;
      specs.push_back(std::move(spec));
    }
  return specs;
}

ParamSource current_values(const std::vector<ParamSpec>& specs) {
  std::map<std::string, at::Tensor> values;
  for (const auto& s : specs) values[s.name] = *s.slot;
  return [values](const std::string& name, int64_t b, int64_t e, const at::Tensor& dst) {
    dst.copy_(values.at(name).detach().reshape({-1}).slice(0, b, e));
  };
}

std::unique_ptr<Engine> single_process_engine(model::DecoderModel& model, bool lora,
                                              at::ScalarType compute_dtype) {
  EngineOptions o;
  o.kind = "single";
  o.buckets = true;
  o.compute_dtype = compute_dtype;
  o.master_dtype = compute_dtype == at::kDouble ? at::kDouble : at::kFloat;
  o.reduce_dtype = o.master_dtype;
  o.device = model.parameters().front().tensor->device();
  auto specs = param_specs(model, lora);
  auto source = current_values(specs);
  auto e = std::make_unique<Engine>(model, specs, o, Groups{});
  e->load(source);
  return e;
}

}  // namespace ft::parallel

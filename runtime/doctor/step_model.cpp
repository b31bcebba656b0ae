#include "doctor/step_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/strings.h"
#include "model/config.h"
#include "model/flops.h"
#include "parallel/strategy.h"
#include "train/saved_model.h"

namespace ft::doctor {

double Curve::time(int64_t size) const {
  FT_ASSERT(!bytes.empty() && bytes.size() == seconds.size(), "an empty curve");
  if (size <= bytes.front()) return seconds.front();
  if (size >= bytes.back())
    return seconds.back() * static_cast<double>(size) / static_cast<double>(bytes.back());
  size_t i = 1;
  while (bytes[i] < size) ++i;
  const double x0 = std::log(static_cast<double>(bytes[i - 1])),
               x1 = std::log(static_cast<double>(bytes[i])),
               y0 = std::log(std::max(seconds[i - 1], 1e-9)),
               y1 = std::log(std::max(seconds[i], 1e-9));
  const double f = (std::log(static_cast<double>(size)) - x0) / (x1 - x0);
  return std::exp(y0 + f * (y1 - y0));
}

namespace {

model::ModelConfig model_of(const Job& job) {
  return job.model_dir.empty() ? train::model_config_from_preset(job.settings.model)
                               : model::load_model_config(job.model_dir + "/config.json");
}

int64_t comm_bytes(const plan::Plan& p, const std::string& key) {
  for (const auto& i : p.comm)
    if (i.key == key) return i.bytes;
  return 0;
}

// The curves a world collective crosses: inside the node on one node, else the whole job's.
const Curves& world_curves(const Job& job, const Measured& m) {
  return job.layout.nnodes == 1 && !m.intra.empty() ? m.intra : m.world;
}

}  // namespace

Prediction predict(const Job& job, const Measured& m) {
  const config::Settings& s = job.settings;
  plan::PlanInputs in;
  in.settings = s;
  in.model_dir = job.model_dir;
  in.layout = job.layout;
  const plan::Plan plan = plan::make_plan(in, /*suggest=*/false);
  const model::ModelConfig mc = model_of(job);
  const int W = job.layout.world();
  comm::DistEnv env;
  env.world_size = W;
  env.local_world_size = job.layout.nproc_per_node;
  env.nnodes = job.layout.nnodes;
  const parallel::StrategyPlan sp =
      parallel::plan_strategy(s.strategy, s.precision.mode, env,
                              job.layout.gpu ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  const parallel::EngineOptions& eo = sp.engine;

  Prediction p;
  const int64_t micro = s.train.grad_accum;
  // Compute: the probe's micro-batch, as many as the step has, scaled by FLOPs when the job's
  // model work differs from the probe's (LoRA against full); the update of this rank's elements
  // (AdamW: 8 bytes of state each) at the probe's rate.
  const double flops =
      model::training_flops(mc, s.data.seq_len,
                            s.lora.enabled ? s.lora.target_modules : std::vector<std::string>{},
                            s.lora.r)
          .per_token();
  const double scale = m.probe.flops_per_token > 0 ? flops / m.probe.flops_per_token : 1.0;
  p.compute_s = m.probe.fwd_bwd_s * scale * static_cast<double>(micro);
  if (m.probe.trained > 0)
    p.optimizer_s = m.probe.optimizer_s * static_cast<double>(plan.optimizer_bytes) / 8.0 /
                    static_cast<double>(m.probe.trained);

  if (W > 1) {
    const Curves& wc = world_curves(job, m);
    // HYBRID_SHARD: shards inside a node, replicas across nodes.
    const bool hybrid = sp.replicas > 1;
    const Curves& shard_c = hybrid && !m.intra.empty() ? m.intra : wc;
    const Curves& replica_c = hybrid && !m.inter.empty() ? m.inter : wc;
    const int64_t units = mc.num_hidden_layers + 1;
    auto add = [&](const std::string& op, const Curves& c, const Curve& curve, int64_t calls,
                   int64_t total) {
      if (total <= 0 || calls <= 0 || curve.empty()) return;
      CommPart part{op, c.what, calls, total / calls, 0};
      part.seconds = static_cast<double>(calls) * curve.time(part.bytes_per_call);
      p.comm.push_back(part);
    };
    const int64_t ag = comm_bytes(plan, "all_gather"), rs = comm_bytes(plan, "reduce_scatter"),
                  ar = comm_bytes(plan, "all_reduce");
    if (ag > 0) {
      const int64_t per_micro = units + (eo.reshard_after_forward ? units - 1 : 0);
      add("all-gather", shard_c, shard_c.all_gather, micro * per_micro, ag);
    }
    if (rs > 0) add("reduce-scatter", shard_c, shard_c.reduce_scatter, micro * units, rs);
    if (ar > 0) {
      const Curves& c = hybrid ? replica_c : wc;
      const int64_t calls = eo.buckets
                                ? std::max<int64_t>(1, (ar + eo.bucket_bytes - 1) / eo.bucket_bytes)
                                : (eo.shard_size > 1 ? units : 1);
      add("all-reduce", c, c.all_reduce, calls, ar);
    }
    // Expert parallelism's token exchange (the plan's all_to_all): each MoE layer's dispatch and
    // combine, in forward and backward (and the recompute of a checkpointed layer), over the EP
    // group, inside a node when the group fits one. The plan's bytes are what leaves the rank,
    // against curves of what each rank sends in all (its own share included): a slight
    // over-estimate of the time.
    if (const int64_t a2a = comm_bytes(plan, "all_to_all"); a2a > 0) {
      const int64_t ep = s.strategy.expert_parallel;
      const bool in_node = job.layout.nproc_per_node % ep == 0 && !m.intra.empty();
      const Curves& c = in_node ? m.intra : wc;
      add("all-to-all", c, c.all_to_all, micro * plan::expert_exchanges_per_micro_batch(mc, s),
          a2a);
    }
    // The step's small collectives: token count, gradient norm, the checkpointer's agreement and
    // the ranks' busy times.
    if (!wc.empty()) {
      CommPart scalars{"scalars", wc.what, 4, 8, 4 * wc.all_reduce.time(8)};
      p.comm.push_back(scalars);
    }
    double largest_call = 0, overlappable = 0;
    for (const auto& c : p.comm) {
      p.comm_s += c.seconds;
      // Each waited for at once, never hidden: the scalars, and the token exchange (a MoE
      // layer waits for its rows).
      if (c.op == "scalars" || c.op == "all-to-all") continue;
      overlappable += c.seconds;
      largest_call = std::max(largest_call, c.seconds / static_cast<double>(c.calls));
    }
    // Overlap: a collective runs under the compute that does not need its result. The last
    // gradient bucket (ddp) or the first gather and last reduce (sharded) cannot be hidden, nor
    // more than the compute there is. On CPUs nothing is: Gloo moves and reduces the bytes on the
    // same cores the compute keeps busy (measured: bench/doctor_accuracy.sh).
    if (s.strategy.overlap_comm && job.layout.gpu) {
      const double hideable =
          eo.shard_size > 1 || sp.replicas > 1 ? p.compute_s : p.compute_s * 2.0 / 3.0;
      const double unhideable = (eo.shard_size > 1 ? 2 : 1) * largest_call;
      p.hidden_s = std::clamp(overlappable - unhideable, 0.0, hideable);
    }
    p.exposed_s = p.comm_s - p.hidden_s;
    const CommPart* worst = nullptr;
    for (const auto& c : p.comm)
      if (!worst || c.seconds > worst->seconds) worst = &c;
    if (worst)
      p.bottleneck = fmt::format("{} {} x {} over {}: {} per step", worst->calls, worst->op,
                                 human_bytes(worst->bytes_per_call), worst->group,
                                 human_seconds(worst->seconds));
  }
  p.step_s = p.compute_s + p.optimizer_s + p.exposed_s;
  const double tokens = static_cast<double>(s.train.micro_batch * s.data.seq_len * micro);
  const double one = p.compute_s + p.optimizer_s;
  p.tokens_per_s = p.step_s > 0 ? W * tokens / p.step_s : 0;
  p.one_device_tokens_per_s = one > 0 ? tokens / one : 0;
  p.efficiency = p.step_s > 0 ? one / p.step_s : 0;
  return p;
}

namespace {
// The least gain in efficiency (a fraction) a larger grad_accum must bring to be advised.
constexpr double kMinGain = 0.01;
}  // namespace

std::vector<Alternative> alternatives(const Job& job, const Measured& m) {
  std::vector<Alternative> out;
  auto attempt = [&](const std::string& what, Job variant) {
    try {
      out.push_back({what, predict(variant, m)});
    } catch (const Error&) {
      // a variant the settings refuse (a knob of another strategy) is not offered
    }
  };
  const config::Settings& s = job.settings;
  const int W = job.layout.world();
  if (W == 1) return out;
  // More micro-batches per optimizer step: the same communication over more compute. Offered
  // only while each doubling raises the efficiency by a point or more: where communication is not
  // what limits the step, a larger batch buys nothing and is not advice.
  double best = predict(job, m).efficiency;
  for (int k : {2, 4, 8, 16, 32}) {
    Job v = job;
    v.settings.train.grad_accum = s.train.grad_accum * k;
    const std::string what = fmt::format(
        "train.grad_accum={} ({}x the global batch per optimizer step: lower the step count or "
        "raise the learning rate to match)",
        v.settings.train.grad_accum, k);
    const size_t before = out.size();
    attempt(what, v);
    if (out.size() == before) break;
    if (out.back().prediction.efficiency < best + kMinGain) {
      out.pop_back();
      break;
    }
    best = out.back().prediction.efficiency;
    if (best >= 0.7) break;
  }
  // Fewer GPUs: the ranks of one node, or one device.
  if (job.layout.nnodes > 1 && job.layout.nproc_per_node > 1) {
    Job v = job;
    v.layout.nnodes = 1;
    attempt(fmt::format("one node: --nnodes 1 --nproc-per-node {} (no traffic between nodes)",
                        job.layout.nproc_per_node),
            v);
  }
  {
    Job v = job;
    v.layout.nnodes = 1;
    v.layout.nproc_per_node = 1;
    attempt("one device (no communication at all)", v);
  }
  // Shards inside a node and replicas across nodes.
  if (job.layout.nnodes > 1 && job.layout.nproc_per_node > 1 && s.strategy.kind != "ddp") {
    Job v = job;
    v.settings.strategy.kind = "fsdp";
    v.settings.strategy.fsdp.sharding_strategy = "HYBRID_SHARD";
    attempt(
        "strategy.kind=fsdp strategy.fsdp.sharding_strategy=HYBRID_SHARD (gathers inside "
        "each node; only the gradients' all-reduce crosses nodes)",
        v);
  }
  // LoRA: only the adapters' gradients travel.
  if (!s.lora.enabled) {
    Job v = job;
    v.settings.lora.enabled = true;
    attempt(fmt::format("lora.enabled=true (rank {}: only the adapters' gradients are "
                        "all-reduced; the frozen weights need no optimizer state)",
                        s.lora.r),
            v);
  }
  // Another strategy.
  for (const char* kind : {"ddp", "zero3", "fsdp"}) {
    if (s.strategy.kind == kind) continue;
    Job v = job;
    v.settings.strategy.kind = kind;
    attempt(fmt::format("strategy.kind={}", kind), v);
  }
  std::stable_sort(out.begin(), out.end(), [](const Alternative& a, const Alternative& b) {
    return a.prediction.tokens_per_s > b.prediction.tokens_per_s;
  });
  return out;
}

std::string prediction_text(const Job& job, const Prediction& p,
                            const std::vector<Alternative>& alts) {
  const auto& s = job.settings;
  std::string o = fmt::format(
      "step-time model: {} on {} node{} x {} rank{} ({}), {} x {} sequences of {} tokens per rank "
      "per step\n",
      s.name, job.layout.nnodes, job.layout.nnodes == 1 ? "" : "s", job.layout.nproc_per_node,
      job.layout.nproc_per_node == 1 ? "" : "s", s.strategy.kind, s.train.grad_accum,
      s.train.micro_batch, s.data.seq_len);
  auto ms = [](double x) { return human_seconds(x); };
  o += fmt::format("  compute (forward + backward): {}\n", ms(p.compute_s));
  o += fmt::format("  optimizer:                    {}\n", ms(p.optimizer_s));
  for (const auto& c : p.comm)
    o += fmt::format("  {:<14} {:>4} x {:>9} over {}: {}\n", c.op, c.calls,
                     human_bytes(c.bytes_per_call), c.group, ms(c.seconds));
  o += fmt::format("  communication: {}, of which overlap hides {}: {} exposed\n", ms(p.comm_s),
                   ms(p.hidden_s), ms(p.exposed_s));
  o += fmt::format(
      "  predicted step: {}; {:.4g} tokens/s for the job against {:.4g} on one device: scaling "
      "efficiency {:.0f}%\n",
      ms(p.step_s), p.tokens_per_s, p.one_device_tokens_per_s, 100 * p.efficiency);
  if (job.layout.world() > 1 && p.efficiency < 0.7) {
    o += fmt::format(
        "warning: scaling efficiency {:.0f}% is below 70%: {} of the {} step is exposed "
        "communication; the largest part is {}\n",
        100 * p.efficiency, ms(p.exposed_s), ms(p.step_s), p.bottleneck);
    o += "what to do (predicted with the same measurements, best first):\n";
    for (const auto& a : alts)
      o += fmt::format("  - {}: step {}, {:.4g} tokens/s, efficiency {:.0f}%{}\n", a.what,
                       ms(a.prediction.step_s), a.prediction.tokens_per_s,
                       100 * a.prediction.efficiency,
                       a.prediction.tokens_per_s > p.tokens_per_s ? "" : " (slower than now)");
  }
  return o;
}

}  // namespace ft::doctor

#include "doctor/doctor.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/dist_env.h"
#include "comm/process_group.h"
#include "config/settings.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/strings.h"
#include "cuda/device.h"
#include "cuda/loader.h"
#include "doctor/step_model.h"
#include "io/durable_file.h"
#include "model/decoder.h"
#include "model/flops.h"
#include "model/lora.h"
#include "parallel/strategy.h"
#include "plan/resources.h"
#include "train/device_peak.h"
#include "train/saved_model.h"
#include "train/stragglers.h"
#include "train/trainer.h"

namespace ft::doctor {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void sync(const at::Device& dev) {
  if (dev.is_cuda()) cuda::api().synchronize(dev.index());
}

// The context every phase needs: this rank, its device, the world group (null at world size 1).
struct Ctx {
  comm::DistEnv env;
  at::Device device{at::kCPU};
  std::unique_ptr<comm::ProcessGroup> world;
  bool rank0() const { return env.rank == 0; }
  void say(const std::string& line) const {
    if (!rank0()) return;
    fmt::print("ft doctor: {}\n", line);
    std::fflush(stdout);
  }
};

// An all-reduce (sum or max) of a few doubles over `g`.
std::vector<double> reduce(comm::ProcessGroup& g, const at::Device& dev, std::vector<double> v,
                           bool max) {
  std::vector<at::Tensor> t{
      at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::kDouble).to(dev, true)};
  c10d::AllreduceOptions o;
  o.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  g.backend().allreduce(t, o)->wait();
  const at::Tensor h = t[0].cpu();
  return {h.data_ptr<double>(), h.data_ptr<double>() + h.numel()};
}

// Every rank's `mine` (the same length on each), in group-rank order.
std::vector<double> gather(comm::ProcessGroup& g, const at::Device& dev,
                           const std::vector<double>& mine) {
  std::vector<double> all(mine.size() * static_cast<size_t>(g.size()), 0.0);
  std::copy(mine.begin(), mine.end(),
            all.begin() + static_cast<std::ptrdiff_t>(mine.size()) * g.rank());
  return reduce(g, dev, all, false);
}

void barrier(Ctx& c) {
  if (c.world) reduce(*c.world, c.device, {0.0}, false);
}

// ---- collectives ----

enum class Op { kAllReduce, kAllGather, kReduceScatter };
constexpr Op kOps[] = {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter};
const char* op_name(Op op) {
  return op == Op::kAllReduce   ? "all-reduce"
         : op == Op::kAllGather ? "all-gather"
                                : "reduce-scatter";
}
// nccl-tests' bus bandwidth factor: what each rank's link carries relative to the size.
double bus_factor(Op op, int n) {
  return op == Op::kAllReduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

void run_op(comm::ProcessGroup& g, Op op, at::Tensor& full, at::Tensor& part,
            const at::Device& dev) {
  c10d::Backend& b = g.backend();
  if (op == Op::kAllReduce) {
    std::vector<at::Tensor> v{full};
    b.allreduce(v)->wait();
  } else if (op == Op::kAllGather) {
    b._allgather_base(full, part)->wait();
  } else {
    b._reduce_scatter_base(part, full)->wait();
  }
  sync(dev);
}

// One collective from 1 KiB up to `max_bytes` (x4 each time) over `g`: the slowest rank's time per
// call at each size. Stops early once one call takes over a second.
Curve sweep_op(comm::ProcessGroup& g, Op op, const at::Device& dev, int64_t max_bytes,
               double seconds_per_size) {
  Curve c;
  const int n = g.size();
  for (int64_t size = 1024; size <= max_bytes; size *= 4) {
    const int64_t numel = (size / 4 + n - 1) / n * n;
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(dev);
    at::Tensor full = at::ones({numel}, opts), part = at::ones({numel / n}, opts);
    // Two warm-up calls (connections, buffers), then 3 batches sized from the second; the best
    // batch's time per call on each rank (a batch another process interrupted does not count),
    // the slowest rank's.
    run_op(g, op, full, part, dev);
    auto t0 = Clock::now();
    run_op(g, op, full, part, dev);
    const double warm = reduce(g, dev, {since(t0)}, true)[0];
    const int iters =
        std::clamp(static_cast<int>(seconds_per_size / 3 / std::max(warm, 1e-6)), 1, 20);
    double best = 1e30;
    for (int batch = 0; batch < 3; ++batch) {
      t0 = Clock::now();
      for (int i = 0; i < iters; ++i) run_op(g, op, full, part, dev);
      best = std::min(best, since(t0) / iters);
      if (warm > 0.3) break;  // a slow size: one batch is enough
    }
    const double per = reduce(g, dev, {best}, true)[0];
    c.bytes.push_back(numel * 4);
    c.seconds.push_back(per);
    if (per > 1.0) break;
  }
  return c;
}

Curves sweep(Ctx& ctx, comm::ProcessGroup& g, const std::string& what, int64_t max_bytes,
             double seconds_per_size, bool speaker) {
  Curves cs;
  cs.what = what;
  cs.ranks = g.size();
  for (Op op : kOps) {
    if (speaker)
      fmt::print("ft doctor: timing {} over {}, 1 KiB to {}\n", op_name(op), what,
                 human_bytes(max_bytes));
    std::fflush(stdout);
    Curve c = sweep_op(g, op, ctx.device, max_bytes, seconds_per_size);
    (op == Op::kAllReduce   ? cs.all_reduce
     : op == Op::kAllGather ? cs.all_gather
                            : cs.reduce_scatter) = std::move(c);
  }
  return cs;
}

double busbw(const Curve& c, size_t i, Op op, int n) {
  return static_cast<double>(c.bytes[i]) / c.seconds[i] * bus_factor(op, n);
}

std::string rate(double bytes_per_s) {
  if (bytes_per_s >= 1e9) return fmt::format("{:.2f} GB/s", bytes_per_s / 1e9);
  return fmt::format("{:.1f} MB/s", bytes_per_s / 1e6);
}

std::string curves_text(const Curves& cs) {
  std::string o =
      fmt::format("collectives over {} (time per call, nccl-tests' bus bandwidth):\n", cs.what);
  o += fmt::format("  {:>9}  {:>22}  {:>22}  {:>22}\n", "size", "all-reduce", "all-gather",
                   "reduce-scatter");
  const Curve* cols[] = {&cs.all_reduce, &cs.all_gather, &cs.reduce_scatter};
  size_t rows = 0;
  for (const Curve* c : cols) rows = std::max(rows, c->bytes.size());
  for (size_t i = 0; i < rows; ++i) {
    std::string line = fmt::format(
        "  {:>9}",
        human_bytes(cs.all_reduce.bytes.size() > i ? cs.all_reduce.bytes[i] : cols[1]->bytes[i]));
    for (int k = 0; k < 3; ++k) {
      const Curve& c = *cols[k];
      line += i < c.bytes.size() ? fmt::format("  {:>9.3f} ms {:>9}", c.seconds[i] * 1e3,
                                               rate(busbw(c, i, kOps[k], cs.ranks)))
                                 : fmt::format("  {:>22}", "-");
    }
    o += line + "\n";
  }
  return o;
}

// The bus bandwidth of the largest all-reduce measured: what the path sustains (a small one may
// ride a burst, a token bucket's or a switch's buffer).
double sustained_busbw(const Curves& cs) {
  if (cs.all_reduce.bytes.empty()) return 0;
  return busbw(cs.all_reduce, cs.all_reduce.bytes.size() - 1, Op::kAllReduce, cs.ranks);
}

json curves_json(const Curves& cs) {
  json j = {{"what", cs.what}, {"ranks", cs.ranks}};
  const Curve* cols[] = {&cs.all_reduce, &cs.all_gather, &cs.reduce_scatter};
  for (int k = 0; k < 3; ++k) {
    json rows = json::array();
    for (size_t i = 0; i < cols[k]->bytes.size(); ++i)
      rows.push_back({{"bytes", cols[k]->bytes[i]},
                      {"seconds", cols[k]->seconds[i]},
                      {"busbw_bytes_per_s", busbw(*cols[k], i, kOps[k], cs.ranks)}});
    j[op_name(kOps[k])] = rows;
  }
  return j;
}

// ---- one device training the preset's model alone ----

struct ProbeRun {
  double fwd_bwd_s = 0, optimizer_s = 0;
  int64_t trained = 0;
};

ProbeRun probe_layers(const config::Settings& s, const model::ModelConfig& base,
                      const std::string& model_dir, int64_t layers, const at::Device& dev) {
  const model::ModelConfig c = base.with_layers(layers);
  const at::ScalarType dtype = parse_dtype(s.precision.mode);
  model::DecoderModel m(c, at::TensorOptions().dtype(dtype).device(dev));
  m.init_random(static_cast<uint64_t>(s.train.seed));
  if (s.lora.enabled)
    model::attach_lora(m, train::lora_config_from_preset(s.lora, model_dir, &c),
                       static_cast<uint64_t>(s.train.seed) + 1);
  m.set_activation_checkpointing(
      model::parse_activation_checkpointing(s.train.activation_checkpointing),
      s.train.checkpoint_every_n_layers);
  m.set_fused_ops(train::fused_ops(s.train));
  auto engine = parallel::single_process_engine(m, s.lora.enabled, dtype);
  train::Trainer tr(m, train::train_options(s.train, s.precision, 1000), *engine);
  // (A private generator: the default one is left as it was.)
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  std::vector<double> fb, up;
  for (int i = 0; i < 5; ++i) {
    const at::Tensor ids =
        at::randint(c.vocab_size, {s.train.micro_batch, s.data.seq_len}, gen, at::kLong).to(dev);
    data::Batch b{ids, ids, at::Tensor(), at::Tensor()};
    auto t0 = Clock::now();
    auto st = tr.compute_gradients({b});
    sync(dev);
    const double t_fb = since(t0);
    t0 = Clock::now();
    tr.apply_update(st);
    sync(dev);
    if (i >= 2) {  // after two warm-up steps
      fb.push_back(t_fb);
      up.push_back(since(t0));
    }
  }
  ProbeRun r;
  r.fwd_bwd_s = train::lower_median(fb);
  r.optimizer_s = train::lower_median(up);
  for (const auto& mm : engine->masters()) r.trained += mm.tensor.numel();
  return r;
}

// The whole model's figures from probes of 1 and 2 layers (or the model itself when it has at
// most 2): the head and embedding cost what 1 layer's probe costs beyond a layer.
ComputeProbe probe(const config::Settings& s, const model::ModelConfig& mc,
                   const std::string& model_dir, const at::Device& dev, double matmul_flops_s) {
  ComputeProbe p;
  const int64_t L = mc.num_hidden_layers;
  p.flops_per_token =
      model::training_flops(mc, s.data.seq_len,
                            s.lora.enabled ? s.lora.target_modules : std::vector<std::string>{},
                            s.lora.r)
          .per_token();
  // The probe holds 2 layers, the embedding and the head with their gradients, masters and AdamW
  // state (about 20 B per parameter) and one micro-batch's activations: where that would take
  // more than half of what this device has free, compute is estimated from the matmul peak
  // instead (at 50% of it, a typical training MFU), and says so.
  const model::ModelConfig probed = mc.with_layers(std::min<int64_t>(L, 2));
  const double probe_bytes = 20.0 * static_cast<double>(probed.num_parameters()) +
                             4.0 * static_cast<double>(s.train.micro_batch * s.data.seq_len) *
                                 static_cast<double>(mc.vocab_size + 16 * mc.hidden_size);
  const plan::Machine machine = plan::probe_machine("");
  const double free_bytes =
      static_cast<double>(dev.is_cuda() ? machine.gpu_free : machine.host_available);
  if (free_bytes > 0 && probe_bytes > 0.5 * free_bytes) {
    const double tokens = static_cast<double>(s.train.micro_batch * s.data.seq_len);
    p.fwd_bwd_s = p.flops_per_token * tokens / (0.5 * matmul_flops_s);
    // AdamW reads and writes about 16 B per trained element; at 10 GB/s on a CPU, 1 TB/s on a GPU.
    int64_t trained = mc.num_parameters();
    if (s.lora.enabled) {
      const auto f = model::training_flops(mc, s.data.seq_len, s.lora.target_modules, s.lora.r);
      trained = f.adapter_weights;
    }
    p.trained = trained;
    p.optimizer_s = 32.0 * static_cast<double>(trained) / (dev.is_cuda() ? 1e12 : 1e10);
    p.from = fmt::format(
        "estimated, not measured: probing 2 layers needs about {}, more than half of the {} this "
        "device has free (the probe's limit, so the job's own use of the device is not "
        "disturbed); compute at 50% of the measured matmul peak",
        human_bytes(static_cast<int64_t>(probe_bytes)),
        human_bytes(static_cast<int64_t>(free_bytes)));
    return p;
  }
  if (L <= 2) {
    const ProbeRun r = probe_layers(s, mc, model_dir, L, dev);
    p.fwd_bwd_s = r.fwd_bwd_s;
    p.optimizer_s = r.optimizer_s;
    p.trained = r.trained;
    p.from = fmt::format("measured: the model's {} layers, {} x {} tokens", L, s.train.micro_batch,
                         s.data.seq_len);
    return p;
  }
  const ProbeRun one = probe_layers(s, mc, model_dir, 1, dev);
  const ProbeRun two = probe_layers(s, mc, model_dir, 2, dev);
  const auto extrapolate = [L](double a, double b) {
    return std::max(a, a + static_cast<double>(L - 1) * (b - a));
  };
  p.fwd_bwd_s = extrapolate(one.fwd_bwd_s, two.fwd_bwd_s);
  p.optimizer_s = extrapolate(one.optimizer_s, two.optimizer_s);
  p.trained = one.trained + (L - 1) * (two.trained - one.trained);
  p.from = fmt::format("measured on 1 and 2 layers, {} x {} tokens, extrapolated to {}",
                       s.train.micro_batch, s.data.seq_len, L);
  return p;
}

}  // namespace

int run_doctor(const DoctorOptions& o) {
  Ctx ctx;
  ctx.env = comm::read_dist_env();
  const comm::DistEnv& env = ctx.env;
  std::optional<config::Settings> settings;
  if (!o.preset.empty()) settings = config::resolve_settings(o.preset, o.sets);
  const cuda::DeviceChoice choice =
      cuda::choose_device(settings ? settings->hardware.device : "auto", env.local_rank);
  ctx.device = choice.device;
  if (ctx.device.is_cuda()) cuda::use_device(ctx.device.index());
  if (env.world_size > 1) {
    comm::ProcessGroupOptions po;
    po.device = ctx.device;
    po.timeout = std::chrono::seconds(120);
    ctx.world = std::make_unique<comm::ProcessGroup>(env, po);
  }
  const int64_t max_bytes = o.max_bytes > 0
                                ? o.max_bytes
                                : (ctx.device.is_cuda() ? int64_t{256} << 20 : int64_t{64} << 20);
  json report;
  ctx.say(fmt::format("{} node{} x {} rank{} per node, devices {} ({})", env.nnodes,
                      env.nnodes == 1 ? "" : "s", env.local_world_size,
                      env.local_world_size == 1 ? "" : "s", ctx.device.is_cuda() ? "cuda" : "cpu",
                      ctx.world ? ctx.world->backend_name() : "one process, no collectives"));

  // ---- devices: every rank at once ----
  ctx.say("timing each device's matrix multiplies");
  const at::ScalarType mm_dtype = ctx.device.is_cuda() ? at::kBFloat16 : at::kFloat;
  const train::PeakFlops mm =
      train::measure_matmul(ctx.device, mm_dtype, ctx.device.is_cuda() ? 8192 : 512, 0.3);
  double h2d = 0;
  if (ctx.device.is_cuda()) {
    const int64_t n = int64_t{256} << 20;
    at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    at::Tensor dev = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(ctx.device));
    dev.copy_(host, true);
    sync(ctx.device);
    const auto t0 = Clock::now();
    for (int i = 0; i < 4; ++i) dev.copy_(host, true);
    sync(ctx.device);
    h2d = 4.0 * static_cast<double>(n) / since(t0);
  }
  double disk = 0;
  std::string disk_from;
  if (!o.model_dir.empty() && env.local_rank == 0)
    disk = plan::measure_read_throughput(o.model_dir, &disk_from);
  std::vector<double> mine = {static_cast<double>(env.node_rank),
                              static_cast<double>(env.local_rank),
                              ctx.device.is_cuda() ? double(ctx.device.index()) : -1.0,
                              mm.flops_per_s,
                              h2d,
                              disk};
  const std::vector<double> all = ctx.world ? gather(*ctx.world, ctx.device, mine) : mine;
  std::vector<double> flops;
  for (int r = 0; r < env.world_size; ++r) flops.push_back(all[6 * r + 3]);
  const double median_flops = train::lower_median(flops);
  std::vector<int> node_of(env.world_size);
  for (int r = 0; r < env.world_size; ++r) node_of[r] = static_cast<int>(all[6 * r]);
  if (ctx.rank0()) {
    std::string t = fmt::format("devices ({} {} matmuls, the best of 5 rounds):\n",
                                ctx.device.is_cuda() ? "8192^3" : "512^3", dtype_name(mm_dtype));
    json devs = json::array();
    for (int r = 0; r < env.world_size; ++r) {
      const double* a = &all[6 * r];
      const int dev = static_cast<int>(a[2]);
      const std::string name = dev < 0 ? "cpu" : fmt::format("cuda:{}", dev);
      const bool slow = a[3] < 0.8 * median_flops;
      t += fmt::format(
          "  node {} rank {} ({}): {:.3g} TFLOP/s{}{}{}\n", node_of[r], r, name, a[3] / 1e12,
          a[4] > 0 ? fmt::format(", host to device {}", rate(a[4])) : "",
          a[5] > 0 ? fmt::format(", model files read at {}", rate(a[5])) : "",
          slow ? fmt::format("  <- SLOW: {:.0f}% of the median", 100 * a[3] / median_flops) : "");
      devs.push_back({{"rank", r},
                      {"node", node_of[r]},
                      {"device", name},
                      {"matmul_flops_per_s", a[3]},
                      {"h2d_bytes_per_s", a[4]},
                      {"disk_read_bytes_per_s", a[5]},
                      {"slow", slow}});
    }
    fmt::print("{}", t);
    std::fflush(stdout);
    report["devices"] = devs;
    if (!disk_from.empty()) report["disk_from"] = disk_from;
  }

  // ---- each node's GPU topology (local rank 0 of each node; through NVML) ----
  if (ctx.device.is_cuda()) {
    constexpr int kMax = 16;  // GPUs per node shown
    // Per node: the GPU count, then kMax x kMax codes: path index + 10 when P2P reads work.
    static const char* kPaths[] = {"X",   "NVLink", "same board", "PIX", "PXB",
                                   "PHB", "NODE",   "SYS",        "?"};
    std::vector<double> codes(1 + kMax * kMax, 0.0);
    if (env.local_rank == 0) {
      const plan::GpuLinks links = plan::probe_gpu_links();
      const int n = std::min(links.gpus, kMax);
      codes[0] = n;
      for (int a = 0; a < n; ++a)
        for (int b = 0; b < n; ++b) {
          const size_t k = static_cast<size_t>(a * links.gpus + b);
          int idx = 8;
          for (int i = 0; i < 9; ++i)
            if (links.path[k] == kPaths[i]) idx = i;
          codes[1 + a * kMax + b] = idx + (links.p2p_read[k] ? 10 : 0);
        }
    }
    const std::vector<double> nodes = ctx.world ? gather(*ctx.world, ctx.device, codes) : codes;
    if (ctx.rank0()) {
      json topo = json::array();
      std::string t =
          "GPU topology (NVML; * = no peer-to-peer reads: copies go through host memory):\n";
      for (int r = 0; r < env.world_size; ++r) {
        const double* c = &nodes[static_cast<size_t>(r) * codes.size()];
        if (all[6 * r + 1] != 0) continue;  // local rank 0 of each node
        const int n = static_cast<int>(c[0]);
        t += fmt::format("  node {}: {}\n", node_of[r], n == 0 ? "NVML shows no GPU" : "");
        json m = json::array();
        bool slow_pair = false;
        for (int a = 0; a < n; ++a) {
          std::string row = fmt::format("    GPU{:<2}", a);
          json mr = json::array();
          for (int b = 0; b < n; ++b) {
            const int code = static_cast<int>(c[1 + a * kMax + b]);
            const std::string path = kPaths[code % 10];
            const bool read = code >= 10;
            row += fmt::format(" {:>11}", path + (read || a == b ? "" : "*"));
            mr.push_back({{"path", path}, {"p2p_read", read}});
            if (a != b && !read) slow_pair = true;
          }
          t += row + "\n";
          m.push_back(mr);
        }
        if (slow_pair)
          t += fmt::format(
              "  node {}: some GPU pairs have no peer-to-peer path; NCCL copies "
              "through host memory between them (the collectives below show the "
              "cost)\n",
              node_of[r]);
        topo.push_back({{"node", node_of[r]}, {"gpus", m}});
      }
      fmt::print("{}", t);
      report["gpu_topology"] = topo;
    }
  } else {
    ctx.say("GPU topology: not applicable (CPU ranks)");
  }

  // ---- collectives ----
  Measured measured;
  if (ctx.world) {
    measured.world = sweep(ctx, *ctx.world, fmt::format("the whole job ({} ranks)", env.world_size),
                           max_bytes, o.seconds_per_size, ctx.rank0());
    barrier(ctx);
    // Inside each node (every node at once), when the job has more than one node.
    if (env.nnodes > 1 && env.local_world_size > 1) {
      std::vector<int> mates;
      for (int r = 0; r < env.world_size; ++r)
        if (node_of[r] == env.node_rank) mates.push_back(r);
      auto g = ctx.world->subgroup(fmt::format("doctor/node{}", env.node_rank), mates);
      Curves c = sweep(ctx, *g, fmt::format("one node ({} ranks)", mates.size()), max_bytes,
                       o.seconds_per_size, ctx.rank0());
      if (env.node_rank == 0) measured.intra = c;
      barrier(ctx);
    } else if (env.nnodes == 1) {
      measured.intra = measured.world;
    }
    // Across nodes: local rank 0 of each node.
    std::vector<int> leaders;
    for (int r = 0; r < env.world_size; ++r)
      if (all[6 * r + 1] == 0) leaders.push_back(r);
    if (env.nnodes > 1 && env.local_world_size > 1) {
      if (env.local_rank == 0) {
        auto g = ctx.world->subgroup("doctor/nodes", leaders);
        measured.inter =
            sweep(ctx, *g, fmt::format("across nodes ({} ranks, one per node)", leaders.size()),
                  max_bytes, o.seconds_per_size, ctx.rank0());
      }
      barrier(ctx);
    } else if (env.nnodes > 1) {
      measured.inter = measured.world;
    }
    // Node pairs, in rounds of disjoint pairs (the circle method), between local ranks 0.
    const int N = env.nnodes;
    std::vector<double> pair(static_cast<size_t>(N * N), 0.0);
    const int64_t pair_bytes = std::min<int64_t>(max_bytes, int64_t{8} << 20);
    if (N > 1) {
      ctx.say(fmt::format("timing a {} all-reduce between every pair of nodes",
                          human_bytes(pair_bytes)));
      const int M = N % 2 == 0 ? N : N + 1;  // with a bye when odd
      for (int round = 0; round < M - 1; ++round) {
        for (int k = 0; k < M / 2; ++k) {
          int a = k == 0 ? 0 : (round + k) % (M - 1) + 1;
          int b = (round + M - 1 - k) % (M - 1) + 1;
          if (k == 0) b = (round % (M - 1)) + 1;
          if (a > b) std::swap(a, b);
          if (b >= N || a == b) continue;
          if (env.local_rank == 0 && (env.node_rank == a || env.node_rank == b)) {
            auto g = ctx.world->subgroup(fmt::format("doctor/pair{}_{}", a, b),
                                         {leaders.at(a), leaders.at(b)});
            Curve c = sweep_op(*g, Op::kAllReduce, ctx.device, pair_bytes, o.seconds_per_size);
            // The largest size measured: its bus bandwidth (2 ranks: the size over the time).
            if (env.node_rank == a)
              pair[static_cast<size_t>(a * N + b)] =
                  static_cast<double>(c.bytes.back()) / c.seconds.back();
          }
        }
        barrier(ctx);
      }
      pair = reduce(*ctx.world, ctx.device, pair, false);
      for (int a = 0; a < N; ++a)
        for (int b = a + 1; b < N; ++b)
          pair[static_cast<size_t>(b * N + a)] = pair[static_cast<size_t>(a * N + b)];
    }
    if (ctx.rank0()) {
      fmt::print("{}", curves_text(measured.world));
      json coll = {{"world", curves_json(measured.world)}};
      if (!measured.intra.empty() && env.nnodes > 1) {
        fmt::print("{}", curves_text(measured.intra));
        coll["intra"] = curves_json(measured.intra);
      }
      if (!measured.inter.empty() && env.local_world_size > 1) {
        fmt::print("{}", curves_text(measured.inter));
        coll["inter"] = curves_json(measured.inter);
      }
      report["collectives"] = coll;
      if (N > 1) {
        std::string t = fmt::format(
            "node pairs: bus bandwidth of a {} all-reduce between the nodes' local rank 0:\n  "
            "{:>8}",
            human_bytes(pair_bytes), "");
        for (int b = 0; b < N; ++b) t += fmt::format(" {:>11}", fmt::format("node {}", b));
        t += "\n";
        std::vector<double> links;
        for (int a = 0; a < N; ++a) {
          t += fmt::format("  {:>8}", fmt::format("node {}", a));
          for (int b = 0; b < N; ++b)
            t += fmt::format(" {:>11}", a == b ? "-" : rate(pair[static_cast<size_t>(a * N + b)]));
          t += "\n";
          for (int b = a + 1; b < N; ++b) links.push_back(pair[static_cast<size_t>(a * N + b)]);
        }
        fmt::print("{}", t);
        report["pairs"] = {{"bytes", pair_bytes}, {"busbw_bytes_per_s", pair}};
        // A link well below the others' median is named, and a node whose links all are.
        // Against the best pair (a median would be a slow one when a third of 3 nodes' links are):
        // a link below half of it is slow; a node all of whose links are is the node's own fault
        // (its network interface, its switch port), not one link's.
        const double best = links.empty() ? 0 : *std::max_element(links.begin(), links.end());
        std::vector<bool> slow_node(static_cast<size_t>(N), false);
        for (int a = 0; N > 2 && a < N; ++a) {
          bool all_slow = true;
          for (int b = 0; b < N; ++b)
            if (b != a && pair[static_cast<size_t>(a * N + b)] >= 0.5 * best) all_slow = false;
          if (all_slow) {
            slow_node[static_cast<size_t>(a)] = true;
            fmt::print(
                "ft doctor: SLOW NODE: node {}: every link to it is below half the best "
                "pair's {}; look at its network interface and switch port\n",
                a, rate(best));
          }
        }
        for (int a = 0; a < N; ++a)
          for (int b = a + 1; b < N; ++b) {
            const double v = pair[static_cast<size_t>(a * N + b)];
            if (N > 2 && v < 0.5 * best && !slow_node[static_cast<size_t>(a)] &&
                !slow_node[static_cast<size_t>(b)])
              fmt::print(
                  "ft doctor: SLOW LINK: node {} - node {}: {} against {} for the best pair\n", a,
                  b, rate(v), rate(best));
          }
      }
      // The bottleneck: the slowest kind of path the job's collectives cross.
      std::string bottleneck;
      if (env.nnodes > 1) {
        const double across = sustained_busbw(measured.inter);
        const double inside = env.local_world_size > 1 ? sustained_busbw(measured.intra) : 0;
        bottleneck = fmt::format(
            "the network between nodes: {} bus bandwidth ({:.0f} Mbit/s) across nodes{}; every "
            "collective over the whole job runs at its pace",
            rate(across), across * 8 / 1e6,
            inside > 0
                ? fmt::format(" against {} inside a node ({:.0f}x)", rate(inside), inside / across)
                : "");
      } else {
        bottleneck = fmt::format("inside this node: {} bus bandwidth at the largest all-reduce",
                                 rate(sustained_busbw(measured.world)));
      }
      fmt::print("ft doctor: bottleneck: {}\n", bottleneck);
      report["bottleneck"] = bottleneck;
    }
  }

  // ---- the step-time model ----
  if (settings) {
    ctx.say(fmt::format("probing one device's training step of preset {}", settings->name));
    const model::ModelConfig mc = o.model_dir.empty()
                                      ? train::model_config_from_preset(settings->model)
                                      : model::load_model_config(o.model_dir + "/config.json");
    measured.probe = probe(*settings, mc, o.model_dir, ctx.device, mm.flops_per_s);
    if (ctx.world) {
      // The median rank's figures (ranks sharing a CPU probed at once, as they will train).
      const auto a =
          gather(*ctx.world, ctx.device, {measured.probe.fwd_bwd_s, measured.probe.optimizer_s});
      std::vector<double> fb, up;
      for (int r = 0; r < env.world_size; ++r) {
        fb.push_back(a[2 * r]);
        up.push_back(a[2 * r + 1]);
      }
      measured.probe.fwd_bwd_s = train::lower_median(fb);
      measured.probe.optimizer_s = train::lower_median(up);
    }
    if (ctx.rank0()) {
      Job job;
      job.settings = *settings;
      job.model_dir = o.model_dir;
      job.layout = {env.nnodes, env.local_world_size, ctx.device.is_cuda()};
      const Prediction p = predict(job, measured);
      const std::vector<Alternative> alts =
          p.efficiency < 0.7 ? alternatives(job, measured) : std::vector<Alternative>{};
      fmt::print("one device: forward + backward {} per micro-batch, update {} ({})\n",
                 human_seconds(measured.probe.fwd_bwd_s), human_seconds(measured.probe.optimizer_s),
                 measured.probe.from);
      fmt::print("{}", prediction_text(job, p, alts));
      json pj = {{"compute_s", p.compute_s},
                 {"optimizer_s", p.optimizer_s},
                 {"comm_s", p.comm_s},
                 {"hidden_s", p.hidden_s},
                 {"exposed_s", p.exposed_s},
                 {"step_s", p.step_s},
                 {"tokens_per_s", p.tokens_per_s},
                 {"one_device_tokens_per_s", p.one_device_tokens_per_s},
                 {"efficiency", p.efficiency},
                 {"bottleneck", p.bottleneck}};
      json aj = json::array();
      for (const auto& a : alts)
        aj.push_back({{"what", a.what},
                      {"step_s", a.prediction.step_s},
                      {"tokens_per_s", a.prediction.tokens_per_s},
                      {"efficiency", a.prediction.efficiency}});
      pj["alternatives"] = aj;
      report["prediction"] = pj;
    }
  }
  barrier(ctx);
  if (ctx.rank0() && !o.json_path.empty())
    io::write_file_durably(o.json_path, report.dump(2) + "\n");
  return 0;
}

}  // namespace ft::doctor

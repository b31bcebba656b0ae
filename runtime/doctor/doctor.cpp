#include "doctor/doctor.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
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

enum class Op { kAllReduce, kAllGather, kReduceScatter, kAllToAll };
constexpr Op kOps[] = {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter, Op::kAllToAll};
const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduce:
      return "all-reduce";
    case Op::kAllGather:
      return "all-gather";
    case Op::kReduceScatter:
      return "reduce-scatter";
    case Op::kAllToAll:
      break;
  }
  return "all-to-all";
}
// nccl-tests' bus bandwidth factor: what each rank's link carries relative to the size (for
// all-to-all the size is what each rank sends, a 1/n share to every rank, itself included).
double bus_factor(Op op, int n) {
  return op == Op::kAllReduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

// The curve of `op` in `cs` (Curves or const Curves).
template <typename C>
auto& curve_of(C& cs, Op op) {
  switch (op) {
    case Op::kAllReduce:
      return cs.all_reduce;
    case Op::kAllGather:
      return cs.all_gather;
    case Op::kReduceScatter:
      return cs.reduce_scatter;
    case Op::kAllToAll:
      break;
  }
  return cs.all_to_all;
}

// `full` and `other`: the size; `part`: a 1/n share of it. All-to-all sends `full` in equal
// shares and receives into `other` (as expert parallelism's token exchange does, even).
void run_op(comm::ProcessGroup& g, Op op, at::Tensor& full, at::Tensor& part, at::Tensor& other,
            const at::Device& dev) {
  c10d::Backend& b = g.backend();
  if (op == Op::kAllReduce) {
    std::vector<at::Tensor> v{full};
    b.allreduce(v)->wait();
  } else if (op == Op::kAllGather) {
    b._allgather_base(full, part)->wait();
  } else if (op == Op::kReduceScatter) {
    b._reduce_scatter_base(part, full)->wait();
  } else {
    std::vector<int64_t> even;  // empty: equal shares
    b.alltoall_base(other, full, even, even)->wait();
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
    at::Tensor other = op == Op::kAllToAll ? at::empty({numel}, opts) : at::Tensor();
    // Two warm-up calls (connections, buffers), then 3 batches sized from the second; the best
    // batch's time per call on each rank (a batch another process interrupted does not count),
    // the slowest rank's.
    run_op(g, op, full, part, other, dev);
    auto t0 = Clock::now();
    run_op(g, op, full, part, other, dev);
    const double warm = reduce(g, dev, {since(t0)}, true)[0];
    const int iters =
        std::clamp(static_cast<int>(seconds_per_size / 3 / std::max(warm, 1e-6)), 1, 20);
    double best = 1e30;
    for (int batch = 0; batch < 3; ++batch) {
      t0 = Clock::now();
      for (int i = 0; i < iters; ++i) run_op(g, op, full, part, other, dev);
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
    curve_of(cs, op) = sweep_op(g, op, ctx.device, max_bytes, seconds_per_size);
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
  o += fmt::format("  {:>9}  {:>22}  {:>22}  {:>22}  {:>22}\n", "size", "all-reduce", "all-gather",
                   "reduce-scatter", "all-to-all");
  const Curve* cols[] = {&cs.all_reduce, &cs.all_gather, &cs.reduce_scatter, &cs.all_to_all};
  size_t rows = 0;
  for (const Curve* c : cols) rows = std::max(rows, c->bytes.size());
  for (size_t i = 0; i < rows; ++i) {
    std::string line = fmt::format(
        "  {:>9}",
        human_bytes(cs.all_reduce.bytes.size() > i ? cs.all_reduce.bytes[i] : cols[1]->bytes[i]));
    for (int k = 0; k < 4; ++k) {
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
  for (Op op : kOps) {
    const Curve& c = curve_of(cs, op);
    json rows = json::array();
    for (size_t i = 0; i < c.bytes.size(); ++i)
      rows.push_back({{"bytes", c.bytes[i]},
                      {"seconds", c.seconds[i]},
                      {"busbw_bytes_per_s", busbw(c, i, op, cs.ranks)}});
    j[op_name(op)] = rows;
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
  m.set_moe_grouped_mm(model::parse_grouped_mm(s.moe.grouped_mm));
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

// ---- the phases of one rank's `ft doctor` ----

// What one rank measured of its own device, as every rank gathers it.
struct RankDevice {
  int node = 0, local_rank = 0;
  int cuda_index = -1;  // -1: a CPU rank
  double matmul_flops_s = 0, h2d_bytes_s = 0, disk_read_bytes_s = 0;
};

// Host-to-device bandwidth: 4 copies of 256 MiB from pinned memory, after one to warm up.
double host_to_device_rate(const at::Device& device) {
  const int64_t n = int64_t{256} << 20;
  at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  at::Tensor dev = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device));
  dev.copy_(host, true);
  sync(device);
  const auto t0 = Clock::now();
  for (int i = 0; i < 4; ++i) dev.copy_(host, true);
  sync(device);
  return 4.0 * static_cast<double>(n) / since(t0);
}

// NVML's path kinds between two GPUs, in the codes the topology gather carries.
constexpr int kTopologyGpus = 16;  // GPUs per node shown
const char* const kPaths[] = {"X", "NVLink", "same board", "PIX", "PXB", "PHB", "NODE", "SYS", "?"};

// This node's GPU topology as doubles (local rank 0; zeros elsewhere): the GPU count, then
// kTopologyGpus x kTopologyGpus codes, the path's index + 10 when P2P reads work.
std::vector<double> topology_codes(const comm::DistEnv& env) {
  constexpr int kMax = kTopologyGpus;
  std::vector<double> codes(1 + kMax * kMax, 0.0);
  if (env.local_rank != 0) return codes;
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
  return codes;
}

// One rank's doctor, in phases (the training run's shape: open in the constructor, then run()).
// Every rank runs every phase in the same order, so the collectives inside them (the gathers, the
// sweeps over the world and its subgroups, the barriers) match; rank 0 prints and fills the report.
class Doctor {
 public:
  explicit Doctor(const DoctorOptions& o);

  void run() {
    measure_devices();
    if (ctx_.rank0()) report_devices();
    gpu_topology();
    if (ctx_.world) {
      measure_collectives();
      measure_node_pairs();
      if (ctx_.rank0()) report_collectives();
    }
    if (settings_) {
      probe_step();
      if (ctx_.rank0()) report_prediction();
    }
    barrier(ctx_);
    if (ctx_.rank0() && !o_.json_path.empty())
      io::write_file_durably(o_.json_path, report_.dump(2) + "\n");
  }

 private:
  void measure_devices();
  void report_devices();
  void gpu_topology();
  void report_topology(const std::vector<double>& nodes, size_t per_node);
  void measure_collectives();
  std::vector<int> leaders() const;
  void measure_node_pairs();
  void report_collectives();
  void report_pairs();
  void flag_slow_pairs(double best);
  void report_bottleneck();
  void probe_step();
  void report_prediction();

  const DoctorOptions& o_;
  Ctx ctx_;
  std::optional<config::Settings> settings_;
  int64_t max_bytes_ = 0;  // largest collective size
  nlohmann::json report_;  // rank 0: what --json writes
  at::ScalarType mm_dtype_ = at::kFloat;
  train::PeakFlops mm_;            // this rank's matmul peak
  std::vector<RankDevice> ranks_;  // every rank's device figures, rank order
  std::string disk_from_;          // how this rank measured the model files' read
  Measured measured_;
  int64_t pair_bytes_ = 0;    // the node-pair all-reduce's size
  std::vector<double> pair_;  // node-pair bus bandwidth [nnodes x nnodes], both halves
};

Doctor::Doctor(const DoctorOptions& o) : o_(o) {
  ctx_.env = comm::read_dist_env();
  const comm::DistEnv& env = ctx_.env;
  if (!o.preset.empty()) settings_ = config::resolve_settings(o.preset, o.sets);
  const cuda::DeviceChoice choice =
      cuda::choose_device(settings_ ? settings_->hardware.device : "auto", env.local_rank);
  ctx_.device = choice.device;
  if (ctx_.device.is_cuda()) cuda::use_device(ctx_.device.index());
  if (env.world_size > 1) {
    comm::ProcessGroupOptions po;
    po.device = ctx_.device;
    po.timeout = std::chrono::seconds(120);
    ctx_.world = std::make_unique<comm::ProcessGroup>(env, po);
  }
  max_bytes_ = o.max_bytes > 0 ? o.max_bytes
                               : (ctx_.device.is_cuda() ? int64_t{256} << 20 : int64_t{64} << 20);
  ctx_.say(fmt::format("{} node{} x {} rank{} per node, devices {} ({})", env.nnodes,
                       env.nnodes == 1 ? "" : "s", env.local_world_size,
                       env.local_world_size == 1 ? "" : "s", ctx_.device.is_cuda() ? "cuda" : "cpu",
                       ctx_.world ? ctx_.world->backend_name() : "one process, no collectives"));
}

// ---- devices: every rank at once ----

void Doctor::measure_devices() {
  const comm::DistEnv& env = ctx_.env;
  ctx_.say("timing each device's matrix multiplies");
  mm_dtype_ = ctx_.device.is_cuda() ? at::kBFloat16 : at::kFloat;
  mm_ = train::measure_matmul(ctx_.device, mm_dtype_, ctx_.device.is_cuda() ? 8192 : 512, 0.3);
  const double h2d = ctx_.device.is_cuda() ? host_to_device_rate(ctx_.device) : 0;
  double disk = 0;
  if (!o_.model_dir.empty() && env.local_rank == 0)
    disk = plan::measure_read_throughput(o_.model_dir, &disk_from_);
  std::vector<double> mine = {static_cast<double>(env.node_rank),
                              static_cast<double>(env.local_rank),
                              ctx_.device.is_cuda() ? double(ctx_.device.index()) : -1.0,
                              mm_.flops_per_s,
                              h2d,
                              disk};
  const std::vector<double> all = ctx_.world ? gather(*ctx_.world, ctx_.device, mine) : mine;
  for (int r = 0; r < env.world_size; ++r) {
    const double* a = &all[6 * r];
    ranks_.push_back(
        {static_cast<int>(a[0]), static_cast<int>(a[1]), static_cast<int>(a[2]), a[3], a[4], a[5]});
  }
}

// Each device's figures, one that is well below the median flagged.
void Doctor::report_devices() {
  std::vector<double> flops;
  for (const auto& d : ranks_) flops.push_back(d.matmul_flops_s);
  const double median_flops = train::lower_median(flops);
  std::string t = fmt::format("devices ({} {} matmuls, the best of 5 rounds):\n",
                              ctx_.device.is_cuda() ? "8192^3" : "512^3", dtype_name(mm_dtype_));
  json devs = json::array();
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    const RankDevice& d = ranks_[r];
    const std::string name = d.cuda_index < 0 ? "cpu" : fmt::format("cuda:{}", d.cuda_index);
    const bool slow = d.matmul_flops_s < 0.8 * median_flops;
    t += fmt::format(
        "  node {} rank {} ({}): {:.3g} TFLOP/s{}{}{}\n", d.node, r, name, d.matmul_flops_s / 1e12,
        d.h2d_bytes_s > 0 ? fmt::format(", host to device {}", rate(d.h2d_bytes_s)) : "",
        d.disk_read_bytes_s > 0 ? fmt::format(", model files read at {}", rate(d.disk_read_bytes_s))
                                : "",
        slow
            ? fmt::format("  <- SLOW: {:.0f}% of the median", 100 * d.matmul_flops_s / median_flops)
            : "");
    devs.push_back({{"rank", r},
                    {"node", d.node},
                    {"device", name},
                    {"matmul_flops_per_s", d.matmul_flops_s},
                    {"h2d_bytes_per_s", d.h2d_bytes_s},
                    {"disk_read_bytes_per_s", d.disk_read_bytes_s},
                    {"slow", slow}});
  }
  fmt::print("{}", t);
  std::fflush(stdout);
  report_["devices"] = devs;
  if (!disk_from_.empty()) report_["disk_from"] = disk_from_;
}

// ---- each node's GPU topology (local rank 0 of each node; through NVML) ----

void Doctor::gpu_topology() {
  if (!ctx_.device.is_cuda()) {
    ctx_.say("GPU topology: not applicable (CPU ranks)");
    return;
  }
  const std::vector<double> codes = topology_codes(ctx_.env);
  const std::vector<double> nodes = ctx_.world ? gather(*ctx_.world, ctx_.device, codes) : codes;
  if (ctx_.rank0()) report_topology(nodes, codes.size());
}

// Each node's GPU pairs: the path between them, * where peer-to-peer reads do not work.
void Doctor::report_topology(const std::vector<double>& nodes, size_t per_node) {
  constexpr int kMax = kTopologyGpus;
  json topo = json::array();
  std::string t =
      "GPU topology (NVML; * = no peer-to-peer reads: copies go through host memory):\n";
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    const double* c = &nodes[static_cast<size_t>(r) * per_node];
    if (ranks_[r].local_rank != 0) continue;  // local rank 0 of each node
    const int node = ranks_[r].node;
    const int n = static_cast<int>(c[0]);
    t += fmt::format("  node {}: {}\n", node, n == 0 ? "NVML shows no GPU" : "");
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
          node);
    topo.push_back({{"node", node}, {"gpus", m}});
  }
  fmt::print("{}", t);
  report_["gpu_topology"] = topo;
}

// ---- collectives ----

// Over the whole job, inside each node (every node at once) and across nodes (local rank 0 of
// each), where the job has those.
void Doctor::measure_collectives() {
  const comm::DistEnv& env = ctx_.env;
  measured_.world =
      sweep(ctx_, *ctx_.world, fmt::format("the whole job ({} ranks)", env.world_size), max_bytes_,
            o_.seconds_per_size, ctx_.rank0());
  barrier(ctx_);
  if (env.nnodes > 1 && env.local_world_size > 1) {
    std::vector<int> mates;
    for (int r = 0; r < env.world_size; ++r)
      if (ranks_[r].node == env.node_rank) mates.push_back(r);
    auto g = ctx_.world->subgroup(fmt::format("doctor/node{}", env.node_rank), mates);
    Curves c = sweep(ctx_, *g, fmt::format("one node ({} ranks)", mates.size()), max_bytes_,
                     o_.seconds_per_size, ctx_.rank0());
    if (env.node_rank == 0) measured_.intra = c;
    barrier(ctx_);
  } else if (env.nnodes == 1) {
    measured_.intra = measured_.world;
  }
  if (env.nnodes > 1 && env.local_world_size > 1) {
    const std::vector<int> heads = leaders();
    if (env.local_rank == 0) {
      auto g = ctx_.world->subgroup("doctor/nodes", heads);
      measured_.inter =
          sweep(ctx_, *g, fmt::format("across nodes ({} ranks, one per node)", heads.size()),
                max_bytes_, o_.seconds_per_size, ctx_.rank0());
    }
    barrier(ctx_);
  } else if (env.nnodes > 1) {
    measured_.inter = measured_.world;
  }
}

// Local rank 0 of each node, in node order.
std::vector<int> Doctor::leaders() const {
  std::vector<int> heads;
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r)
    if (ranks_[r].local_rank == 0) heads.push_back(r);
  return heads;
}

// Node pairs, in rounds of disjoint pairs (the circle method), between local ranks 0.
void Doctor::measure_node_pairs() {
  const comm::DistEnv& env = ctx_.env;
  const int N = env.nnodes;
  pair_.assign(static_cast<size_t>(N * N), 0.0);
  pair_bytes_ = std::min<int64_t>(max_bytes_, int64_t{8} << 20);
  if (N < 2) return;
  ctx_.say(
      fmt::format("timing a {} all-reduce between every pair of nodes", human_bytes(pair_bytes_)));
  const std::vector<int> heads = leaders();
  const int M = N % 2 == 0 ? N : N + 1;  // with a bye when odd
  for (int round = 0; round < M - 1; ++round) {
    for (int k = 0; k < M / 2; ++k) {
      int a = k == 0 ? 0 : (round + k) % (M - 1) + 1;
      int b = (round + M - 1 - k) % (M - 1) + 1;
      if (k == 0) b = (round % (M - 1)) + 1;
      if (a > b) std::swap(a, b);
      if (b >= N || a == b) continue;
      if (env.local_rank == 0 && (env.node_rank == a || env.node_rank == b)) {
        auto g =
            ctx_.world->subgroup(fmt::format("doctor/pair{}_{}", a, b), {heads.at(a), heads.at(b)});
        Curve c = sweep_op(*g, Op::kAllReduce, ctx_.device, pair_bytes_, o_.seconds_per_size);
        // The largest size measured: its bus bandwidth (2 ranks: the size over the time).
        if (env.node_rank == a)
          pair_[static_cast<size_t>(a * N + b)] =
              static_cast<double>(c.bytes.back()) / c.seconds.back();
      }
    }
    barrier(ctx_);
  }
  pair_ = reduce(*ctx_.world, ctx_.device, pair_, false);
  for (int a = 0; a < N; ++a)
    for (int b = a + 1; b < N; ++b)
      pair_[static_cast<size_t>(b * N + a)] = pair_[static_cast<size_t>(a * N + b)];
}

void Doctor::report_collectives() {
  const comm::DistEnv& env = ctx_.env;
  fmt::print("{}", curves_text(measured_.world));
  json coll = {{"world", curves_json(measured_.world)}};
  if (!measured_.intra.empty() && env.nnodes > 1) {
    fmt::print("{}", curves_text(measured_.intra));
    coll["intra"] = curves_json(measured_.intra);
  }
  if (!measured_.inter.empty() && env.local_world_size > 1) {
    fmt::print("{}", curves_text(measured_.inter));
    coll["inter"] = curves_json(measured_.inter);
  }
  report_["collectives"] = coll;
  if (env.nnodes > 1) report_pairs();
  report_bottleneck();
}

// The node-pair matrix, and the links or nodes well below the best pair.
void Doctor::report_pairs() {
  const int N = ctx_.env.nnodes;
  std::string t = fmt::format(
      "node pairs: bus bandwidth of a {} all-reduce between the nodes' local rank 0:\n  "
      "{:>8}",
      human_bytes(pair_bytes_), "");
  for (int b = 0; b < N; ++b) t += fmt::format(" {:>11}", fmt::format("node {}", b));
  t += "\n";
  std::vector<double> links;
  for (int a = 0; a < N; ++a) {
    t += fmt::format("  {:>8}", fmt::format("node {}", a));
    for (int b = 0; b < N; ++b)
      t += fmt::format(" {:>11}", a == b ? "-" : rate(pair_[static_cast<size_t>(a * N + b)]));
    t += "\n";
    for (int b = a + 1; b < N; ++b) links.push_back(pair_[static_cast<size_t>(a * N + b)]);
  }
  fmt::print("{}", t);
  report_["pairs"] = {{"bytes", pair_bytes_}, {"busbw_bytes_per_s", pair_}};
  flag_slow_pairs(links.empty() ? 0 : *std::max_element(links.begin(), links.end()));
}

// A link well below the others is named, and a node whose links all are. Against the best pair
// (a median would be a slow one when a third of 3 nodes' links are): a link below half of it is
// slow; a node all of whose links are is the node's own fault (its network interface, its switch
// port), not one link's.
void Doctor::flag_slow_pairs(double best) {
  const int N = ctx_.env.nnodes;
  std::vector<bool> slow_node(static_cast<size_t>(N), false);
  for (int a = 0; N > 2 && a < N; ++a) {
    bool all_slow = true;
    for (int b = 0; b < N; ++b)
      if (b != a && pair_[static_cast<size_t>(a * N + b)] >= 0.5 * best) all_slow = false;
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
      const double v = pair_[static_cast<size_t>(a * N + b)];
      if (N > 2 && v < 0.5 * best && !slow_node[static_cast<size_t>(a)] &&
          !slow_node[static_cast<size_t>(b)])
        fmt::print("ft doctor: SLOW LINK: node {} - node {}: {} against {} for the best pair\n", a,
                   b, rate(v), rate(best));
    }
}

// The bottleneck: the slowest kind of path the job's collectives cross.
void Doctor::report_bottleneck() {
  const comm::DistEnv& env = ctx_.env;
  std::string bottleneck;
  if (env.nnodes > 1) {
    const double across = sustained_busbw(measured_.inter);
    const double inside = env.local_world_size > 1 ? sustained_busbw(measured_.intra) : 0;
    bottleneck = fmt::format(
        "the network between nodes: {} bus bandwidth ({:.0f} Mbit/s) across nodes{}; every "
        "collective over the whole job runs at its pace",
        rate(across), across * 8 / 1e6,
        inside > 0
            ? fmt::format(" against {} inside a node ({:.0f}x)", rate(inside), inside / across)
            : "");
  } else {
    bottleneck = fmt::format("inside this node: {} bus bandwidth at the largest all-reduce",
                             rate(sustained_busbw(measured_.world)));
  }
  fmt::print("ft doctor: bottleneck: {}\n", bottleneck);
  report_["bottleneck"] = bottleneck;
}

// ---- the step-time model ----

// One device's step of the preset's model, probed on every rank at once; the median rank's
// figures (ranks sharing a CPU probed at once, as they will train).
void Doctor::probe_step() {
  ctx_.say(fmt::format("probing one device's training step of preset {}", settings_->name));
  const model::ModelConfig mc = o_.model_dir.empty()
                                    ? train::model_config_from_preset(settings_->model)
                                    : model::load_model_config(o_.model_dir + "/config.json");
  ComputeProbe& probed = measured_.probe;
  probed = probe(*settings_, mc, o_.model_dir, ctx_.device, mm_.flops_per_s);
  if (!ctx_.world) return;
  const auto a = gather(*ctx_.world, ctx_.device, {probed.fwd_bwd_s, probed.optimizer_s});
  std::vector<double> fb, up;
  for (int r = 0; r < ctx_.env.world_size; ++r) {
    fb.push_back(a[2 * r]);
    up.push_back(a[2 * r + 1]);
  }
  probed.fwd_bwd_s = train::lower_median(fb);
  probed.optimizer_s = train::lower_median(up);
}

// The step-time model at this job's layout, and its alternatives below 70% efficiency.
void Doctor::report_prediction() {
  const comm::DistEnv& env = ctx_.env;
  Job job;
  job.settings = *settings_;
  job.model_dir = o_.model_dir;
  job.layout = {env.nnodes, env.local_world_size, ctx_.device.is_cuda()};
  const Prediction p = predict(job, measured_);
  const std::vector<Alternative> alts =
      p.efficiency < 0.7 ? alternatives(job, measured_) : std::vector<Alternative>{};
  fmt::print("one device: forward + backward {} per micro-batch, update {} ({})\n",
             human_seconds(measured_.probe.fwd_bwd_s), human_seconds(measured_.probe.optimizer_s),
             measured_.probe.from);
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
  json cj = json::array();
  for (const auto& c : p.comm)
    cj.push_back({{"op", c.op},
                  {"group", c.group},
                  {"calls", c.calls},
                  {"bytes_per_call", c.bytes_per_call},
                  {"seconds", c.seconds}});
  pj["comm"] = cj;
  json aj = json::array();
  for (const auto& a : alts)
    aj.push_back({{"what", a.what},
                  {"step_s", a.prediction.step_s},
                  {"tokens_per_s", a.prediction.tokens_per_s},
                  {"efficiency", a.prediction.efficiency}});
  pj["alternatives"] = aj;
  report_["prediction"] = pj;
}

}  // namespace

int run_doctor(const DoctorOptions& o) {
  Doctor(o).run();
  return 0;
}

}  // namespace ft::doctor

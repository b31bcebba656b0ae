#include "plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "comm/dist_env.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/strings.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/fused_loss.h"
#include "model/lora.h"
#include "parallel/strategy.h"
#include "parallel/units.h"
#include "train/saved_model.h"

namespace ft::plan {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;
// Assumptions (docs/planning.md).
constexpr int64_t kDefaultProcessBytes = 200 * kMiB;
constexpr int64_t kCudaContextBytes = kGiB;       // context, cuBLAS/NCCL workspaces (device)
constexpr int64_t kCudaHostBytes = 3 * kGiB / 2;  // libtorch_cuda, context, NCCL (host, per rank)
constexpr double kFragmentation = 0.05;           // CUDA caching allocator
constexpr double kDefaultDiskBps = 1e9;
constexpr double kDefaultInitPerS = 2e8;
constexpr double kAllocBytesPerS = 5e9;  // zeroing fresh memory
// A CPU rank once its first step has run, beyond what it held before allocating: the LibTorch
// kernels' code, the thread pools and glibc's heap of small blocks (bench/plan_accuracy.py, with
// the step pool of core/host_alloc.h).
constexpr int64_t kCpuRuntimeBytes = 31 * kMiB;
// A sharded CPU job's step-pool blocks beyond its live peak, in percent of the gathered units and
// their local gradients (see allocator_retention below), and of the local gradients again when
// they are reduced in another dtype than the compute dtype (bench/plan_accuracy.py).
constexpr int64_t kRetainedPercent = 80;
constexpr int64_t kCastPercent = 75;

std::string n3(int64_t v) {  // 1,234,567
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return v < 0 ? "-" + out : out;
}

struct Shape {
  model::ModelConfig mc;
  std::string from;
  int64_t file_bytes = 0;    // the model files (0: random init)
  int64_t file_element = 0;  // bytes per element in the files
};

Shape model_shape(const PlanInputs& in) {
  Shape s;
  if (in.model_dir.empty()) {
    s.mc = train::model_config_from_preset(in.settings.model);
    s.from = fmt::format("preset {}'s model section (random init)", in.settings.name);
    return s;
  }
  const std::string cfg = (fs::path(in.model_dir) / "config.json").string();
  s.mc = model::load_model_config(cfg);
  s.from = cfg;
  // The headers only: the files are mapped, never read.
  const io::SafetensorsIndex index = io::SafetensorsIndex::open(in.model_dir);
  for (const auto& f : index.files()) s.file_bytes += static_cast<int64_t>(fs::file_size(f.path()));
  for (const auto& name : index.names()) {
    s.file_element = static_cast<int64_t>(c10::elementSize(index.info(name).dtype));
    break;
  }
  return s;
}

// What autograd keeps of one layer for backward (no checkpointing), per micro-batch of N tokens,
// compute dtype of c bytes: the formula of docs/planning.md.
struct LayerActs {
  int64_t saved = 0;      // held from the layer's forward until its backward
  int64_t transient = 0;  // gradients alive while one layer's backward runs
};

LayerActs layer_activations(const model::ModelConfig& mc, const config::Settings& s, int64_t N,
                            int64_t c, bool gpu) {
  const int64_t h = mc.hidden_size, I = mc.intermediate_size;
  const int64_t hq = mc.num_attention_heads * mc.head_dim;
  const int64_t hkv = mc.num_key_value_heads * mc.head_dim;
  const bool lora = s.lora.enabled;
  LayerActs a;
  // The fused CPU kernels (model/fused_ops.h; RMSNorm not in fp64) keep less than the op
  // sequences they replace.
  const bool fused_norm = !gpu && s.train.fused_rms_norm && s.precision.mode != "fp64";
  const bool fused_swiglu = !gpu && s.train.fused_swiglu;
  if (fused_norm) {
    // Two RMSNorms: each keeps its input (the layer's input; the residual sum after attention)
    // and one fp32 scale per token.
    a.saved += 2 * (c * N * h + 4 * N);
  } else {
    // Two RMSNorms: the fp32 copy of the input (pow and the scaling keep it); the normalised
    // value before the weight, kept when the weight is trained.
    a.saved += 2 * (4 * N * h + (lora ? 0 : c * N * h));
  }
  // Attention: q and k after RoPE, v, the output of SDPA and its [B, T, hq] copy (o_proj's input),
  // the log-sum-exp (fp32, per head and token).
  a.saved += c * N * (2 * hq + 2 * hkv) + c * N * hq + 4 * N * mc.num_attention_heads;
  // MLP: gate's output (silu's input), up's output, their product (down's input); unfused also
  // silu's output.
  a.saved += (fused_swiglu ? 3 : 4) * c * N * I;
  if (!lora || s.lora.dropout == 0) {
    // The inputs of the q/k/v and gate/up projections (kept for the weight's, or lora_A's,
    // gradient).
    a.saved += 2 * c * N * h;
  } else {
    // Each adapted projection draws its own dropout: the mask and the dropped input.
    for (const auto& t : s.lora.target_modules) {
      const int64_t in_features = t == "o_proj" ? hq : t == "down_proj" ? I : h;
      a.saved += 2 * c * N * in_features;
    }
  }
  if (lora) a.saved += c * N * s.lora.r * static_cast<int64_t>(s.lora.target_modules.size());
  // Backward of one layer: the gradients of its largest intermediate values, a few at a time.
  a.transient = c * N * (3 * I + 4 * h);
  return a;
}

// What a family's pieces (model/family.h) keep for backward in layer `layer` beyond Llama's layer
// above, per micro-batch of B x T tokens (docs/planning.md): Gemma's two more norms, q/k norms,
// the unfused GeGLU or fused-projection MLP's extra intermediate, and Gemma 2's capped attention,
// whose explicit softmax keeps the scores (the matmul's output, the cap's tanh, the fp32
// probabilities and their cast) over the whole context, or chunks of 2W keys in a windowed layer.
int64_t family_extra(const model::ModelConfig& mc, int64_t layer, int64_t B, int64_t T, int64_t c) {
  const model::Family& f = mc.family();
  const int64_t N = B * T, h = mc.hidden_size, I = mc.intermediate_size;
  const int64_t hq = mc.num_attention_heads * mc.head_dim;
  const int64_t hkv = mc.num_key_value_heads * mc.head_dim;
  int64_t extra = 0;
  if (f.placement == model::NormPlacement::kSandwich) extra += 2 * (c + 4) * N * h;
  if (f.qk_norm != model::QkNorm::kNone) extra += (c + 4) * N * (hq + hkv);
  if (mc.activation != model::Activation::kSilu || f.fused_projections) extra += c * N * I;
  if (mc.attn_softcap > 0) {
    const int64_t w = mc.window(layer);
    const int64_t keys = w > 0 && w < T ? std::min(T, 2 * w) : T;
    extra += (3 * c + 4) * B * mc.num_attention_heads * T * keys;
  }
  return extra;
}

struct Acts {
  int64_t kept = 0;          // all layers' saved activations (or checkpointed inputs)
  int64_t outside = 0;       // embedding output, final norm, RoPE tables, the packed mask
  int64_t logits = 0;        // logits and the loss' buffers at their peak
  int64_t backward = 0;      // the working set of one layer's backward (recompute included)
  int64_t checkpointed = 0;  // layers under activation checkpointing
  std::string formula;
  std::string logits_formula;
};

Acts activations(const model::ModelConfig& mc, const config::Settings& s, int64_t c, bool gpu) {
  const int64_t B = s.train.micro_batch, T = s.data.seq_len, N = B * T;
  const int64_t h = mc.hidden_size, V = mc.vocab_size, L = mc.num_hidden_layers;
  const LayerActs la = layer_activations(mc, s, N, c, gpu);
  Acts a;
  const auto mode = model::parse_activation_checkpointing(s.train.activation_checkpointing);
  for (int64_t i = 0; i < L; ++i) {
    const bool ckpt = mode == model::ActivationCheckpointing::kFull ||
                      (mode == model::ActivationCheckpointing::kEveryN &&
                       i % std::max<int64_t>(1, s.train.checkpoint_every_n_layers) == 0);
    a.checkpointed += ckpt ? 1 : 0;
    a.kept += ckpt ? c * N * h : la.saved + family_extra(mc, i, B, T, c);
  }
  // The embedding's output, the final norm (fp32 copy, normalised value, the head's input), RoPE's
  // cos and sin, and a packed batch's [B, 1, T, T] bool mask with the [B, T, T] comparison it is
  // built from; on the CPU also the mask's 0 / -inf form in the compute dtype, made once and kept
  // by every layer's attention (model/decoder.cpp).
  // Fused, the final norm keeps its input and a scale per token instead of the fp32 copy.
  const bool fused_norm = !gpu && s.train.fused_rms_norm && s.precision.mode != "fp64";
  const int64_t final_norm = fused_norm ? c * N * h + 4 * N + c * N * h : 4 * N * h + 2 * c * N * h;
  a.outside = c * N * h + final_norm + 2 * c * N * mc.head_dim +
              (s.data.pack ? (gpu ? 2 : 2 + c) * B * T * T : 0);
  // Unfused: the logits (compute dtype), log-softmax's fp32 output, and in backward the loss'
  // gradient and log-softmax's gradient (fp32 both). Fused (model/fused_loss.h): one chunk's
  // logits in the accumulation dtype (fp32, fp64 for fp64), turned in place into softmax minus
  // one-hot, beside the compute-dtype logits they come from or their cast back (bf16 and fp16
  // only); and the gradients held from forward to backward in the accumulation dtype: the hidden
  // states' and, when the head is trained, the head's (with one compute-dtype product of the
  // head's size beside it where the dtypes differ).
  if (s.train.fused_loss) {
    const int64_t chunk = std::min<int64_t>(N, std::max<int64_t>(1, model::kLossChunkElements / V));
    const int64_t acc = c == 8 ? 8 : 4;
    const int64_t per = acc + (c == acc ? 0 : c);
    const int64_t head = s.lora.enabled ? 0 : (acc + (c == acc ? 0 : c)) * V * h;
    a.logits = per * chunk * V + acc * N * h + head;
    a.logits_formula = fmt::format(
        "train.fused_loss: a chunk of {} tokens x vocabulary {} x {} B, the gradients of the "
        "head's input (N x h x {} B){}",
        chunk, V, per, acc,
        s.lora.enabled ? "" : fmt::format(" and of the head (vocabulary x h x {} B)", per));
  } else {
    a.logits = (c + 12) * N * V;
    a.logits_formula = fmt::format(
        "(c {} + 12) B x {} tokens x vocabulary {}: the logits, log-softmax's fp32 output and "
        "in backward two fp32 gradients",
        c, N, V);
  }
  a.backward = la.transient + (a.checkpointed > 0 ? la.saved : 0);
  a.formula = fmt::format(
      "N = micro_batch {} x seq_len {} = {} tokens; per layer {} saved ({} of {} layers "
      "checkpointed, keeping c*N*h = {} each)",
      B, T, N, human_bytes(la.saved), a.checkpointed, L, human_bytes(c * N * h));
  return a;
}

struct State {
  int64_t param = 0, master = 0, grad = 0, optimizer = 0;  // per rank, wherever they live
  int64_t host_param = 0, host_master = 0, host_grad = 0, host_optimizer = 0;
  int64_t root_bytes = 0, layer_bytes = 0;  // gathered sizes (compute dtype)
  int64_t layer_reduce_bytes = 0, root_reduce_bytes = 0;
  int64_t sharded_bytes = 0;    // all sharded units, gathered (compute dtype)
  int64_t retained_frozen = 0;  // of those, frozen groups' bytes
  int64_t retained_reduce = 0;  // those units' local gradients before their reduce-scatter
  int64_t trained_sharded = 0;  // padded elements of trained sharded groups
  int64_t trained_replicated = 0;
  int64_t replicated_trained_shard = 0;  // HYBRID: this rank's trained shard elements
  int64_t trained_groups = 0;
  int64_t largest_tensor = 0;  // elements of the largest trained tensor
  std::string largest_name;
  int64_t read_elements = 0;  // this rank's slices of every base parameter
  int64_t largest_slice = 0;
  int64_t largest_param = 0;  // elements
  int units_ahead = 0;        // prefetched units
  bool sharded = false;
};

}  // namespace

bool Plan::fits() const { return shortfall() == nullptr; }

const Check* Plan::shortfall() const {
  for (const auto& c : checks)
    if (!c.fits()) return &c;
  return nullptr;
}

Plan make_plan(const PlanInputs& in, bool suggest) {
  const config::Settings& s = in.settings;
  const Layout& L = in.layout;
  FT_CHECK(L.nnodes >= 1 && L.nproc_per_node >= 1, "--nnodes and --nproc-per-node must be >= 1");
  const Shape shape = model_shape(in);
  const model::ModelConfig& mc = shape.mc;
  const at::ScalarType compute = parse_dtype(s.precision.mode);
  const int64_t c = static_cast<int64_t>(c10::elementSize(compute));
  FT_CHECK(s.data.seq_len <= mc.max_position_embeddings, "data.seq_len ", s.data.seq_len,
           " exceeds the model's max_position_embeddings ", mc.max_position_embeddings, " (",
           shape.from, "): --set data.seq_len=", mc.max_position_embeddings, " or less");

  comm::DistEnv env;
  env.world_size = L.world();
  env.local_world_size = L.nproc_per_node;
  env.nnodes = L.nnodes;
  const at::Device device = L.gpu ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const parallel::StrategyPlan sp =
      parallel::plan_strategy(s.strategy, s.precision.mode, env, device);
  const parallel::EngineOptions& eo = sp.engine;
  const int64_t m = static_cast<int64_t>(c10::elementSize(eo.master_dtype));
  const int64_t r = static_cast<int64_t>(c10::elementSize(eo.reduce_dtype));

  // The parameters as the run lays them out: a meta model (shapes only) with LoRA attached.
  model::DecoderModel meta(mc, at::TensorOptions().dtype(compute), /*materialize=*/false);
  model::LoraConfig lc;
  if (s.lora.enabled) {
    lc = train::lora_config_from_preset(s.lora, in.model_dir, &mc);
    model::attach_lora(meta, lc, 0, /*shapes_only=*/true);
  }
  const auto specs = parallel::param_specs(meta, s.lora.enabled);
  std::vector<parallel::UnitParam> params;
  for (const auto& p : specs) params.push_back({p.name, p.slot->numel(), p.trained, p.decay});
  parallel::UnitsOptions uo;
  uo.shard_size = eo.shard_size;
  uo.buckets = eo.buckets;
  uo.bucket_bytes = eo.bucket_bytes;
  uo.master_element_size = m;
  uo.persistence_threshold = eo.persistence_threshold;
  const parallel::UnitsPlan units = parallel::plan_units(params, uo, meta.num_units());

  Plan p;
  p.layout = L;
  p.model_from = shape.from;
  p.strategy = sp.label;
  p.device_name = L.gpu ? "GPU" : "host (CPU job)";
  p.tokens_per_micro_batch = s.train.micro_batch * s.data.seq_len;
  for (const auto& q : params) {
    if (q.trained) p.trained_parameters += q.numel;
    if (q.name.find("lora_") == std::string::npos) p.parameters += q.numel;
  }

  // Model state per rank, exactly as the engine allocates it (engine.cpp load / ensure_grads).
  State st;
  st.sharded = eo.shard_size > 1 && !eo.buckets;
  for (const auto& u : units.units) {
    const int64_t unit_bytes = u.padded_elements() * c;
    int64_t trained_padded = 0;  // only trained groups get a local gradient buffer
    for (const auto& g : u.groups)
      if (g.trained) trained_padded += g.layout.padded;
    if (u.sharded) {
      st.sharded_bytes += unit_bytes;
      st.retained_frozen += unit_bytes - trained_padded * c;
      st.retained_reduce += trained_padded * r;
      if (u.model_unit == 0) {
        st.root_bytes = unit_bytes;
        st.root_reduce_bytes = trained_padded * r;
      } else if (u.model_unit > 0) {
        st.layer_bytes = std::max(st.layer_bytes, unit_bytes);
        st.layer_reduce_bytes = std::max(st.layer_reduce_bytes, trained_padded * r);
      }
    }
    for (const auto& g : u.groups) {
      const int S = g.layout.shards;
      const int64_t shard = S == 1 ? g.layout.padded : g.layout.shard_numel;
      const bool shard_host = S > 1 && eo.offload_params;
      const bool master_host = g.trained && eo.offload_optimizer;
      st.param += shard * c;
      if (shard_host) st.host_param += shard * c;
      for (size_t k = 0; k < g.members.size(); ++k) {
        const auto& q = params[g.members[k]];
        st.largest_param = std::max(st.largest_param, q.numel);
        const parallel::ShardPiece mine = parallel::intersect(g.layout, 0, g.offsets[k], q.numel);
        st.read_elements += mine.numel();
        st.largest_slice = std::max(st.largest_slice, mine.numel());
        if (q.trained && q.numel > st.largest_tensor) {
          st.largest_tensor = q.numel;
          st.largest_name = q.name;
        }
      }
      if (!g.trained) continue;
      st.trained_groups++;
      if (S > 1)
        st.trained_sharded += g.layout.padded;
      else
        st.trained_replicated += g.layout.padded;
      if (!(eo.master_dtype == eo.compute_dtype && master_host == shard_host)) {
        st.master += g.layout.shard_numel * m;
        if (master_host) st.host_master += g.layout.shard_numel * m;
      }
      st.grad += g.layout.shard_numel * m;
      st.optimizer += 2 * g.layout.shard_numel * m + 4;
      if (master_host) {
        st.host_grad += g.layout.shard_numel * m;
        st.host_optimizer += 2 * g.layout.shard_numel * m + 4;
      }
    }
  }
  // Units gathered ahead of the one running.
  if (st.sharded) {
    if (eo.prefetch_elements >= 0) {
      int64_t ahead = 0;
      for (const auto& u : units.units) {
        if (u.model_unit < 1) continue;
        ahead += u.padded_elements();
        if (ahead > eo.prefetch_elements) break;
        st.units_ahead++;
      }
    } else {
      st.units_ahead =
          eo.forward_prefetch || eo.backward_prefetch == parallel::BackwardPrefetch::kPre;
    }
  }
  p.param_bytes = st.param + st.master;
  p.grad_bytes = st.grad;
  p.optimizer_bytes = st.optimizer;

  const bool gpu = L.gpu;
  const int W = L.world();
  const int S = eo.shard_size;
  const std::string per = S > 1 ? fmt::format(" / {} ranks", S) : "";
  auto on_dev = [&](int64_t total, int64_t host) { return gpu ? total - host : total; };
  auto where = [&](int64_t host) { return gpu && host > 0 ? " (offloaded to host memory)" : ""; };

  // ---- the device of one rank ----
  std::vector<Item>& d = p.device;
  const std::string cdt = s.precision.mode;
  d.push_back(
      {"parameters",
       fmt::format("parameters ({}{}){}", cdt, S > 1 ? " shards" : "", where(st.host_param)),
       on_dev(st.param, st.host_param),
       fmt::format("{} elements{} x {} B{}",
                   n3(p.parameters + (s.lora.enabled ? p.trained_parameters : 0)), per, c,
                   S > 1 ? ", padded to a multiple of the shard group" : "")});
  d.push_back(
      {"masters", fmt::format("fp32 masters{}", where(st.host_master)),
       on_dev(st.master, st.host_master),
       st.master == 0 && p.trained_parameters > 0
           ? std::string("none: the trained parameters are kept in ") + cdt +
                 " already (they are the masters)"
           : fmt::format("{} trained elements{} x {} B", n3(p.trained_parameters), per, m)});
  d.push_back({"gradients", fmt::format("gradients (fp32 accumulators){}", where(st.host_grad)),
               on_dev(st.grad, st.host_grad),
               fmt::format("{} trained elements{} x {} B", n3(p.trained_parameters), per, m)});
  d.push_back(
      {"optimizer_state",
       fmt::format("optimizer state (AdamW exp_avg, exp_avg_sq, step){}", where(st.host_optimizer)),
       on_dev(st.optimizer, st.host_optimizer),
       fmt::format("2 x {} B x {} trained elements{} + 4 B x {} groups", m,
                   n3(p.trained_parameters), per, st.trained_groups)});
  int64_t gathered = 0;
  std::string gathered_from = "nothing: every parameter is whole on every rank";
  if (st.sharded) {
    const int64_t layers_held =
        eo.reshard_after_forward ? 1 + st.units_ahead : mc.num_hidden_layers;
    gathered = st.root_bytes + layers_held * st.layer_bytes;
    gathered_from = fmt::format(
        "the root unit (embedding and head: {}) kept gathered + {} layer unit(s) of {} "
        "({})",
        human_bytes(st.root_bytes), layers_held, human_bytes(st.layer_bytes),
        eo.reshard_after_forward
            ? fmt::format("the running one and {} prefetched", st.units_ahead)
            : std::string("SHARD_GRAD_OP keeps every layer from forward to backward"));
  }
  d.push_back({"gathered", "gathered units in flight and prefetch", gathered, gathered_from});
  int64_t buckets = 0;
  std::string buckets_from;
  if (st.sharded) {
    // zero3 queues gradients until a bucket is full (never more than all of them); fsdp issues
    // each unit's reduce-scatter as soon as it is ready.
    const int64_t queued =
        std::min<int64_t>(std::max<int64_t>(eo.reduce_bucket_elements * r, st.layer_reduce_bytes),
                          st.trained_sharded * r - st.root_reduce_bytes);
    buckets = st.root_reduce_bytes + queued + st.layer_reduce_bytes;
    buckets_from = fmt::format(
        "local gradients before their reduce-scatter ({}): the root's {} (its head's gradient "
        "comes first, its embedding's last) + {} queued + one layer's {} in flight",
        c10::toString(eo.reduce_dtype), human_bytes(st.root_reduce_bytes), human_bytes(queued),
        human_bytes(st.layer_reduce_bytes));
  } else if (W > 1 && eo.reduce_dtype != eo.master_dtype) {
    buckets = eo.bucket_bytes;
    buckets_from = "one converted gradient bucket";
  } else {
    buckets_from =
        W > 1 ? "none: gradients are all-reduced in place in their fp32 buckets" : "none: one rank";
  }
  d.push_back({"comm_buckets", "communication buckets", buckets, buckets_from});
  // On CPU, a sharded job's gathered units and their local gradients are allocated and freed
  // every step, and Gloo stages a copy of each collective's buffer of the same size (the
  // all-gather's flat output, the reduce-scatter's input clone). The step pool (core/host_alloc.h)
  // keeps every freed block for the next request of its size: it holds, per size, the most that
  // were ever live at once, which is more than the step's live peak by the copies in flight beside
  // it. Blocks of frozen units come back in the same order and are half counted; trained units'
  // blocks and their gradients' are counted whole (calibrated on bench/plan_accuracy.py).
  const int64_t retained_trained = st.sharded_bytes - st.retained_frozen;
  const int64_t retained_kept =
      (retained_trained + st.retained_frozen / 2 + st.retained_reduce) * kRetainedPercent / 100;
  const int64_t retained_cast = r != c ? st.retained_reduce * kCastPercent / 100 : 0;
  const int64_t retained = !gpu && st.sharded ? retained_kept + retained_cast : 0;
  if (!gpu)
    d.push_back({"allocator_retention", "host allocator retention", retained,
                 st.sharded
                     ? fmt::format("step pool blocks beyond the live peak (Gloo's staging copies, "
                                   "kept by size): {}% of trained units {} + half of frozen {} + "
                                   "their local gradients {}{}",
                                   kRetainedPercent, human_bytes(retained_trained),
                                   human_bytes(st.retained_frozen), human_bytes(st.retained_reduce),
                                   retained_cast > 0
                                       ? fmt::format(", and {}% of the gradients again for their "
                                                     "{} copies",
                                                     kCastPercent, c10::toString(eo.reduce_dtype))
                                       : std::string())
                     : std::string("none: nothing is gathered")});
  const Acts acts = activations(mc, s, c, gpu);
  d.push_back(
      {"activations", "activations of one micro-batch", acts.kept + acts.outside, acts.formula});
  d.push_back({"logits", "logits and loss buffers", acts.logits, acts.logits_formula});
  d.push_back({"backward", "backward working set", acts.backward,
               acts.checkpointed > 0 ? "one checkpointed layer recomputed with its gradients"
                                     : "the gradients of one layer's intermediate values"});
  const int64_t state_dev = d[0].bytes + d[1].bytes + d[2].bytes + d[3].bytes;
  const int64_t step_transient =
      gathered + buckets + retained + acts.kept + acts.outside +
      (gpu ? std::max(acts.logits, acts.backward) : acts.logits + acts.backward);
  // Rank 0 gathers each whole trained tensor for the final model, one at a time (fp32 master),
  // on its device; LoRA keeps every adapter (in host memory) until they are written.
  const int64_t final_dev = st.largest_tensor * m;
  d.push_back({"final_save", "final save (rank 0)", final_dev,
               fmt::format("one whole trained tensor at a time, the largest {} ({} elements x {} "
                           "B); activations are gone by then",
                           st.largest_name, n3(st.largest_tensor), m)});
  int64_t overhead = 0;
  std::string overhead_from;
  if (gpu) {
    const int64_t base = state_dev + step_transient;
    overhead = kCudaContextBytes + static_cast<int64_t>(kFragmentation * static_cast<double>(base));
    overhead_from = fmt::format(
        "{} for the CUDA context and cuBLAS/NCCL workspaces + {:.0f}% of "
        "the rest for the caching allocator's fragmentation",
        human_bytes(kCudaContextBytes), kFragmentation * 100);
  } else {
    overhead = (in.budget.process_bytes > 0 ? in.budget.process_bytes : kDefaultProcessBytes) +
               kCpuRuntimeBytes;
    overhead_from = fmt::format(
        "{} + {} of LibTorch kernels, thread pools and small blocks once a step has run",
        in.budget.process_bytes > 0 ? in.budget.process_from
                                    : "ft's resident memory before it allocates (assumed)",
        human_bytes(kCpuRuntimeBytes));
  }
  d.push_back({"overhead", gpu ? "allocator and workspace overhead" : "the process itself",
               overhead, overhead_from});
  const int64_t step_peak = state_dev + step_transient + overhead;
  const int64_t save_peak = state_dev + final_dev + overhead;
  p.step_peak = step_peak;
  p.save_peak = save_peak;
  p.device_peak = std::max(step_peak, save_peak);
  p.rank = 0;
  p.rank_why = W == 1 ? "the only rank"
                      : fmt::format(
                            "every rank holds the same model state ({}), and rank 0 also gathers "
                            "each whole trained tensor for the final save",
                            S > 1 ? "shards are equal in size, padded" : "replicated");

  // ---- host memory of one node (all its ranks) ----
  std::vector<Item>& hm = p.host;
  const int local = L.nproc_per_node;
  const int64_t process =
      (in.budget.process_bytes > 0 ? in.budget.process_bytes : kDefaultProcessBytes) +
      (gpu ? kCudaHostBytes : 0);
  // Loading: a rank reads its slices of each parameter (file dtype, then converted), or draws
  // each whole parameter in fp32 (random init) before taking its slice.
  const int64_t loading =
      shape.file_bytes > 0 ? st.largest_slice * (shape.file_element + c) : st.largest_param * 4;
  const bool saves = s.output.save_every > 0 || s.output.save_every_minutes > 0;
  // An async save copies the rank's masters, exp_avg and exp_avg_sq (3 x its gradient bytes).
  const int64_t staging_rank = saves && s.output.async_save ? 3 * st.grad : 0;
  const int64_t lora_final = s.lora.enabled ? p.trained_parameters * (4 + c) : 0;
  if (gpu) {
    hm.push_back({"processes", "ft processes (LibTorch, CUDA, NCCL)", local * process,
                  fmt::format("{} local rank(s) x {}", local, human_bytes(process))});
    const int64_t offloaded = st.host_param + st.host_master + st.host_grad + st.host_optimizer;
    hm.push_back({"offloaded", "offloaded state (pinned)", local * offloaded,
                  fmt::format("{} rank(s) x {}", local, human_bytes(offloaded))});
    hm.push_back({"loading", "loading buffers", local * loading,
                  fmt::format("{} rank(s) x {}", local,
                              shape.file_bytes > 0
                                  ? "the largest slice read, in the file's dtype and converted"
                                  : "the largest parameter drawn whole in fp32 (random init)")});
    hm.push_back({"checkpoint_staging", "checkpoint staging", local * staging_rank,
                  saves && s.output.async_save
                      ? "async_save: a host copy of each rank's masters and optimizer state"
                      : "none: no periodic checkpoint, or written synchronously"});
    hm.push_back({"final_save", "final save (node 0)", lora_final + st.largest_tensor * (4 + c),
                  "rank 0 copies each whole tensor to host memory and converts it"});
    int64_t t = 0;
    for (const auto& i : hm) t += i.bytes;
    p.host_peak = t;
  } else {
    hm.push_back({"ranks", "ranks (each rank's peak above)", local * p.device_peak,
                  fmt::format("{} local rank(s) x {}", local, human_bytes(p.device_peak))});
    hm.push_back({"checkpoint_staging", "checkpoint staging", local * staging_rank,
                  saves && s.output.async_save
                      ? "async_save: a copy of each rank's masters and optimizer state"
                      : "none: no periodic checkpoint, or written synchronously"});
    hm.push_back({"final_save", "final save (node 0)", lora_final,
                  s.lora.enabled ? "rank 0 holds every adapter until they are written"
                                 : "counted in rank 0's peak"});
    p.host_peak = 0;
    for (const auto& i : hm) p.host_peak += i.bytes;
  }
  hm.push_back({"data", "data", 0,
                "batches are tokenized as they are read: a few micro-batches of token ids"});

  // ---- disk ----
  const int64_t ckpt_bytes = p.trained_parameters * 3 * m;
  // final/ holds the model in the compute dtype, or the adapters in fp32 (final_save.cpp).
  const int64_t final_bytes = s.lora.enabled ? p.trained_parameters * 4 : p.parameters * c;
  const int64_t keep = std::max<int64_t>(1, s.output.keep_last);
  p.disk.push_back({"checkpoint", "one checkpoint", ckpt_bytes,
                    fmt::format("{} trained elements x (master + exp_avg + exp_avg_sq) x {} B",
                                n3(p.trained_parameters), m)});
  // Without scheduled saves a SIGTERM or Ctrl-C still writes one checkpoint, and the resumed run
  // writes final/ beside it.
  const int64_t kept = saves ? (keep + 1) * ckpt_bytes : ckpt_bytes;
  p.disk.push_back({"checkpoints", "checkpoints kept", kept,
                    saves ? fmt::format("output.keep_last {} + the one being written", keep)
                          : "one: none is scheduled (output.save_every and save_every_minutes "
                            "are 0), but a SIGTERM or Ctrl-C writes one"});
  p.disk.push_back({"final", "final model", final_bytes,
                    fmt::format("{} {} elements x {} B", s.lora.enabled ? "adapter" : "model",
                                n3(s.lora.enabled ? p.trained_parameters : p.parameters),
                                s.lora.enabled ? 4 : c)});
  p.disk_need = kept + final_bytes;

  // ---- communication per rank per step ----
  const int64_t micro = s.train.grad_accum;
  if (W > 1) {
    if (st.sharded) {
      const int64_t layers_bytes = st.sharded_bytes - st.root_bytes;
      const int64_t gathers = st.root_bytes + layers_bytes * (eo.reshard_after_forward ? 2 : 1);
      p.comm.push_back(
          {"all_gather", "all-gather (parameters, received)", micro * gathers,
           fmt::format("{} micro-batches x ({} forward{})", micro, human_bytes(st.sharded_bytes),
                       eo.reshard_after_forward
                           ? fmt::format(" + {} again in backward", human_bytes(layers_bytes))
                           : "")});
      p.comm.push_back(
          {"reduce_scatter", "reduce-scatter (gradients, sent)", micro * st.trained_sharded * r,
           fmt::format("{} micro-batches x {} elements x {} B", micro, n3(st.trained_sharded), r)});
    }
    int64_t allreduce = st.trained_replicated * r;
    std::string ar_from = fmt::format("{} replicated trained elements x {} B, once per step",
                                      n3(st.trained_replicated), r);
    if (sp.replicas > 1) {
      allreduce += st.trained_sharded / S * r;
      ar_from += fmt::format(" + this rank's shard across {} replicas", sp.replicas);
    }
    p.comm.push_back({"all_reduce", "all-reduce (gradients)", allreduce, ar_from});
  }

  // ---- time to the first step ----
  const double bps =
      in.budget.disk_read_bytes_per_s > 0 ? in.budget.disk_read_bytes_per_s : kDefaultDiskBps;
  const double init_rate =
      in.budget.init_elements_per_s > 0 ? in.budget.init_elements_per_s : kDefaultInitPerS;
  double read_s = 0, init_s = 0;
  if (shape.file_bytes > 0) {
    // Ranks of a node reading the same bytes share the page cache.
    const int64_t node_bytes = std::min<int64_t>(
        shape.file_bytes, local * st.read_elements * std::max<int64_t>(1, shape.file_element));
    read_s = static_cast<double>(node_bytes) / bps;
    p.startup.push_back(
        {"read", "read the model files", node_bytes,
         fmt::format("{} per node at {}/s ({}): {:.0f} s", human_bytes(node_bytes),
                     human_bytes(static_cast<int64_t>(bps)),
                     in.budget.disk_read_from.empty() ? "assumed" : in.budget.disk_read_from,
                     read_s)});
  } else {
    // Every rank draws the whole init stream (the values do not depend on the layout).
    init_s = static_cast<double>(p.parameters) / init_rate;
    p.startup.push_back(
        {"init", "random init", p.parameters * 4,
         fmt::format("every rank draws all {} values at {:.0e}/s ({}): {:.0f} s", n3(p.parameters),
                     init_rate, in.budget.init_elements_per_s > 0 ? "measured" : "assumed",
                     init_s)});
  }
  const int64_t state_all =
      state_dev + (gpu ? st.host_param + st.host_master + st.host_grad + st.host_optimizer : 0);
  const double alloc_s = static_cast<double>(state_all) / kAllocBytesPerS;
  p.startup.push_back(
      {"allocate", "allocate and fill this rank's state", state_all,
       fmt::format("{} (offloaded host state included) at {}/s: {:.0f} s", human_bytes(state_all),
                   human_bytes(static_cast<int64_t>(kAllocBytesPerS)), alloc_s)});
  p.first_step_s = read_s + init_s + alloc_s;

  // ---- checks ----
  const Budget& b = in.budget;
  if (gpu)
    p.checks.push_back(
        {"GPU memory", "each GPU (rank 0 needs most)", p.device_peak, b.gpu_bytes, b.gpu_from});
  p.checks.push_back({"host memory", "each node", p.host_peak, b.host_bytes, b.host_from});
  p.checks.push_back({"disk", "--output's filesystem", p.disk_need, b.disk_bytes, b.disk_from});

  if (suggest && !p.fits()) {
    // Each change re-planned; the first that fits is what a refusal names.
    auto variant = [&](const std::string& what, std::vector<std::string> sets,
                       const std::function<void(config::Settings&)>& apply, int nnodes = 0) {
      PlanInputs v = in;
      apply(v.settings);
      v.settings.strategy.user_keys.clear();
      if (nnodes > 0) v.layout.nnodes = nnodes;
      try {
        const Plan q = make_plan(v, false);
        p.suggestions.push_back(
            {what, std::move(sets), nnodes, q.device_peak, q.host_peak, q.fits()});
      } catch (const Error&) {
        // A change this job cannot take (a knob the layout refuses) is not a suggestion.
      }
    };
    if (s.train.activation_checkpointing != "full")
      variant("activation checkpointing of every layer", {"train.activation_checkpointing=full"},
              [](config::Settings& v) { v.train.activation_checkpointing = "full"; });
    for (int64_t mb = s.train.micro_batch / 2; mb >= 1; mb /= 2) {
      if (s.train.micro_batch % mb != 0) continue;
      const int64_t ga = s.train.grad_accum * (s.train.micro_batch / mb);
      variant(fmt::format("micro-batch {} with {} accumulation steps (same global batch)", mb, ga),
              {fmt::format("train.micro_batch={}", mb), fmt::format("train.grad_accum={}", ga)},
              [=](config::Settings& v) {
                v.train.micro_batch = mb;
                v.train.grad_accum = ga;
              });
      if (!p.suggestions.empty() && p.suggestions.back().fits) break;
    }
    if (W > 1 && (s.strategy.kind == "ddp" ||
                  (s.strategy.kind == "fsdp" && s.strategy.fsdp.sharding_strategy != "FULL_SHARD")))
      variant("fsdp FULL_SHARD instead of " + s.strategy.kind,
              {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"},
              [](config::Settings& v) {
                v.strategy.kind = "fsdp";
                v.strategy.fsdp.sharding_strategy = "FULL_SHARD";
              });
    if (gpu && W > 1) {
      if (s.strategy.kind == "fsdp" && !s.strategy.fsdp.cpu_offload)
        variant(
            "fsdp cpu_offload (parameter shards, masters, gradients and optimizer state in "
            "host memory)",
            {"strategy.fsdp.cpu_offload=true"},
            [](config::Settings& v) { v.strategy.fsdp.cpu_offload = true; });
      if (s.strategy.kind != "fsdp" && !s.strategy.zero3.offload_optimizer)
        variant("zero3 with the optimizer offloaded to host memory",
                {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true"},
                [](config::Settings& v) {
                  v.strategy.kind = "zero3";
                  v.strategy.zero3.offload_optimizer = true;
                });
      if (s.strategy.kind != "fsdp" && !s.strategy.zero3.offload_param)
        variant("zero3 with the optimizer and the parameter shards offloaded to host memory",
                {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true",
                 "strategy.zero3.offload_param=true"},
                [](config::Settings& v) {
                  v.strategy.kind = "zero3";
                  v.strategy.zero3.offload_optimizer = true;
                  v.strategy.zero3.offload_param = true;
                });
    }
    if (s.precision.mode == "fp32" || s.precision.mode == "fp64")
      variant("bf16 compute with fp32 masters", {"precision.mode=bf16"},
              [](config::Settings& v) { v.precision.mode = "bf16"; });
    if (!s.lora.enabled)
      variant("LoRA (r=16) instead of a full fine-tune", {"lora.enabled=true"},
              [](config::Settings& v) {
                v.lora.enabled = true;
                if (v.lora.r <= 0) v.lora.r = 16;
              });
    // The fewest nodes that fit: double until one fits, then halve the gap.
    auto fits_on = [&](int n) {
      PlanInputs v = in;
      v.layout.nnodes = n;
      try {
        return make_plan(v, false);
      } catch (const Error&) {
        return Plan();
      }
    };
    int lo = L.nnodes, hi = 0;
    for (int n = std::max(2, 2 * L.nnodes); n <= 4096; n *= 2) {
      const Plan q = fits_on(n);
      if (q.fits() && !q.checks.empty()) {
        hi = n;
        break;
      }
      lo = n;
    }
    if (hi > 0) {
      while (hi - lo > 1) {
        const int mid = lo + (hi - lo) / 2;
        const Plan q = fits_on(mid);
        if (!q.checks.empty() && q.fits())
          hi = mid;
        else
          lo = mid;
      }
      const Plan q = fits_on(hi);
      p.suggestions.push_back(
          {fmt::format("{} nodes of {} rank(s) (the fewest that fit)", hi, local),
           {},
           hi,
           q.device_peak,
           q.host_peak,
           true});
    }
  }
  return p;
}

namespace {

std::string suggestion_text(const Suggestion& g, const Plan& p) {
  std::string how;
  for (const auto& x : g.sets) how += " --set " + x;
  if (g.nnodes > 0) how = fmt::format(" --nnodes {}", g.nnodes);
  return fmt::format("{}{}: {} per rank{}, {} host per node{}", g.what,
                     how.empty() ? "" : " (" + how.substr(1) + ")", human_bytes(g.device_bytes),
                     p.layout.gpu ? " on its GPU" : "", human_bytes(g.host_bytes),
                     g.fits ? " - fits" : " - still does not fit");
}

}  // namespace

std::string verdict(const Plan& p) {
  const Check* c = p.shortfall();
  if (!c) return "";
  std::string first;
  for (const auto& g : p.suggestions)
    if (g.fits) {
      first = suggestion_text(g, p);
      break;
    }
  return fmt::format("needs {} of {} on {} but {} is available ({}): {} short; {}",
                     human_bytes(c->need), c->resource, c->where, human_bytes(c->have),
                     c->have_from, human_bytes(c->need - c->have),
                     first.empty() ? "none of the changes ft knows makes it fit by itself "
                                     "(`ft plan` lists each, re-planned)"
                                   : "to make it fit: " + first);
}

std::string plan_text(const Plan& p) {
  std::string o;
  auto line = [&](const Item& i) {
    o += fmt::format("  {:<52} {:>10}   {}\n", i.label, human_bytes(i.bytes), i.from);
  };
  o += fmt::format("ft plan: {} parameters ({} trained) from {}\n", n3(p.parameters),
                   n3(p.trained_parameters), p.model_from);
  o += fmt::format("  {} node(s) x {} rank(s) on {}; strategy {}\n", p.layout.nnodes,
                   p.layout.nproc_per_node, p.layout.gpu ? "GPUs" : "CPU", p.strategy);
  o += fmt::format("\nper rank, on its {}: rank {} needs most ({})\n", p.device_name, p.rank,
                   p.rank_why);
  for (const auto& i : p.device) line(i);
  o += fmt::format("  {:<52} {:>10}   max(step, final save)\n", "peak", human_bytes(p.device_peak));
  o += "\nper node, host memory:\n";
  for (const auto& i : p.host) line(i);
  o += fmt::format("  {:<52} {:>10}\n", "peak", human_bytes(p.host_peak));
  o += "\ndisk, under --output:\n";
  for (const auto& i : p.disk) line(i);
  o += fmt::format("  {:<52} {:>10}\n", "needed", human_bytes(p.disk_need));
  if (!p.comm.empty()) {
    o += "\ncommunication per rank per optimizer step (payload):\n";
    for (const auto& i : p.comm) line(i);
  }
  o += fmt::format("\ntime to the first step: about {:.0f} s\n", p.first_step_s);
  for (const auto& i : p.startup) line(i);
  o += "\nverdict:\n";
  for (const auto& c : p.checks)
    o += fmt::format(
        "  {:<12} {:<32} needs {:>10}, {}\n", c.resource, c.where, human_bytes(c.need),
        !c.known() ? std::string("available: unknown (not checked)")
                   : fmt::format("has {} ({}): {}", human_bytes(c.have), c.have_from,
                                 c.fits() ? "fits"
                                          : fmt::format("{} SHORT", human_bytes(c.need - c.have))));
  if (!p.fits()) {
    o += "\ndoes not fit. What would (each re-planned):\n";
    for (const auto& g : p.suggestions) o += "  - " + suggestion_text(g, p) + "\n";
    if (p.suggestions.empty()) o += "  nothing ft can change on this layout\n";
  } else {
    o += "\nfits.\n";
  }
  return o;
}

json plan_json(const Plan& p) {
  auto items = [](const std::vector<Item>& v) {
    json a = json::array();
    for (const auto& i : v)
      a.push_back({{"key", i.key}, {"label", i.label}, {"bytes", i.bytes}, {"from", i.from}});
    return a;
  };
  json j;
  j["model_from"] = p.model_from;
  j["strategy"] = p.strategy;
  j["parameters"] = p.parameters;
  j["trained_parameters"] = p.trained_parameters;
  j["tokens_per_micro_batch"] = p.tokens_per_micro_batch;
  j["layout"] = {{"nnodes", p.layout.nnodes},
                 {"nproc_per_node", p.layout.nproc_per_node},
                 {"gpu", p.layout.gpu}};
  j["rank"] = {{"rank", p.rank},
               {"why", p.rank_why},
               {"device", p.device_name},
               {"items", items(p.device)},
               {"peak_bytes", p.device_peak},
               {"step_peak_bytes", p.step_peak},
               {"save_peak_bytes", p.save_peak},
               {"param_bytes", p.param_bytes},
               {"grad_bytes", p.grad_bytes},
               {"optimizer_bytes", p.optimizer_bytes}};
  j["node"] = {{"items", items(p.host)}, {"peak_bytes", p.host_peak}};
  j["disk"] = {{"items", items(p.disk)}, {"need_bytes", p.disk_need}};
  j["comm_per_step"] = items(p.comm);
  j["first_step"] = {{"seconds", p.first_step_s}, {"items", items(p.startup)}};
  json checks = json::array();
  for (const auto& c : p.checks)
    checks.push_back({{"resource", c.resource},
                      {"where", c.where},
                      {"need_bytes", c.need},
                      {"have_bytes", c.known() ? json(c.have) : json(nullptr)},
                      {"have_from", c.have_from},
                      {"fits", c.fits()}});
  j["checks"] = checks;
  j["fits"] = p.fits();
  json sug = json::array();
  for (const auto& g : p.suggestions)
    sug.push_back({{"what", g.what},
                   {"set", g.sets},
                   {"nnodes", g.nnodes},
                   {"device_peak_bytes", g.device_bytes},
                   {"host_peak_bytes", g.host_bytes},
                   {"fits", g.fits}});
  j["suggestions"] = sug;
  j["verdict"] = verdict(p);
  return j;
}

}  // namespace ft::plan

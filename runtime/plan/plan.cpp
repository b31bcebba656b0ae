#include "plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <utility>

#include "comm/dist_env.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/strings.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/flops.h"
#include "model/fused_loss.h"
#include "model/lora.h"
#include "parallel/strategy.h"
#include "parallel/units.h"
#include "plan/suggest.h"
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
// NF4 quantization at load (model/nf4.h quantize_nf4): values per second on one thread, read
// off a CPU load of 90M projection values (0.2 s on 2 threads, bench/qlora_step.sh's model).
constexpr double kNf4QuantizePerThreadS = 2e8;
constexpr double kHostAdamwNs = 0.5;     // the host AdamW step per parameter, one thread
constexpr double kPcieBytesPerS = 25e9;  // a GPU's copies to and from the host (PCIe 4.0 x16)
// A gradient added into its host accumulator per element, one thread (parallel/host_add.h; 0.13
// ns on 2 threads in bench/host_adamw.sh)
constexpr double kHostAddNs = 0.25;
// The clip's squared norm of a host gradient per element, one thread (parallel/host_add.h's
// host_sq_norm; 0.077 ns on 2 threads in bench/host_adamw.sh)
constexpr double kHostNormNs = 0.15;
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
  bool config_only = false;  // config.json without weight files: file_bytes from the shapes
};

// Whether `dir` holds weights (safetensors, or PyTorch's files, which loading refuses with its own
// message), as opposed to a config.json fetched ahead of the download.
bool has_weight_files(const std::string& dir) {
  auto ends = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (ends(name, ".safetensors") || ends(name, ".safetensors.index.json") ||
        name.rfind("pytorch_model", 0) == 0)
      return true;
  }
  return false;
}

// The dtype config.json says the weights are stored in (transformers 5's `dtype`, else
// `torch_dtype`; neither: transformers' default, fp32), and its bytes per element.
std::pair<std::string, int64_t> stored_dtype(const model::ModelConfig& mc) {
  std::string name = "float32";
  if (!mc.source_json.empty()) {
    const json j = json::parse(mc.source_json);
    for (const char* key : {"dtype", "torch_dtype"})
      if (j.contains(key) && j[key].is_string()) {
        name = j[key].get<std::string>();
        break;
      }
  }
  const int64_t bytes = name == "bfloat16" || name == "float16" ? 2 : name == "float64" ? 8 : 4;
  return {name, bytes};
}

Shape model_shape(const PlanInputs& in) {
  Shape s;
  if (in.model_dir.empty()) {
    s.mc = train::model_config_from_preset(in.settings.model);
    s.from = fmt::format("preset {}'s model section (random init)", in.settings.name);
    train::apply_base_quant(in.settings.lora, in.settings.precision.mode, "", s.mc);
    return s;
  }
  const std::string cfg = (fs::path(in.model_dir) / "config.json").string();
  s.mc = model::load_model_config(cfg);
  s.from = cfg;
  train::apply_base_quant(in.settings.lora, in.settings.precision.mode, in.model_dir, s.mc);
  if (!has_weight_files(in.model_dir)) {
    // Planning before the download: config.json has every shape, and the files' bytes follow
    // from them (Planner::lay_out_parameters) in the dtype it names.
    const auto [dtype, bytes] = stored_dtype(s.mc);
    s.config_only = true;
    s.file_element = bytes;
    s.from = fmt::format(
        "{} alone (no weight files in {} yet: their size estimated from its shapes in {})", cfg,
        in.model_dir, dtype);
    return s;
  }
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
                            int64_t c) {
  const int64_t h = mc.hidden_size, I = mc.intermediate_size;
  const int64_t hq = mc.num_attention_heads * mc.head_dim;
  const int64_t hkv = mc.num_key_value_heads * mc.head_dim;
  const bool lora = s.lora.enabled;
  LayerActs a;
  // The fused kernels (model/fused_ops.h, CPU and CUDA; RMSNorm not in fp64) keep less than the
  // op sequences they replace.
  const bool fused_norm = s.train.fused_rms_norm && s.precision.mode != "fp64";
  const bool fused_swiglu = s.train.fused_swiglu;
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

// How much more (or less) a MoE layer keeps for backward than the dense MLP layer_activations
// counts: the router's fp32 logits, probabilities and their gradient's copy (N x E each), and for
// the k rows of every token the gathered input, the gate and up outputs, their product and the
// experts' output (weighted after), in place of the dense MLP's gate, up and product; with LoRA
// on the experts also each adapter's x A^T (r wide) per row.
int64_t moe_layer_delta(const model::ModelConfig& mc, int64_t layer, int64_t N, int64_t c,
                        const config::Settings& s) {
  if (!mc.is_moe_layer(layer)) return 0;
  const model::MoeConfig& m = mc.moe;
  const int64_t rows = N * m.experts_per_token;
  const int64_t adapters =
      s.lora.enabled ? s.lora.r * static_cast<int64_t>(s.lora.target_parameters.size()) : 0;
  const int64_t moe = c * rows * (2 * mc.hidden_size + 3 * m.expert_intermediate + adapters) +
                      3 * 4 * N * m.num_experts;
  return moe - (s.train.fused_swiglu ? 3 : 4) * c * N * mc.intermediate_size;
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
  const LayerActs la = layer_activations(mc, s, N, c);
  Acts a;
  const auto mode = model::parse_activation_checkpointing(s.train.activation_checkpointing);
  for (int64_t i = 0; i < L; ++i) {
    const bool ckpt = mode == model::ActivationCheckpointing::kFull ||
                      (mode == model::ActivationCheckpointing::kEveryN &&
                       i % std::max<int64_t>(1, s.train.checkpoint_every_n_layers) == 0);
    a.checkpointed += ckpt ? 1 : 0;
    a.kept += ckpt ? c * N * h
                   : la.saved + family_extra(mc, i, B, T, c) + moe_layer_delta(mc, i, N, c, s);
  }
  // The embedding's output, the final norm (fp32 copy, normalised value, the head's input), RoPE's
  // cos and sin, and a packed batch's [B, 1, T, T] bool mask with the [B, T, T] comparison it is
  // built from; on the CPU also the mask's 0 / -inf form in the compute dtype, made once and kept
  // by every layer's attention (model/decoder.cpp).
  // Fused, the final norm keeps its input and a scale per token instead of the fp32 copy.
  const bool fused_norm = s.train.fused_rms_norm && s.precision.mode != "fp64";
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
    const int64_t chunk =
        std::min<int64_t>(N, std::max<int64_t>(1, model::loss_chunk_elements(gpu) / V));
    const int64_t acc = c == 8 ? 8 : 4;
    const int64_t per = acc + (c == acc ? 0 : c);
    // On a GPU the head's product accumulates into its fp32 gradient inside the matrix multiply.
    const int64_t head = s.lora.enabled ? 0 : (acc + (c == acc || gpu ? 0 : c)) * V * h;
    a.logits = per * chunk * V + acc * N * h + head;
    a.logits_formula = fmt::format(
        "train.fused_loss: a chunk of {} tokens x vocabulary {} x {} B, the gradients of the "
        "head's input (N x h x {} B){}",
        chunk, V, per, acc,
        s.lora.enabled ? ""
                       : fmt::format(" and of the head (vocabulary x h x {} B)", gpu ? acc : per));
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

// One rank's model state, as the engine allocates it (engine.cpp load / ensure_grads), and the
// sizes of what it gathers and reduces.
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
  int64_t trained_experts =
      0;  // of the replicated ones, this rank's whole experts (over expert_dp)
  int64_t trained_sharded_experts = 0;   // of the sharded ones, experts' (split over expert_dp)
  int64_t replicated_trained_shard = 0;  // HYBRID: this rank's trained shard elements
  int64_t trained_groups = 0;
  int64_t largest_tensor = 0;  // elements of the largest trained tensor
  std::string largest_name;
  int64_t read_elements = 0;    // this rank's slices of every base parameter
  int64_t quantize_values = 0;  // NF4 at load: the projection values this rank quantizes
  int64_t largest_slice = 0;
  int64_t largest_param = 0;  // elements
  int units_ahead = 0;        // prefetched units
  bool sharded = false;
  int64_t offloaded() const { return host_param + host_master + host_grad + host_optimizer; }
};

// The plan of one job, resource by resource: the constructor checks the inputs and lays the
// parameters out as the run will (a meta model with LoRA attached, the strategy's units), and
// plan() is the outline. Each resource's function adds its figures to the plan in the order plan()
// calls them: host memory reads the device's peak, the first step the device's model state.
class Planner {
 public:
  explicit Planner(const PlanInputs& in);
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;

  Plan plan() {
    describe();
    count_state();
    device_memory();
    host_memory();
    disk();
    communication();
    first_step();
    offload_step();
    checks();
    return std::move(p_);
  }

 private:
  void lay_out_parameters();
  void describe();
  void count_state();
  void count_unit(const parallel::UnitPlan& u);
  void count_group(const parallel::GroupPlan& g);
  void count_prefetch();
  void device_memory();
  void model_state_items();
  Item gathered_item() const;
  Item buckets_item() const;
  Item retention_item() const;
  void activation_items(const Acts& acts);
  Item final_save_item() const;
  Item overhead_item(int64_t base) const;
  std::string rank_why() const;
  void host_memory();
  void gpu_host_items();
  void cpu_host_items();
  int64_t process_bytes() const;
  int64_t staging_bytes() const;
  bool saves() const;
  void disk();
  void communication();
  void expert_exchange();
  void first_step();
  void offload_step();
  void optimizer_on_host();
  void gradients_through_host(int64_t n, int threads);
  double host_pass_s(double compute_s, int64_t bytes, std::string& from) const;
  void param_shards_up();
  // zero3's delayed update with the optimizer offloaded (a second host gradient buffer).
  bool delayed_update() const {
    return sp_.engine.offload_optimizer && s_.strategy.kind == "zero3" &&
           s_.strategy.zero3.delayed_update;
  }
  double read_or_init();
  double quantize_at_load();
  int64_t read_elements_of(size_t index, int64_t held);
  void checks();

  const PlanInputs& in_;
  const config::Settings& s_;
  const Layout& layout_;
  const bool gpu_;
  const int world_;
  Shape shape_;
  at::ScalarType compute_ = at::kFloat;
  int64_t c_ = 0, m_ = 0, r_ = 0;  // bytes per element: compute, master and reduce dtypes
  parallel::StrategyPlan sp_;
  model::ModelConfig placed_;  // the model with rank 0's experts (strategy.expert_parallel)
  // Every parameter the forward reads, in file order, with the elements this rank holds of it.
  std::vector<parallel::UnitParam> params_;
  std::vector<int64_t> nf4_values_;  // per params_ entry: an NF4 projection's values, else 0
  parallel::UnitsPlan units_;
  State st_;
  int64_t state_dev_ = 0;  // this rank's model state on its device
  Plan p_;
};

Planner::Planner(const PlanInputs& in)
    : in_(in), s_(in.settings), layout_(in.layout), gpu_(in.layout.gpu), world_(in.layout.world()) {
  FT_CHECK(layout_.nnodes >= 1 && layout_.nproc_per_node >= 1,
           "--nnodes and --nproc-per-node must be >= 1");
  shape_ = model_shape(in);
  const model::ModelConfig& mc = shape_.mc;
  compute_ = parse_dtype(s_.precision.mode);
  c_ = static_cast<int64_t>(c10::elementSize(compute_));
  FT_CHECK(s_.data.seq_len <= mc.max_position_embeddings, "data.seq_len ", s_.data.seq_len,
           " exceeds the model's max_position_embeddings ", mc.max_position_embeddings, " (",
           shape_.from, "): --set data.seq_len=", mc.max_position_embeddings, " or less");

  comm::DistEnv env;
  env.world_size = world_;
  env.local_world_size = layout_.nproc_per_node;
  env.nnodes = layout_.nnodes;
  const at::Device device = gpu_ ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  sp_ = parallel::plan_strategy(s_.strategy, s_.precision.mode, env, device);
  placed_ = parallel::place_experts(mc, s_.strategy.expert_parallel, env);
  m_ = static_cast<int64_t>(c10::elementSize(sp_.engine.master_dtype));
  r_ = static_cast<int64_t>(c10::elementSize(sp_.engine.reduce_dtype));

  lay_out_parameters();
  if (shape_.config_only) {
    // Weights saved quantized keep their NF4 projections' packed bytes in the files.
    shape_.file_bytes =
        shape_.mc.quant.in_files
            ? (p_.parameters - p_.nf4_parameters) * shape_.file_element + p_.nf4_bytes
            : p_.parameters * shape_.file_element;
  }
}

// The parameters as the run lays them out: a meta model (shapes only) with LoRA attached, each
// parameter with the elements this rank holds of it (under expert parallelism its own experts
// only), in the strategy's units. The model's totals count whole tensors, every expert.
void Planner::lay_out_parameters() {
  const model::ModelConfig& mc = shape_.mc;
  model::DecoderModel meta(placed_, at::TensorOptions().dtype(compute_), /*materialize=*/false);
  if (s_.lora.enabled)
    model::attach_lora(meta, train::lora_config_from_preset(s_.lora, in_.model_dir, &mc), 0,
                       /*shapes_only=*/true);
  std::map<std::string, model::Nf4Shape> nf4;  // NF4 projections: their slot is the blob
  for (const auto& p : meta.parameters())
    if (p.nf4) nf4[p.name] = *p.nf4;
  for (const auto& q : parallel::param_specs(meta, s_.lora.enabled)) {
    int64_t numel = q.full_shape.empty() ? q.slot->numel() : c10::multiply_integers(q.full_shape);
    if (const auto it = nf4.find(q.name); it != nf4.end()) {
      numel = it->second.numel();
      p_.nf4_parameters += numel;
      p_.nf4_bytes += it->second.bytes();
      p_.largest_nf4 = std::max(p_.largest_nf4, numel);
    }
    nf4_values_.push_back(nf4.count(q.name) ? numel : 0);
    if (q.trained) p_.trained_parameters += numel;
    if (q.name.find("lora_") == std::string::npos) p_.parameters += numel;
    params_.push_back({q.name, q.slot->numel(), q.trained, q.decay, q.expert});
  }
  const parallel::EngineOptions& eo = sp_.engine;
  parallel::UnitsOptions uo;
  uo.shard_size = eo.shard_size;
  uo.buckets = eo.buckets;
  uo.bucket_bytes = eo.bucket_bytes;
  uo.master_element_size = m_;
  uo.persistence_threshold = eo.persistence_threshold;
  uo.expert_shard_size = world_ / static_cast<int>(placed_.moe.ep_size);
  units_ = parallel::plan_units(params_, uo, meta.num_units());
}

// What was planned: the model, the strategy, the layout.
void Planner::describe() {
  p_.layout = layout_;
  p_.model_from = shape_.from;
  p_.model_files_estimated = shape_.config_only;
  p_.strategy = sp_.label;
  // Expert parallelism: what each rank holds of the experts, whole or split.
  if (const int64_t n = placed_.moe.ep_size; n > 1) {
    bool split = false;
    for (const auto& u : units_.units)
      for (const auto& g : u.groups) split = split || (g.expert && g.layout.shards > 1);
    const int64_t holders = world_ / n;
    p_.strategy += fmt::format(
        "; expert_parallel {}: each rank holds {} of each MoE layer's {} experts, {}", n,
        placed_.moe.local_experts(), placed_.moe.num_experts,
        split ? fmt::format("split over the {} ranks holding the same ones (gathered with their "
                            "layer)",
                            holders)
              : fmt::format(
                    "whole, replicated over the {} rank(s) holding the same ones{}", holders,
                    sp_.engine.shard_size > 1 && holders > 1 ? " (below the persistence threshold)"
                                                             : ""));
  }
  p_.device_name = gpu_ ? "GPU" : "host (CPU job)";
  p_.tokens_per_micro_batch = s_.train.micro_batch * s_.data.seq_len;
}

// Model state per rank, exactly as the engine allocates it (engine.cpp load / ensure_grads).
void Planner::count_state() {
  st_.sharded = sp_.engine.shard_size > 1 && !sp_.engine.buckets;
  for (const auto& u : units_.units) {
    count_unit(u);
    for (const auto& g : u.groups) count_group(g);
  }
  count_prefetch();
  p_.param_bytes = st_.param + st_.master;
  p_.grad_bytes = st_.grad;
  p_.optimizer_bytes = st_.optimizer;
}

// A unit's gathered size and its local gradients, when it is sharded.
void Planner::count_unit(const parallel::UnitPlan& u) {
  if (!u.sharded) return;
  const int64_t unit_bytes = u.padded_elements() * c_;
  int64_t trained_padded = 0;  // only trained groups get a local gradient buffer
  for (const auto& g : u.groups)
    if (g.trained) trained_padded += g.layout.padded;
  st_.sharded_bytes += unit_bytes;
  st_.retained_frozen += unit_bytes - trained_padded * c_;
  st_.retained_reduce += trained_padded * r_;
  if (u.model_unit == 0) {
    st_.root_bytes = unit_bytes;
    st_.root_reduce_bytes = trained_padded * r_;
  } else if (u.model_unit > 0) {
    st_.layer_bytes = std::max(st_.layer_bytes, unit_bytes);
    st_.layer_reduce_bytes = std::max(st_.layer_reduce_bytes, trained_padded * r_);
  }
}

// A flat group's shard on this rank: its parameters, and for a trained group its masters,
// gradients and optimizer state, each on the device or offloaded to host memory.
void Planner::count_group(const parallel::GroupPlan& g) {
  const parallel::EngineOptions& eo = sp_.engine;
  const int S = g.layout.shards;
  const int64_t shard = S == 1 ? g.layout.padded : g.layout.shard_numel;
  const bool shard_host = S > 1 && eo.offload_params;
  const bool master_host = g.trained && eo.offload_optimizer;
  st_.param += shard * c_;
  if (shard_host) st_.host_param += shard * c_;
  for (size_t k = 0; k < g.members.size(); ++k) {
    const auto& q = params_[g.members[k]];
    st_.largest_param = std::max(st_.largest_param, q.numel);
    const parallel::ShardPiece mine = parallel::intersect(g.layout, 0, g.offsets[k], q.numel);
    st_.read_elements += read_elements_of(g.members[k], mine.numel());
    st_.largest_slice = std::max(st_.largest_slice, mine.numel());
    if (q.trained && q.numel > st_.largest_tensor) {
      st_.largest_tensor = q.numel;
      st_.largest_name = q.name;
    }
  }
  if (!g.trained) return;
  st_.trained_groups++;
  if (S > 1)
    st_.trained_sharded += g.layout.padded;
  else
    st_.trained_replicated += g.layout.padded;
  if (g.expert) (S > 1 ? st_.trained_sharded_experts : st_.trained_experts) += g.layout.padded;
  if (!(eo.master_dtype == eo.compute_dtype && master_host == shard_host)) {
    st_.master += g.layout.shard_numel * m_;
    if (master_host) st_.host_master += g.layout.shard_numel * m_;
  }
  st_.grad += g.layout.shard_numel * m_;
  st_.optimizer += 2 * g.layout.shard_numel * m_ + 4;
  // A delayed update accumulates the next step's gradients into a second host buffer.
  if (master_host && delayed_update()) {
    st_.grad += g.layout.shard_numel * m_;
    st_.host_grad += g.layout.shard_numel * m_;
  }
  if (master_host) {
    st_.host_grad += g.layout.shard_numel * m_;
    st_.host_optimizer += 2 * g.layout.shard_numel * m_ + 4;
  }
}

// Units gathered ahead of the one running.
void Planner::count_prefetch() {
  const parallel::EngineOptions& eo = sp_.engine;
  if (!st_.sharded) return;
  if (eo.prefetch_elements >= 0) {
    int64_t ahead = 0;
    for (const auto& u : units_.units) {
      if (u.model_unit < 1) continue;
      ahead += u.padded_elements();
      if (ahead > eo.prefetch_elements) break;
      st_.units_ahead++;
    }
  } else {
    st_.units_ahead =
        eo.forward_prefetch || eo.backward_prefetch == parallel::BackwardPrefetch::kPre;
  }
}

// ---- the device of one rank ----

void Planner::device_memory() {
  std::vector<Item>& d = p_.device;
  model_state_items();
  state_dev_ = d[0].bytes + d[1].bytes + d[2].bytes + d[3].bytes;
  const Item gathered = gathered_item(), buckets = buckets_item(), retained = retention_item();
  d.push_back(gathered);
  d.push_back(buckets);
  if (!gpu_) d.push_back(retained);
  const Acts acts = activations(shape_.mc, s_, c_, gpu_);
  activation_items(acts);
  // QLoRA: one projection dequantized while its product runs (forward, and backward for the
  // input's gradient), never two at once.
  const int64_t dequantized = p_.largest_nf4 * c_;
  if (p_.largest_nf4 > 0)
    d.push_back({"nf4_dequantized", "NF4 weight dequantized in flight", dequantized,
                 fmt::format("the largest projection, {} elements x {} B, while its product runs",
                             n3(p_.largest_nf4), c_)});
  const int64_t step_transient =
      gathered.bytes + buckets.bytes + retained.bytes + acts.kept + acts.outside + dequantized +
      (gpu_ ? std::max(acts.logits, acts.backward) : acts.logits + acts.backward);
  const Item final_save = final_save_item();
  d.push_back(final_save);
  const Item overhead = overhead_item(state_dev_ + step_transient);
  d.push_back(overhead);
  p_.step_peak = state_dev_ + step_transient + overhead.bytes;
  p_.save_peak = state_dev_ + final_save.bytes + overhead.bytes;
  p_.device_peak = std::max(p_.step_peak, p_.save_peak);
  p_.rank = 0;
  p_.rank_why = rank_why();
}

// Parameters, masters, gradients and optimizer state: the first four items (state_dev_ sums them).
void Planner::model_state_items() {
  std::vector<Item>& d = p_.device;
  const int S = sp_.engine.shard_size;
  const std::string per = S > 1 ? fmt::format(" / {} ranks", S) : "";
  auto on_dev = [&](int64_t total, int64_t host) { return gpu_ ? total - host : total; };
  auto where = [&](int64_t host) { return gpu_ && host > 0 ? " (offloaded to host memory)" : ""; };
  const std::string cdt = s_.precision.mode;
  const int64_t plain = p_.parameters - p_.nf4_parameters +
                        (s_.lora.enabled ? p_.trained_parameters : 0);  // not in NF4
  d.push_back(
      {"parameters",
       fmt::format("parameters ({}{}{}){}", cdt,
                   p_.nf4_parameters > 0 ? "; the base's projections in NF4" : "",
                   S > 1 ? " shards" : "", where(st_.host_param)),
       on_dev(st_.param, st_.host_param),
       fmt::format("{} elements{} x {} B{}{}", n3(plain), per, c_,
                   p_.nf4_parameters > 0
                       ? fmt::format(" + {} projection parameters in NF4{}: {} (0.5 B each + "
                                     "a 4 B absmax per block of 64)",
                                     n3(p_.nf4_parameters), per, human_bytes(p_.nf4_bytes))
                       : std::string(),
                   S > 1 ? ", padded to a multiple of the shard group" : "")});
  d.push_back(
      {"masters", fmt::format("fp32 masters{}", where(st_.host_master)),
       on_dev(st_.master, st_.host_master),
       st_.master == 0 && p_.trained_parameters > 0
           ? std::string("none: the trained parameters are kept in ") + cdt +
                 " already (they are the masters)"
           : fmt::format("{} trained elements{} x {} B", n3(p_.trained_parameters), per, m_)});
  d.push_back({"gradients", fmt::format("gradients (fp32 accumulators){}", where(st_.host_grad)),
               on_dev(st_.grad, st_.host_grad),
               fmt::format("{} trained elements{} x {} B{}", n3(p_.trained_parameters), per, m_,
                           delayed_update() ? " x 2 (the delayed update's second buffer)" : "")});
  d.push_back({"optimizer_state",
               fmt::format("optimizer state (AdamW exp_avg, exp_avg_sq, step){}",
                           where(st_.host_optimizer)),
               on_dev(st_.optimizer, st_.host_optimizer),
               fmt::format("2 x {} B x {} trained elements{} + 4 B x {} groups", m_,
                           n3(p_.trained_parameters), per, st_.trained_groups)});
}

// Sharded: the units gathered at once (the running one, those prefetched, the root).
Item Planner::gathered_item() const {
  Item i{"gathered", "gathered units in flight and prefetch", 0,
         "nothing: every parameter is whole on every rank"};
  if (!st_.sharded) return i;
  const bool reshard = sp_.engine.reshard_after_forward;
  const int64_t layers_held = reshard ? 1 + st_.units_ahead : shape_.mc.num_hidden_layers;
  i.bytes = st_.root_bytes + layers_held * st_.layer_bytes;
  i.from = fmt::format(
      "the root unit (embedding and head: {}) kept gathered + {} layer unit(s) of {} "
      "({})",
      human_bytes(st_.root_bytes), layers_held, human_bytes(st_.layer_bytes),
      reshard ? fmt::format("the running one and {} prefetched", st_.units_ahead)
              : std::string("SHARD_GRAD_OP keeps every layer from forward to backward"));
  return i;
}

Item Planner::buckets_item() const {
  const parallel::EngineOptions& eo = sp_.engine;
  Item i{"comm_buckets", "communication buckets", 0, ""};
  if (st_.sharded) {
    // zero3 queues gradients until a bucket is full (never more than all of them); fsdp issues
    // each unit's reduce-scatter as soon as it is ready.
    const int64_t queued =
        std::min<int64_t>(std::max<int64_t>(eo.reduce_bucket_elements * r_, st_.layer_reduce_bytes),
                          st_.trained_sharded * r_ - st_.root_reduce_bytes);
    i.bytes = st_.root_reduce_bytes + queued + st_.layer_reduce_bytes;
    i.from = fmt::format(
        "local gradients before their reduce-scatter ({}): the root's {} (its head's gradient "
        "comes first, its embedding's last) + {} queued + one layer's {} in flight",
        c10::toString(eo.reduce_dtype), human_bytes(st_.root_reduce_bytes), human_bytes(queued),
        human_bytes(st_.layer_reduce_bytes));
  } else if (world_ > 1 && eo.reduce_dtype != eo.master_dtype) {
    i.bytes = eo.bucket_bytes;
    i.from = "one converted gradient bucket";
  } else {
    i.from = world_ > 1 ? "none: gradients are all-reduced in place in their fp32 buckets"
                        : "none: one rank";
  }
  return i;
}

// On CPU, a sharded job's gathered units and their local gradients are allocated and freed
// every step, and Gloo stages a copy of each collective's buffer of the same size (the
// all-gather's flat output, the reduce-scatter's input clone). The step pool (core/host_alloc.h)
// keeps every freed block for the next request of its size: it holds, per size, the most that
// were ever live at once, which is more than the step's live peak by the copies in flight beside
// it. Blocks of frozen units come back in the same order and are half counted; trained units'
// blocks and their gradients' are counted whole (calibrated on bench/plan_accuracy.py). A GPU
// job's figure is 0 and not shown.
Item Planner::retention_item() const {
  const int64_t retained_trained = st_.sharded_bytes - st_.retained_frozen;
  const int64_t retained_kept =
      (retained_trained + st_.retained_frozen / 2 + st_.retained_reduce) * kRetainedPercent / 100;
  const int64_t retained_cast = r_ != c_ ? st_.retained_reduce * kCastPercent / 100 : 0;
  const int64_t retained = !gpu_ && st_.sharded ? retained_kept + retained_cast : 0;
  if (!st_.sharded)
    return {"allocator_retention", "host allocator retention", retained,
            "none: nothing is gathered"};
  return {"allocator_retention", "host allocator retention", retained,
          fmt::format("step pool blocks beyond the live peak (Gloo's staging copies, "
                      "kept by size): {}% of trained units {} + half of frozen {} + "
                      "their local gradients {}{}",
                      kRetainedPercent, human_bytes(retained_trained),
                      human_bytes(st_.retained_frozen), human_bytes(st_.retained_reduce),
                      retained_cast > 0
                          ? fmt::format(", and {}% of the gradients again for their "
                                        "{} copies",
                                        kCastPercent, c10::toString(sp_.engine.reduce_dtype))
                          : std::string())};
}

void Planner::activation_items(const Acts& acts) {
  std::vector<Item>& d = p_.device;
  d.push_back(
      {"activations", "activations of one micro-batch", acts.kept + acts.outside, acts.formula});
  d.push_back({"logits", "logits and loss buffers", acts.logits, acts.logits_formula});
  d.push_back({"backward", "backward working set", acts.backward,
               acts.checkpointed > 0 ? "one checkpointed layer recomputed with its gradients"
                                     : "the gradients of one layer's intermediate values"});
}

// Rank 0 gathers each whole trained tensor for the final model, one at a time (fp32 master),
// on its device; LoRA keeps every adapter (in host memory) until they are written.
Item Planner::final_save_item() const {
  return {"final_save", "final save (rank 0)", st_.largest_tensor * m_,
          fmt::format("one whole trained tensor at a time, the largest {} ({} elements x {} "
                      "B); activations are gone by then",
                      st_.largest_name, n3(st_.largest_tensor), m_)};
}

// A GPU's context, workspaces and fragmentation over `base`; a CPU rank's own process.
Item Planner::overhead_item(int64_t base) const {
  if (gpu_)
    return {"overhead", "allocator and workspace overhead",
            kCudaContextBytes + static_cast<int64_t>(kFragmentation * static_cast<double>(base)),
            fmt::format("{} for the CUDA context and cuBLAS/NCCL workspaces + {:.0f}% of "
                        "the rest for the caching allocator's fragmentation",
                        human_bytes(kCudaContextBytes), kFragmentation * 100)};
  const Budget& b = in_.budget;
  return {"overhead", "the process itself",
          (b.process_bytes > 0 ? b.process_bytes : kDefaultProcessBytes) + kCpuRuntimeBytes,
          fmt::format("{} + {} of LibTorch kernels, thread pools and small blocks once a step has "
                      "run",
                      b.process_bytes > 0 ? b.process_from
                                          : "ft's resident memory before it allocates (assumed)",
                      human_bytes(kCpuRuntimeBytes))};
}

std::string Planner::rank_why() const {
  if (world_ == 1) return "the only rank";
  return fmt::format(
      "every rank holds the same model state ({}), and rank 0 also gathers each whole trained "
      "tensor for the final save",
      sp_.engine.shard_size > 1 ? "shards are equal in size, padded" : "replicated");
}

// ---- host memory of one node (all its ranks) ----

void Planner::host_memory() {
  if (gpu_)
    gpu_host_items();
  else
    cpu_host_items();
  p_.host_peak = 0;
  for (const auto& i : p_.host) p_.host_peak += i.bytes;
  p_.host.push_back({"data", "data", 0,
                     "batches are tokenized as they are read: a few micro-batches of token ids"});
}

// One ft process before it allocates, and on a GPU what LibTorch's CUDA side adds.
int64_t Planner::process_bytes() const {
  return (in_.budget.process_bytes > 0 ? in_.budget.process_bytes : kDefaultProcessBytes) +
         (gpu_ ? kCudaHostBytes : 0);
}

bool Planner::saves() const { return s_.output.save_every > 0 || s_.output.save_every_minutes > 0; }

// An async save copies the rank's masters, exp_avg and exp_avg_sq (3 x its gradient bytes).
int64_t Planner::staging_bytes() const {
  return saves() && s_.output.async_save ? 3 * st_.grad : 0;
}

void Planner::gpu_host_items() {
  std::vector<Item>& hm = p_.host;
  const int local = layout_.nproc_per_node;
  const int64_t process = process_bytes();
  // Loading: a rank reads its slices of each parameter (file dtype, then converted), or draws
  // each whole parameter in fp32 (random init) before taking its slice.
  const int64_t loading = shape_.file_bytes > 0 ? st_.largest_slice * (shape_.file_element + c_)
                                                : st_.largest_param * 4;
  const int64_t lora_final = s_.lora.enabled ? p_.trained_parameters * (4 + c_) : 0;
  hm.push_back({"processes", "ft processes (LibTorch, CUDA, NCCL)", local * process,
                fmt::format("{} local rank(s) x {}", local, human_bytes(process))});
  hm.push_back({"offloaded", "offloaded state (pinned)", local * st_.offloaded(),
                fmt::format("{} rank(s) x {}", local, human_bytes(st_.offloaded()))});
  hm.push_back({"loading", "loading buffers", local * loading,
                fmt::format("{} rank(s) x {}", local,
                            shape_.file_bytes > 0
                                ? "the largest slice read, in the file's dtype and converted"
                                : "the largest parameter drawn whole in fp32 (random init)")});
  hm.push_back({"checkpoint_staging", "checkpoint staging", local * staging_bytes(),
                saves() && s_.output.async_save
                    ? "async_save: a host copy of each rank's masters and optimizer state"
                    : "none: no periodic checkpoint, or written synchronously"});
  hm.push_back({"final_save", "final save (node 0)", lora_final + st_.largest_tensor * (4 + c_),
                "rank 0 copies each whole tensor to host memory and converts it"});
}

// A CPU job's ranks live in host memory: each rank's device peak is host memory already.
void Planner::cpu_host_items() {
  std::vector<Item>& hm = p_.host;
  const int local = layout_.nproc_per_node;
  const int64_t lora_final = s_.lora.enabled ? p_.trained_parameters * (4 + c_) : 0;
  hm.push_back({"ranks", "ranks (each rank's peak above)", local * p_.device_peak,
                fmt::format("{} local rank(s) x {}", local, human_bytes(p_.device_peak))});
  hm.push_back({"checkpoint_staging", "checkpoint staging", local * staging_bytes(),
                saves() && s_.output.async_save
                    ? "async_save: a copy of each rank's masters and optimizer state"
                    : "none: no periodic checkpoint, or written synchronously"});
  hm.push_back({"final_save", "final save (node 0)", lora_final,
                s_.lora.enabled ? "rank 0 holds every adapter until they are written"
                                : "counted in rank 0's peak"});
}

// ---- disk ----

void Planner::disk() {
  const int64_t ckpt_bytes = p_.trained_parameters * 3 * m_;
  // final/ holds the model in the compute dtype, or the adapters in fp32 (final_save.cpp).
  const int64_t final_bytes = s_.lora.enabled ? p_.trained_parameters * 4 : p_.parameters * c_;
  const int64_t keep = std::max<int64_t>(1, s_.output.keep_last);
  p_.disk.push_back({"checkpoint", "one checkpoint", ckpt_bytes,
                     fmt::format("{} trained elements x (master + exp_avg + exp_avg_sq) x {} B",
                                 n3(p_.trained_parameters), m_)});
  // Without scheduled saves a SIGTERM or Ctrl-C still writes one checkpoint, and the resumed run
  // writes final/ beside it.
  const int64_t kept = saves() ? (keep + 1) * ckpt_bytes : ckpt_bytes;
  p_.disk.push_back({"checkpoints", "checkpoints kept", kept,
                     saves() ? fmt::format("output.keep_last {} + the one being written", keep)
                             : "one: none is scheduled (output.save_every and save_every_minutes "
                               "are 0), but a SIGTERM or Ctrl-C writes one"});
  p_.disk.push_back({"final", "final model", final_bytes,
                     fmt::format("{} {} elements x {} B", s_.lora.enabled ? "adapter" : "model",
                                 n3(s_.lora.enabled ? p_.trained_parameters : p_.parameters),
                                 s_.lora.enabled ? 4 : c_)});
  p_.disk_need = kept + final_bytes;
}

// ---- communication per rank per step ----

void Planner::communication() {
  if (world_ == 1) return;
  const parallel::EngineOptions& eo = sp_.engine;
  const int64_t micro = s_.train.grad_accum;
  if (st_.sharded) {
    const int64_t layers_bytes = st_.sharded_bytes - st_.root_bytes;
    const int64_t gathers = st_.root_bytes + layers_bytes * (eo.reshard_after_forward ? 2 : 1);
    p_.comm.push_back(
        {"all_gather", "all-gather (parameters, received)", micro * gathers,
         fmt::format("{} micro-batches x ({} forward{})", micro, human_bytes(st_.sharded_bytes),
                     eo.reshard_after_forward
                         ? fmt::format(" + {} again in backward", human_bytes(layers_bytes))
                         : "")});
    p_.comm.push_back(
        {"reduce_scatter", "reduce-scatter (gradients, sent)", micro * st_.trained_sharded * r_,
         fmt::format("{} micro-batches x {} elements x {} B", micro, n3(st_.trained_sharded), r_)});
  }
  int64_t allreduce = st_.trained_replicated * r_;
  std::string ar_from = fmt::format("{} replicated trained elements x {} B, once per step",
                                    n3(st_.trained_replicated), r_);
  if (sp_.replicas > 1) {
    // (Split experts were reduce-scattered over all the ranks holding them.)
    allreduce += (st_.trained_sharded - st_.trained_sharded_experts) / eo.shard_size * r_;
    ar_from += fmt::format(" + this rank's shard across {} replicas", sp_.replicas);
  }
  if (st_.trained_experts > 0) {
    // This rank's experts are reduced over the ranks holding the same ones, if there are any.
    const int64_t holders = world_ / placed_.moe.ep_size;
    if (holders == 1) allreduce -= st_.trained_experts * r_;
    ar_from += holders > 1 ? fmt::format(
                                 " (of them {} of this rank's experts, over the {} ranks "
                                 "holding them)",
                                 n3(st_.trained_experts), holders)
                           : fmt::format(
                                 ", less this rank's {} expert elements, which no other "
                                 "rank holds",
                                 n3(st_.trained_experts));
  }
  p_.comm.push_back({"all_reduce", "all-reduce (gradients)", allreduce, ar_from});
  expert_exchange();
}

// Expert parallelism's token exchange: every MoE layer sends each of its rows (tokens x k, h
// wide in the compute dtype) to its expert's rank and gets the output back, in forward and again
// in backward (and once more in the recompute of a checkpointed layer); with even routing a share
// (N-1)/N of them leaves the rank, with a headroom for the imbalance routers show.
constexpr double kExchangeHeadroom = 1.25;

void Planner::expert_exchange() {
  const int64_t n = placed_.moe.ep_size;
  if (n == 1) return;
  const model::ModelConfig& mc = shape_.mc;
  const int64_t moe_layers = mc.num_moe_layers();
  const int64_t rows = s_.train.micro_batch * s_.data.seq_len * mc.moe.experts_per_token;
  const bool recompute = s_.train.activation_checkpointing == "full";
  const int64_t passes =
      expert_exchanges_per_micro_batch(mc, s_) / std::max<int64_t>(1, moe_layers);
  const double bytes =
      static_cast<double>(s_.train.grad_accum * moe_layers * passes * rows * mc.hidden_size * c_) *
      static_cast<double>(n - 1) / static_cast<double>(n) * kExchangeHeadroom;
  p_.comm.push_back(
      {"all_to_all", "all-to-all (expert parallelism's tokens, sent)", static_cast<int64_t>(bytes),
       fmt::format("{} micro-batches x {} MoE layers x {} exchanges{} x {} rows x {} x {} B x "
                   "{}/{} leaving the rank x {} for uneven routing",
                   s_.train.grad_accum, moe_layers, passes,
                   recompute ? " (with the checkpointed recompute)" : "", n3(rows), mc.hidden_size,
                   c_, n - 1, n, kExchangeHeadroom)});
}

// The elements of the model files a rank reads for `held` elements of parameter `index`. An NF4
// projection quantized at load is read as the values of the blocks it holds (with double
// quantization, whose offset needs every block, the whole weight), and those are quantized; one
// saved in NF4 is read as the bytes held.
int64_t Planner::read_elements_of(size_t index, int64_t held) {
  const int64_t values = nf4_values_[index];
  if (values == 0 || held == 0 || shape_.mc.quant.in_files) return held;
  const int64_t read =
      shape_.mc.quant.double_quant
          ? values
          : static_cast<int64_t>(static_cast<double>(values) * static_cast<double>(held) /
                                 static_cast<double>(params_[index].numel));
  st_.quantize_values += read;
  return read;
}

// ---- time to the first step ----

void Planner::first_step() {
  const double load_s = read_or_init() + quantize_at_load();
  const int64_t state_all = state_dev_ + (gpu_ ? st_.offloaded() : 0);
  const double alloc_s = static_cast<double>(state_all) / kAllocBytesPerS;
  p_.startup.push_back(
      {"allocate", "allocate and fill this rank's state", state_all,
       fmt::format("{} (offloaded host state included) at {}/s: {:.0f} s", human_bytes(state_all),
                   human_bytes(static_cast<int64_t>(kAllocBytesPerS)), alloc_s)});
  p_.first_step_s = load_s + alloc_s;
}

// ---- the offloaded optimizer's part of each step ----

// The host's work and the copies per rank per step with state offloaded: the optimizer's
// (optimizer_on_host) and, on a GPU, the offloaded parameter shards' (param_shards_up); against
// the step's model FLOPs.
void Planner::offload_step() {
  const parallel::EngineOptions& eo = sp_.engine;
  if (eo.offload_optimizer) optimizer_on_host();
  if (gpu_ && eo.offload_params && st_.host_param > 0) param_shards_up();
  if (p_.offload_step.empty()) return;
  p_.offload_params_only = !eo.offload_optimizer;
  const model::ModelConfig& mc = shape_.mc;
  p_.step_flops =
      model::training_flops(mc, s_.data.seq_len,
                            s_.lora.enabled ? s_.lora.target_modules : std::vector<std::string>{},
                            s_.lora.r)
          .per_token() *
      static_cast<double>(s_.train.micro_batch * s_.data.seq_len * s_.train.grad_accum);
}

// Offloaded parameter shards (zero3 offload_param, fsdp cpu_offload) on a GPU: each gather first
// copies the rank's shard of the unit up from host memory (Engine::shard_up, on a stream of its
// own, then the collective): every micro-batch the root's and every layer's, and the layers' again
// in backward where the forward released them (reshard_after_forward; the root stays gathered).
void Planner::param_shards_up() {
  const parallel::EngineOptions& eo = sp_.engine;
  const int64_t micro = s_.train.grad_accum;
  const int64_t root = std::min(st_.host_param, st_.root_bytes / std::max(1, eo.shard_size));
  const int64_t again = eo.reshard_after_forward ? st_.host_param - root : 0;
  const int64_t up = micro * (st_.host_param + again);
  const double s = static_cast<double>(up) / kPcieBytesPerS;
  p_.offload_step.push_back(
      {"param_shards_up", "parameter shards up before their gathers", up,
       fmt::format(
           "{} micro-batch(es) x ({} forward{}) at {}/s (assumed): {:.2f} s", micro,
           human_bytes(st_.host_param),
           again > 0 ? fmt::format(" + {} again in backward", human_bytes(again)) : std::string(),
           human_bytes(static_cast<int64_t>(kPcieBytesPerS)), s)});
  p_.offload_step_s += s;
}

// The offloaded optimizer: AdamW over the rank's trained elements on the threads it gets, and on
// a GPU the gradients' host additions and copies down (every micro-batch) and the updated values'
// copy up. Each host pass takes its time per element on the rank's threads, or its bytes through
// the node's memory shared by the node's ranks, whichever is longer (host_pass_s). Overlapped
// (strategy.overlap_host_step) the update runs beside the next step's forward, which hides at
// most the forward's time; delayed, beside all of it.
void Planner::optimizer_on_host() {
  const parallel::EngineOptions& eo = sp_.engine;
  const Budget& b = in_.budget;
  const int64_t n = st_.host_grad / m_ / (delayed_update() ? 2 : 1);
  const int threads = b.host_cores > 0 ? std::max(1, b.host_cores / layout_.nproc_per_node) : 1;
  const double ns = b.host_adamw_ns > 0 ? b.host_adamw_ns : kHostAdamwNs;
  const int64_t update_bytes = n * (8 * m_ + (c_ != m_ ? c_ : 0));
  std::string from = fmt::format(
      "{} trained elements x {:.2f} ns on one thread ({}) / {} thread(s){}", n3(n), ns,
      b.host_adamw_ns > 0 ? "measured on this machine" : "assumed", threads,
      b.host_cores > 0
          ? fmt::format(" ({} {} cores / {} ranks)",
                        b.host_cores_from.empty() ? "this machine's" : b.host_cores_from + ":",
                        b.host_cores, layout_.nproc_per_node)
          : "");
  const double update_s =
      host_pass_s(static_cast<double>(n) * ns * 1e-9 / threads, update_bytes, from);
  p_.offload_step.push_back(
      {"host_update", "AdamW on the host (clip, zeroing, copy in one pass)", update_bytes, from});
  p_.offload_step_s = update_s;
  p_.host_memory_bps = b.host_memory_bps;
  p_.offload_delayed = delayed_update();
  p_.offload_overlapped = !p_.offload_delayed && s_.strategy.overlap_host_step;
  p_.offload_during_backward =
      p_.offload_overlapped && parallel::update_can_begin_in_backward(eo, s_.train.grad_clip);
  if (gpu_) gradients_through_host(n, threads);
}

// On a GPU: each micro-batch's gradients come down and are added into the host accumulators
// (with each final gradient's clip norm, on the same thread: Engine::final_sq), and the updated
// values go up.
void Planner::gradients_through_host(int64_t n, int threads) {
  const parallel::EngineOptions& eo = sp_.engine;
  const int64_t micro = s_.train.grad_accum;
  // Bytes per gradient element that come down: reduced in the reduce dtype, or, unsharded (one
  // rank), as the backward made it, in the compute dtype (Engine::on_param_grad).
  const int64_t d = eo.shard_size > 1 ? r_ : c_;
  const int64_t adds_bytes = micro * n * (d + 2 * m_) + n * m_;
  std::string adds_from = fmt::format(
      "({} micro-batch(es) x {:.2f} ns + the norm's {:.2f} ns) x {} elements "
      "(assumed) / {} thread(s)",
      micro, kHostAddNs, kHostNormNs, n3(n), threads);
  const double adds_s = host_pass_s(
      (static_cast<double>(micro * n) * kHostAddNs + static_cast<double>(n) * kHostNormNs) * 1e-9 /
          threads,
      adds_bytes, adds_from);
  adds_from += ", beside the backward";
  p_.offload_step.push_back(
      {"host_adds", "host additions of the gradients, their norms", adds_bytes, adds_from});
  p_.offload_step_s += adds_s;
  const int64_t down = micro * n * d, up = eo.offload_params ? 0 : n * c_;
  const double copy_s = static_cast<double>(down + up) / kPcieBytesPerS;
  p_.offload_step.push_back(
      {"host_copies", "gradients down, parameters up", down + up,
       fmt::format("{} micro-batch(es) x {} x {} B down{} at {}/s (assumed): {:.2f} s", micro,
                   n3(n), d,
                   up > 0 ? fmt::format(" + {} x {} B up", n3(n), c_)
                          : std::string(" (parameters offloaded too: the update writes "
                                        "their host shards, which go up with their gathers)"),
                   human_bytes(static_cast<int64_t>(kPcieBytesPerS)), copy_s)});
  p_.offload_step_s += copy_s;
}

// A host pass of one rank: `compute_s` on its threads, or its `bytes` through the node's memory
// at the measured bandwidth shared by the node's ranks (their host steps run at once), whichever
// is longer; `from` gets both and the result (": 1.23 s").
double Planner::host_pass_s(double compute_s, int64_t bytes, std::string& from) const {
  const Budget& b = in_.budget;
  if (b.host_memory_bps <= 0) {
    from += fmt::format(": {:.2f} s", compute_s);
    return compute_s;
  }
  const int ranks = layout_.nproc_per_node;
  const double memory_s = static_cast<double>(bytes) * ranks / b.host_memory_bps;
  from += fmt::format(
      " = {:.2f} s; its {} through the node's memory at {}/s ({}){}: {:.2f} s; {}: {:.2f} s",
      compute_s, human_bytes(bytes), human_bytes(static_cast<int64_t>(b.host_memory_bps)),
      b.host_memory_from.empty() ? "given" : b.host_memory_from,
      ranks > 1 ? fmt::format(" shared by {} ranks", ranks) : "", memory_s,
      memory_s > compute_s ? "memory-bound" : "compute-bound", std::max(compute_s, memory_s));
  return std::max(compute_s, memory_s);
}

// NF4 at load: the projection values this rank quantizes, on its threads.
double Planner::quantize_at_load() {
  if (st_.quantize_values == 0) return 0;
  const Budget& b = in_.budget;
  const int threads = b.host_cores > 0 ? std::max(1, b.host_cores / layout_.nproc_per_node) : 1;
  const double s = static_cast<double>(st_.quantize_values) / (kNf4QuantizePerThreadS * threads);
  p_.startup.push_back(
      {"quantize", "quantize the projections to NF4", st_.quantize_values / 2,
       fmt::format("{} values on {} thread(s) at {:.0e}/s each (assumed){}: {:.0f} s",
                   n3(st_.quantize_values), threads, kNf4QuantizePerThreadS,
                   shape_.mc.quant.double_quant ? " (double quantization: every weight whole)"
                   : shape_.file_bytes == 0     ? " (random init: every weight whole)"
                                                : "",
                   s)});
  return s;
}

// Reading the model files, or drawing the random init: its item, and its seconds.
double Planner::read_or_init() {
  const Budget& b = in_.budget;
  if (shape_.file_bytes > 0) {
    const double bps = b.disk_read_bytes_per_s > 0 ? b.disk_read_bytes_per_s : kDefaultDiskBps;
    // Ranks of a node reading the same bytes share the page cache.
    const int64_t node_bytes =
        std::min<int64_t>(shape_.file_bytes, layout_.nproc_per_node * st_.read_elements *
                                                 std::max<int64_t>(1, shape_.file_element));
    const double read_s = static_cast<double>(node_bytes) / bps;
    p_.startup.push_back(
        {"read", "read the model files", node_bytes,
         fmt::format("{} per node at {}/s ({}): {:.0f} s", human_bytes(node_bytes),
                     human_bytes(static_cast<int64_t>(bps)),
                     b.disk_read_from.empty() ? "assumed" : b.disk_read_from, read_s)});
    return read_s;
  }
  // Every rank draws the whole init stream (the values do not depend on the layout).
  const double init_rate = b.init_elements_per_s > 0 ? b.init_elements_per_s : kDefaultInitPerS;
  const double init_s = static_cast<double>(p_.parameters) / init_rate;
  p_.startup.push_back(
      {"init", "random init", p_.parameters * 4,
       fmt::format("every rank draws all {} values at {:.0e}/s ({}): {:.0f} s", n3(p_.parameters),
                   init_rate, b.init_elements_per_s > 0 ? "measured" : "assumed", init_s)});
  return init_s;
}

// ---- checks ----

void Planner::checks() {
  const Budget& b = in_.budget;
  if (gpu_)
    p_.checks.push_back(
        {"GPU memory", "each GPU (rank 0 needs most)", p_.device_peak, b.gpu_bytes, b.gpu_from});
  p_.checks.push_back({"host memory", "each node", p_.host_peak, b.host_bytes, b.host_from});
  p_.checks.push_back({"disk", "--output's filesystem", p_.disk_need, b.disk_bytes, b.disk_from});
}

}  // namespace

bool Plan::fits() const { return shortfall() == nullptr; }

const Check* Plan::shortfall() const {
  for (const auto& c : checks)
    if (!c.fits()) return &c;
  return nullptr;
}

int64_t expert_exchanges_per_micro_batch(const model::ModelConfig& mc, const config::Settings& s) {
  return mc.num_moe_layers() * (s.train.activation_checkpointing == "full" ? 6 : 4);
}

Plan make_plan(const PlanInputs& in, bool suggest) {
  Plan p = Planner(in).plan();
  if (suggest && !p.fits()) add_suggestions(in, p);
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
                     first.empty() ? "none of the changes ft knows makes it fit, alone or up to "
                                     "three together (`ft plan` lists each, re-planned)"
                                   : "to make it fit: " + first);
}

std::string plan_text(const Plan& p) {
  std::string o;
  auto line = [&](const Item& i) {
    o += fmt::format("  {:<52} {:>10}   {}\n", i.label, human_bytes(i.bytes), i.from);
  };
  o += fmt::format(
      "ft plan: {} parameters ({} trained{}) from {}\n", n3(p.parameters), n3(p.trained_parameters),
      p.nf4_parameters > 0 ? fmt::format("; {} in NF4", n3(p.nf4_parameters)) : "", p.model_from);
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
  if (!p.offload_step.empty()) {
    if (p.offload_params_only)
      o += fmt::format(
          "\noffloaded parameter shards, per rank per step: about {:.2f} s of copies up, each "
          "before its unit's gather, on a stream of their own beside the compute\n",
          p.offload_step_s);
    else
      o += fmt::format(
          "\noffloaded optimizer, per rank per step: about {:.2f} s of host work, {}\n",
          p.offload_step_s,
          p.offload_delayed ? "the update's part overlapped with the next step (delayed update)"
          : p.offload_during_backward
              ? "the update's part beside the backward and the next step's forward "
                "(overlapped update, clipping off)"
          : p.offload_overlapped
              ? "the update's part beside the next step's forward (overlapped update)"
              : "not overlapped with the device's (strategy.overlap_host_step=false)");
    for (const auto& i : p.offload_step) line(i);
    if (p.offload_step_s > 0 && p.device_name == "GPU") {
      // A stated reference rate, not a measurement: 40% of an H100's dense bf16 peak.
      const double ref = 400e12, compute_s = p.step_flops / ref;
      o += fmt::format(
          "  the step's compute: {:.3g} model FLOPs per rank, {:.2f} s at 400 TFLOP/s (40% of an "
          "H100's dense bf16 peak): the host's part adds {:.0f}% to that; it equals the compute "
          "on a device achieving {:.0f} TFLOP/s\n",
          p.step_flops, compute_s, 100 * p.offload_step_s / compute_s,
          p.step_flops / p.offload_step_s / 1e12);
    }
  }
  for (const auto& n : p.notes) o += "\nnote: " + n + "\n";
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
  j["model_files_estimated"] = p.model_files_estimated;
  j["strategy"] = p.strategy;
  j["parameters"] = p.parameters;
  j["trained_parameters"] = p.trained_parameters;
  j["nf4_parameters"] = p.nf4_parameters;
  j["nf4_bytes"] = p.nf4_bytes;
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
  if (!p.offload_step.empty())
    j["offload_step"] = {{"seconds", p.offload_step_s},
                         {"delayed", p.offload_delayed},
                         {"overlapped", p.offload_overlapped},
                         {"during_backward", p.offload_during_backward},
                         {"step_flops", p.step_flops},
                         {"items", items(p.offload_step)},
                         {"parameters_only", p.offload_params_only}};
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
                   {"fits", g.fits},
                   {"changes", g.changes}});
  j["suggestions"] = sug;
  j["notes"] = p.notes;
  j["verdict"] = verdict(p);
  return j;
}

}  // namespace ft::plan

#include "train/export.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

#include "ckpt/checkpoint.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/json.h"
#include "core/strings.h"
#include "io/durable_file.h"
#include "model/decoder.h"
#include "model/lora.h"
#include "model/moe.h"
#include "train/run_dir.h"
#include "train/saved_model.h"
#include "train/trainer.h"
#include "train/weights.h"

namespace ft::train {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kParam = "param/";
const char* const kOtherModel =
    " (is it a checkpoint of another model? --base-model must be the model it was trained from)";

std::string dtype_label(at::ScalarType t) {
  return t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : "float32";
}

// The dtype the weights are stored in: --dtype, or for auto the run's compute dtype (fp32 for an
// fp64 run: nothing loads fp64 Llama weights).
at::ScalarType resolve_dtype(const std::string& dtype, const std::string& precision) {
  const std::string d = dtype == "auto" ? (precision == "fp64" ? "fp32" : precision) : dtype;
  FT_CHECK(d == "fp32" || d == "bf16" || d == "fp16",
           "--dtype must be auto, fp32, bf16 or fp16, got '", dtype, "'");
  return parse_dtype(d);
}

// ft's precision name of a stored dtype.
std::string precision_of(at::ScalarType t) {
  return t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : t == at::kDouble ? "fp64" : "fp32";
}

bool is_empty_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec) && fs::is_empty(p, ec) && !ec;
}

std::string read_text(const fs::path& path) { return read_text_file<FormatError>(path.string()); }

// A run's final/ holds a complete saved model: its config is written after its weights.
bool is_final_model(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / "config.json", ec) ||
         fs::is_regular_file(dir / "adapter_config.json", ec);
}

std::string steps_list(const std::vector<std::string>& committed) {
  std::string out;
  for (auto it = committed.rbegin(); it != committed.rend(); ++it)
    out += (out.empty() ? "" : ", ") + std::to_string(ckpt::step_of_dir(*it));
  return out.empty() ? "none" : out;
}

// A run directory (or its checkpoints/ folder): that step's checkpoint, or its newest state.
ExportChoice choose_in_run(const fs::path& p, int64_t step) {
  std::error_code ec;
  const bool in_ckpts = !fs::is_directory(p / "checkpoints", ec) &&
                        fs::path(p).lexically_normal().filename() == "checkpoints";
  const fs::path run = in_ckpts ? p.parent_path() : p;
  const fs::path root = in_ckpts ? p : p / "checkpoints";
  std::vector<std::string> committed;
  if (fs::is_directory(root, ec)) committed = ckpt::list_committed(root.string());
  if (committed.empty() && fs::is_directory(p, ec)) committed = ckpt::list_committed(p.string());
  const bool finished = is_final_model(run / "final");
  const int64_t fstep = finished ? final_step(run) : -1;
  if (step >= 0) {
    for (const auto& c : committed)
      if (ckpt::step_of_dir(c) == step)
        return {c, false, step, fmt::format("checkpoint step {} (asked for with --step)", step)};
    throw ConfigError(fmt::format(
        "--step {}: {} holds no committed checkpoint of step {} (committed: {}{}); drop --step to "
        "export the run's newest state",
        step, p.string(), step, steps_list(committed),
        finished ? fmt::format("; final/ holds step {}", fstep) : std::string()));
  }
  const int64_t newest = committed.empty() ? -1 : ckpt::step_of_dir(committed.front());
  if (finished && (fstep < 0 || fstep >= newest)) {
    const std::string at =
        fstep < 0 ? "its step unknown: no final_save.json" : fmt::format("step {}", fstep);
    return {(run / "final").string(), true, fstep,
            committed.empty()
                ? fmt::format("final/ of the finished run ({})", at)
                : fmt::format("final/ of the finished run ({}); older: checkpoints of steps {} "
                              "(--step N exports one)",
                              at, steps_list(committed))};
  }
  if (!committed.empty()) {
    return {committed.front(), false, newest,
            finished ? fmt::format("the newest committed checkpoint, step {}: newer than final/ "
                                   "(step {}), so the run went on after it finished",
                                   newest, fstep)
                     : fmt::format("the newest committed checkpoint, step {} (the run has not "
                                   "finished: no final/)",
                                   newest)};
  }
  throw ConfigError(fmt::format(
      "--checkpoint {}: nothing to export: it holds no final/ model, no {} and no committed "
      "step-<N> directory (in it or in {}/checkpoints); give a run's --output once it has "
      "finished or committed a checkpoint (output.save_every), or a step directory",
      p.string(), ckpt::kMetaFile, p.string()));
}

}  // namespace

ExportChoice choose_export_source(const std::string& dir, int64_t step) {
  FT_CHECK(!dir.empty(), "--checkpoint is required");
  const fs::path p(dir);
  std::error_code ec;
  FT_CHECK(fs::exists(p, ec), "--checkpoint ", dir, ": no such directory");
  FT_CHECK(fs::is_directory(p, ec), "--checkpoint ", dir, ": not a directory");
  const std::string name =
      p.filename().empty() ? p.parent_path().filename().string() : p.filename().string();
  const bool one_state = fs::is_regular_file(p / ckpt::kMetaFile, ec) || is_final_model(p);
  FT_CHECK(step < 0 || !one_state, "--step ", step, ": ", dir,
           " is one saved state already; give the run's --output directory with --step, or "
           "drop --step");
  if (fs::is_regular_file(p / ckpt::kMetaFile, ec))
    return {dir, false, ckpt::Checkpoint::open(dir).step(), "the checkpoint given"};
  if (is_final_model(p)) {
    const fs::path run = fs::absolute(p, ec).lexically_normal().parent_path();
    const int64_t s = name == "final" ? final_step(run) : -1;
    return {dir, true, s, "the saved model given"};
  }
  FT_CHECK(name.rfind("step-", 0) != 0, "--checkpoint ", dir, ": not a committed checkpoint (no ",
           ckpt::kMetaFile,
           "): its save did not finish, or its meta.json was lost; export another step, or the "
           "run's output directory for its newest state");
  return choose_in_run(p, step);
}

namespace {

// What the run that wrote the exported state says about itself.
struct RunState {
  std::optional<config::Settings> settings;  // the run's resolved preset, when known
  bool lora = false;
  std::string base_model;  // the --model directory, "" for random init
  std::string tokenizer;   // the --tokenizer file, "" when none (or an older checkpoint)
  std::string precision;   // precision.mode, or a final/'s stored dtype without its run
  // The records' chat template to write as chat_template.jinja; "" for none, nullopt for a
  // checkpoint from before checkpoints recorded it (then the model's own file is copied).
  std::optional<std::string> chat_template;
  std::optional<model::LoraConfig> lora_config;  // a final/'s adapter_config.json
  std::optional<model::ModelConfig> config;      // a full final/'s config.json
  std::vector<std::string> own_files;            // a final/'s tokenizer files
};

// The trained tensors: a checkpoint's param/ tensors or a final/'s safetensors.
class Trained {
 public:
  std::unique_ptr<ckpt::Checkpoint> ck;
  std::unique_ptr<io::SafetensorsIndex> model;   // full final/
  std::unique_ptr<io::SafetensorsFile> adapter;  // LoRA final/

  // A full final/ holds a MoE model's experts per expert, as transformers saves them: each fused
  // parameter (model/moe.h) with its shape and the file tensors it is made of.
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<model::ExpertFilePiece>>> fused;
  void map_experts(const model::ModelConfig& config, const ParamShapes& params) {
    if (!model) return;
    for (const auto& [name, shape] : params) {
      if (model->has(name)) continue;
      auto pieces = model::expert_file_pieces(config, name);
      if (!pieces.empty() && model->has(pieces.front().file_name))
        fused[name] = {shape, std::move(pieces)};
    }
  }

  std::vector<std::string> names() const {
    if (model && !fused.empty()) {
      std::set<std::string> held;
      for (const auto& n : model->names()) held.insert(n);
      for (const auto& [name, fp] : fused) {
        for (const auto& piece : fp.second) held.erase(piece.file_name);
        held.insert(name);
      }
      return {held.begin(), held.end()};
    }
    if (model) return model->names();
    if (adapter) return adapter->names();
    std::vector<std::string> held;
    for (const auto& t : ck->tensors())
      if (t.rfind(kParam, 0) == 0) held.push_back(t.substr(kParam.size()));
    return held;
  }
  std::vector<int64_t> shape(const std::string& name) const {
    if (const auto it = fused.find(name); it != fused.end()) return it->second.first;
    if (model) return model->info(name).shape;
    if (adapter) return adapter->info(name).shape;
    return ck->shape(kParam + name);
  }
  // The whole tensor in fp32 (a checkpoint's chunks checksummed on the way).
  at::Tensor read(const std::string& name) const {
    at::Tensor t = at::empty(shape(name), at::kFloat);
    if (const auto it = fused.find(name); it != fused.end()) {
      for (const auto& piece : it->second.second) {
        at::Tensor dst = t.view({-1}).narrow(0, piece.offset, piece.numel()).view(piece.shape);
        model->copy_to(piece.file_name, dst);
      }
    } else if (model) {
      model->copy_to(name, t);
    } else if (adapter) {
      adapter->copy_to(name, t);
    } else {
      ck->read_range(kParam + name, 0, t.numel(), t);
    }
    return t;
  }
};

RunState checkpoint_state(const ckpt::Checkpoint& ck) {
  const json& s = ck.state();
  const std::string meta = (fs::path(ck.dir()) / ckpt::kMetaFile).string();
  auto str = [&](const char* key) {
    if (!s.contains(key)) return std::string();
    FT_CHECK_T(FormatError, s.at(key).is_string(), meta, ": state.", key, " is not a string");
    return s.at(key).get<std::string>();
  };
  FT_CHECK_T(FormatError, s.is_object() && s.contains("preset") && s.at("preset").is_object(), meta,
             ": state.preset is missing (not a checkpoint ft train wrote?)");
  FT_CHECK_T(FormatError, s.contains("lora") && s.at("lora").is_boolean(), meta,
             ": state.lora is missing or not a boolean");
  RunState r;
  r.settings = config::settings_from_json(s.at("preset"), meta + ": state.preset");
  r.lora = s.at("lora").get<bool>();
  r.base_model = str("base_model");
  r.tokenizer = str("tokenizer");
  r.precision = r.settings->precision.mode;
  if (s.contains("chat_template")) r.chat_template = str("chat_template");
  return r;
}

// A final/: its own files say what it is; the run's preset.json beside it, when there, says how
// it was trained (the precision, the shape and seed of a random-init base).
RunState final_state(const fs::path& dir, Trained& trained) {
  RunState r;
  std::error_code ec;
  const fs::path preset = fs::absolute(dir, ec).lexically_normal().parent_path() / "preset.json";
  if (fs::is_regular_file(preset, ec))
    r.settings = config::settings_from_json(
        parse_json<FormatError>(read_text(preset), preset.string()), preset.string());
  r.lora = fs::is_regular_file(dir / "adapter_config.json", ec);
  if (r.lora) {
    r.lora_config = model::load_lora_config((dir / "adapter_config.json").string());
    r.base_model = r.lora_config->base_model_name_or_path;
    trained.adapter = std::make_unique<io::SafetensorsFile>(
        io::SafetensorsFile::open((dir / "adapter_model.safetensors").string()));
  } else {
    r.config = model::load_model_config((dir / "config.json").string());
    trained.model =
        std::make_unique<io::SafetensorsIndex>(io::SafetensorsIndex::open(dir.string()));
  }
  r.chat_template = "";  // final/ carries its template among its own files
  r.own_files = tokenizer_files_of(dir.string());
  if (r.settings) {
    r.precision = r.settings->precision.mode;
  } else if (trained.model) {
    r.precision = precision_of(trained.model->info(trained.model->names().front()).dtype);
  }
  return r;
}

// Everything the export writes, checked before anything is.
struct ExportPlan {
  ExportChoice choice;
  Trained trained;
  RunState run;
  std::string base;  // the base model directory ("" for random init)
  bool base_here = false;
  bool adapter_only = false;
  at::ScalarType dtype = at::kFloat, compute = at::kFloat;
  std::optional<model::ModelConfig> mc;
  model::LoraConfig lc;
  ParamShapes params;
  std::vector<std::string> held;
  // The adapter of each adapted module: (A, B) names.
  std::map<std::string, std::pair<std::string, std::string>> adapters;
  std::map<std::string, std::string> replaced;  // base name -> the trained tensor in its place
  std::vector<std::string> tokenizer_files, notes;
};

void check_options(const ExportOptions& o, ExportPlan& p) {
  const std::string& src = p.choice.dir;
  const RunState& run = p.run;
  p.adapter_only = run.lora && !o.merge_lora;
  FT_CHECK(!o.merge_lora || run.lora, "--merge-lora: ", src,
           " is a full fine-tune (every weight was trained; it holds no LoRA adapters to merge): "
           "drop --merge-lora");
  FT_CHECK(!p.adapter_only || o.dtype == "auto" || o.dtype == "fp32", "--dtype ", o.dtype, ": ",
           src,
           " is a LoRA run, exported as a PEFT adapter, which is fp32; add --merge-lora to write "
           "the merged model in ",
           o.dtype);
  FT_CHECK(!p.adapter_only || o.max_shard_bytes == 0, "--max-shard-size: ", src,
           " is a LoRA run, exported as a PEFT adapter, which PEFT reads as one file; add "
           "--merge-lora to write a sharded merged model");
  p.base = o.base_model.empty() ? run.base_model : o.base_model;
  std::error_code ec;
  p.base_here = !p.base.empty() && fs::is_regular_file(fs::path(p.base) / "config.json", ec);
  const bool need_base = !p.base.empty() && !p.adapter_only && !run.config;
  FT_CHECK(p.base_here || !need_base, src, " was trained from the model directory ", p.base,
           (o.base_model.empty() ? " (ft train --model)" : " (--base-model)"), ", which the ",
           run.lora ? "merge needs (its weights and config.json)"
                    : "export needs (its config.json: the architecture is not in a checkpoint)",
           ", but ", (fs::path(p.base) / "config.json").string(),
           " does not exist; pass --base-model DIR where that model is now");
  FT_CHECK(!p.base.empty() || p.run.settings || p.run.config || p.adapter_only, src,
           " was trained from a random init, which the merge draws again from the run's preset, "
           "but preset.json is not beside it: export the final/ inside its run directory");
  if (p.run.precision.empty() && p.base_here) {
    const io::SafetensorsIndex base_files = io::SafetensorsIndex::open(p.base);
    p.run.precision = precision_of(base_files.info(base_files.names().front()).dtype);
    p.notes.push_back(
        fmt::format("no preset.json beside {}: --dtype auto is the base model's "
                    "stored dtype ({})",
                    src, p.run.precision));
  }
  if (p.run.precision.empty()) p.run.precision = "fp32";
  p.compute = parse_dtype(p.run.precision);
  p.dtype = p.adapter_only ? at::kFloat : resolve_dtype(o.dtype, p.run.precision);
}

// The architecture: a full final/'s own config.json, the base model's, or the preset's shape for
// a random init. A PEFT adapter does not need it (it is checked against it when the base is here).
void resolve_model(ExportPlan& p) {
  if (p.run.config) {
    p.mc = p.run.config;
  } else if (p.base.empty()) {
    if (p.run.settings) p.mc = model_config_from_preset(p.run.settings->model);
  } else if (p.base_here) {
    p.mc = model::load_model_config((fs::path(p.base) / "config.json").string());
  }
  // A QLoRA run's adapters were trained on the dequantized NF4 base: merged into that.
  if (p.mc && p.run.lora && p.run.settings && !p.run.config)
    apply_base_quant(p.run.settings->lora, p.run.precision, p.base, *p.mc);
  if (p.mc) p.params = model_param_shapes(*p.mc);
  if (p.run.lora)
    p.lc = p.run.lora_config
               ? *p.run.lora_config
               : lora_config_from_preset(p.run.settings->lora, p.base, p.mc ? &*p.mc : nullptr);
}

void check_full(ExportPlan& p) {
  const std::string& src = p.choice.dir;
  const std::set<std::string> held(p.held.begin(), p.held.end());
  std::set<std::string> expected;
  for (const auto& [name, shape] : p.params) {
    FT_CHECK_T(FormatError, held.count(name), src, ": holds no ", name,
               ", but every weight of a full fine-tune is trained and saved", kOtherModel);
    FT_CHECK_T(FormatError, p.trained.shape(name) == shape, src, ": ", name, " has shape ",
               at::IntArrayRef(p.trained.shape(name)), " but the model's config makes it ",
               at::IntArrayRef(shape), kOtherModel);
    expected.insert(name);
  }
  for (const auto& name : p.held)
    FT_CHECK_T(FormatError, expected.count(name), src, ": holds ", name,
               ", which the model does not have", kOtherModel);
}

void check_adapters(ExportPlan& p) {
  const std::string& src = p.choice.dir;
  for (const auto& name : p.held)
    FT_CHECK_T(FormatError, name.rfind("base_model.model.", 0) == 0, src, ": the LoRA run holds ",
               name, ", which is not an adapter");
  if (!p.mc) return;
  const std::set<std::string> held(p.held.begin(), p.held.end());
  std::set<std::string> expected;
  for (const auto& [name, shape] : p.params) {
    const std::string module = model::lora_module_of(name, p.lc);
    auto [a, b] = model::expert_lora_keys(name, p.lc);
    if (module.empty() && a.empty()) continue;
    std::vector<int64_t> a_shape = {p.lc.r, shape[1]}, b_shape = {shape[0], p.lc.r};
    if (!a.empty()) {  // [E, out, in] experts: A [E r, in], B [out, r E]
      a_shape = {shape[0] * p.lc.r, shape[2]};
      b_shape = {shape[1], p.lc.r * shape[0]};
    } else {
      a = model::peft_key(module, 'A');
      b = model::peft_key(module, 'B');
    }
    for (const auto& [t, want] : {std::pair{a, a_shape}, std::pair{b, b_shape}}) {
      FT_CHECK_T(FormatError, held.count(t), src, ": holds no ", t, ", but the run's lora.",
                 module.empty() ? "target_parameters adapt " : "target_modules adapt ",
                 module.empty() ? name : module, kOtherModel);
      FT_CHECK_T(FormatError, p.trained.shape(t) == want, src, ": ", t, " has shape ",
                 at::IntArrayRef(p.trained.shape(t)), " but lora.r and the model make it ",
                 at::IntArrayRef(want), kOtherModel);
      expected.insert(t);
    }
    p.adapters[name] = {a, b};
  }
  // The routers a run with lora.train_router trained in full, under their PEFT names.
  const std::string router = ".mlp.gate.weight";
  for (const auto& [name, shape] : p.params) {
    if (!p.lc.train_router || name.size() < router.size() ||
        name.compare(name.size() - router.size(), router.size(), router) != 0)
      continue;
    const std::string t = "base_model.model." + name;
    FT_CHECK_T(FormatError, held.count(t), src, ": holds no ", t,
               ", but the run's lora.train_router trains ", name, kOtherModel);
    FT_CHECK_T(FormatError, p.trained.shape(t) == shape, src, ": ", t, " has shape ",
               at::IntArrayRef(p.trained.shape(t)), " but the model makes it ",
               at::IntArrayRef(shape), kOtherModel);
    expected.insert(t);
    p.replaced[name] = t;
  }
  for (const auto& name : p.held)
    FT_CHECK_T(FormatError, expected.count(name), src, ": holds ", name,
               ", which adapts no projection of the model", kOtherModel);
}

// The tokenizer files as final/ has them: a final/'s own; for a checkpoint the base model's and
// the run's --tokenizer.
void resolve_tokenizer_files(ExportPlan& p) {
  if (p.choice.final) {
    p.tokenizer_files = p.run.own_files;
    return;
  }
  std::error_code ec;
  p.tokenizer_files = tokenizer_files_of(p.base_here ? p.base : "");
  if (!p.base.empty() && !p.base_here)
    p.notes.push_back(
        fmt::format("the base model {} is not here: its tokenizer files are not "
                    "copied (the adapter does not need them)",
                    p.base));
  if (!p.run.tokenizer.empty()) {
    if (fs::is_regular_file(p.run.tokenizer, ec)) {
      p.tokenizer_files.push_back(p.run.tokenizer);
    } else {
      p.notes.push_back(
          fmt::format("the run's tokenizer {} is missing: not copied", p.run.tokenizer));
    }
  }
}

ExportPlan plan_export(const ExportOptions& o) {
  FT_CHECK(!o.output_dir.empty(), "--output is required");
  ExportPlan p;
  p.choice = choose_export_source(o.checkpoint, o.step);
  std::error_code ec;
  FT_CHECK(!fs::exists(o.output_dir, ec) || is_empty_dir(o.output_dir), "--output ", o.output_dir,
           " exists and is not an empty directory; choose another so nothing is written over");
  if (p.choice.final) {
    p.run = final_state(p.choice.dir, p.trained);
  } else {
    p.trained.ck = std::make_unique<ckpt::Checkpoint>(ckpt::Checkpoint::open(p.choice.dir));
    p.run = checkpoint_state(*p.trained.ck);
  }
  check_options(o, p);
  resolve_model(p);
  if (p.mc) p.trained.map_experts(*p.mc, p.params);
  p.held = p.trained.names();
  FT_CHECK_T(FormatError, !p.held.empty(), p.choice.dir, ": holds no trained tensors");
  if (p.run.lora) {
    check_adapters(p);
  } else {
    check_full(p);
  }
  resolve_tokenizer_files(p);
  return p;
}

// The merged or full model's tensors, each made as its shard is written.
io::DeferredTensors model_tensors(const ExportPlan& p, BaseWeights* base, ExportSummary& sum) {
  io::DeferredTensors tensors;
  const double scale = p.lc.scale();
  const Trained* tr = &p.trained;
  for (const auto& [name, shape] : p.params) {
    std::function<at::Tensor()> make;
    const auto replaced = p.replaced.find(name);
    if (!p.run.lora || replaced != p.replaced.end()) {
      make = [tr, name = p.run.lora ? replaced->second : name, dtype = p.dtype] {
        return tr->read(name).to(dtype);
      };
    } else {
      auto it = p.adapters.find(name);
      make = [tr, base, name = name, dtype = p.dtype, compute = p.compute, scale,
              ab = it == p.adapters.end() ? std::pair<std::string, std::string>{} : it->second] {
        at::Tensor w = base->fp32(name, compute);
        if (!ab.first.empty())
          w = w.dim() == 3
                  ? model::merge_expert_lora(w, tr->read(ab.first), tr->read(ab.second), scale)
                  : model::merge_lora(w, tr->read(ab.first), tr->read(ab.second), scale);
        return w.to(dtype);
      };
    }
    tensors.push_back({name, shape, p.dtype, std::move(make)});
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    sum.bytes += static_cast<uint64_t>(numel) * c10::elementSize(p.dtype);
  }
  sum.tensors = static_cast<int64_t>(tensors.size());
  return tensors;
}

void write_export(const ExportOptions& o, const ExportPlan& p, const std::string& dir,
                  BaseWeights* base, ExportSummary& sum,
                  const std::function<void(const std::string&)>& say) {
  if (p.adapter_only) {
    io::NamedTensors tensors;
    for (const auto& name : p.held) {
      tensors.emplace_back(name, p.trained.read(name));
      sum.bytes += tensors.back().second.nbytes();
    }
    save_peft_adapter(p.lc, tensors, dir);
    sum.tensors = static_cast<int64_t>(tensors.size());
    sum.files = {"adapter_model.safetensors", "adapter_config.json"};
    say(fmt::format("wrote adapter_model.safetensors ({} tensors, {})", tensors.size(),
                    human_bytes(static_cast<int64_t>(sum.bytes))));
  } else {
    const uint64_t max_shard = o.max_shard_bytes ? o.max_shard_bytes : io::kDefaultMaxShardBytes;
    sum.files =
        save_hf_model(*p.mc, model_tensors(p, base, sum), dir, max_shard,
                      [&](const std::string& file, size_t number, size_t count, uint64_t bytes) {
                        say(fmt::format("wrote {} ({}/{}, {})", file, number, count,
                                        human_bytes(static_cast<int64_t>(bytes))));
                      });
  }
  for (const auto& f :
       write_tokenizer_files(p.tokenizer_files, p.run.chat_template.value_or(""), dir))
    sum.files.push_back(f);
}

}  // namespace

ExportSummary export_checkpoint(const ExportOptions& o) {
  // --- check everything before writing anything ---
  const ExportPlan p = plan_export(o);
  auto say = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  say(fmt::format("exporting {}: {}", p.choice.dir, p.choice.why));
  // Random-init bases are drawn (and the model files' headers checked) before anything is written.
  std::unique_ptr<BaseWeights> base_weights;
  if (o.merge_lora)
    base_weights = std::make_unique<BaseWeights>(
        p.base, *p.mc, p.params,
        p.run.settings ? static_cast<uint64_t>(p.run.settings->train.seed) : 0);

  // --- write: into a temporary directory beside the output, renamed into place at the end ---
  ExportSummary sum;
  sum.source = p.choice.dir;
  sum.step = p.choice.step;
  sum.kind = p.adapter_only ? "adapter" : o.merge_lora ? "merged model" : "model";
  sum.dtype = dtype_label(p.dtype);
  fs::path out = fs::path(o.output_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();
  const fs::path tmp =
      out.parent_path() / fmt::format("{}.export-tmp-{}", out.filename().string(), ::getpid());
  std::error_code ec;
  if (!out.parent_path().empty()) {
    fs::create_directories(out.parent_path(), ec);
    FT_CHECK_T(SystemError, !ec, "cannot create ", out.parent_path().string(), ": ", ec.message());
  }
  fs::create_directory(tmp, ec);
  FT_CHECK_T(SystemError, !ec, "cannot create ", tmp.string(), ": ", ec.message());
  for (const auto& n : p.notes) say("note: " + n);
  try {
    write_export(o, p, tmp.string(), base_weights.get(), sum, say);
    // An empty --output directory is replaced by the rename (POSIX rename(2) of directories).
    fs::rename(tmp, out, ec);
    FT_CHECK_T(SystemError, !ec, "cannot rename ", tmp.string(), " to ", out.string(), ": ",
               ec.message());
    io::fsync_parent_dir(out.string());
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    throw;
  }
  return sum;
}

}  // namespace ft::train

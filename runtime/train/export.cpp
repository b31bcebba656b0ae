#include "train/export.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "ckpt/checkpoint.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/strings.h"
#include "io/durable_file.h"
#include "model/llama.h"
#include "model/lora.h"
#include "train/saved_model.h"
#include "train/trainer.h"
#include "train/weights.h"

namespace ft::train {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kParam = "param/";

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

// A tensor of the checkpoint read whole into fp32 (each chunk's checksum checked on the way).
at::Tensor read_whole(const ckpt::Checkpoint& ck, const std::string& tensor) {
  at::Tensor t = at::empty(ck.shape(tensor), at::kFloat);
  ck.read_range(tensor, 0, t.numel(), t);
  return t;
}

bool is_empty_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec) && fs::is_empty(p, ec) && !ec;
}

// What a checkpoint's saved state says about the run.
struct RunState {
  config::Settings settings;  // the run's resolved preset
  bool lora = false;
  std::string base_model;  // the --model directory, "" for random init
  std::string tokenizer;   // the --tokenizer file, "" when none (or an older checkpoint)
};

RunState read_state(const ckpt::Checkpoint& ck) {
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
  return r;
}

}  // namespace

std::string find_checkpoint(const std::string& dir) {
  FT_CHECK(!dir.empty(), "--checkpoint is required");
  const fs::path p(dir);
  std::error_code ec;
  FT_CHECK(fs::exists(p, ec), "--checkpoint ", dir, ": no such directory");
  FT_CHECK(fs::is_directory(p, ec), "--checkpoint ", dir, ": not a directory");
  if (fs::is_regular_file(p / ckpt::kMetaFile, ec)) return dir;
  const std::string name =
      p.filename().empty() ? p.parent_path().filename().string() : p.filename().string();
  FT_CHECK(name.rfind("step-", 0) != 0, "--checkpoint ", dir, ": not a committed checkpoint (no ",
           ckpt::kMetaFile,
           "): its save did not finish; export an earlier one, or the output directory for the "
           "newest committed one");
  for (const fs::path& root : {p / "checkpoints", p}) {
    if (!fs::is_directory(root, ec)) continue;
    const auto found = ckpt::list_committed(root.string());
    if (!found.empty()) return found.front();
  }
  throw ConfigError(fmt::format(
      "--checkpoint {}: not a checkpoint: it holds no {} and no committed step-<N> directory "
      "(in it or in {}/checkpoints); give a step directory or a run's --output with "
      "output.save_every set",
      dir, ckpt::kMetaFile, dir));
}

ExportSummary export_checkpoint(const ExportOptions& o) {
  // --- check everything before writing anything ---
  FT_CHECK(!o.output_dir.empty(), "--output is required");
  const std::string step_dir = find_checkpoint(o.checkpoint);
  std::error_code ec;
  FT_CHECK(!fs::exists(o.output_dir, ec) || is_empty_dir(o.output_dir), "--output ", o.output_dir,
           " exists and is not an empty directory; choose another so nothing is written over");
  const ckpt::Checkpoint ck = ckpt::Checkpoint::open(step_dir);
  const RunState run = read_state(ck);
  const std::string base = o.base_model.empty() ? run.base_model : o.base_model;
  const std::string& precision = run.settings.precision.mode;
  const at::ScalarType compute = parse_dtype(precision);
  const bool adapter_only = run.lora && !o.merge_lora;
  FT_CHECK(!o.merge_lora || run.lora, "--merge-lora: ", step_dir,
           " is a full fine-tune checkpoint (every weight was trained; it holds no LoRA "
           "adapters to merge): drop --merge-lora");
  FT_CHECK(!adapter_only || o.dtype == "auto" || o.dtype == "fp32", "--dtype ", o.dtype, ": ",
           step_dir,
           " is a LoRA checkpoint, exported as a PEFT adapter, which is fp32; add --merge-lora "
           "to write the merged model in ",
           o.dtype);
  FT_CHECK(!adapter_only || o.max_shard_bytes == 0, "--max-shard-size: ", step_dir,
           " is a LoRA checkpoint, exported as a PEFT adapter, which PEFT reads as one file; add "
           "--merge-lora to write a sharded merged model");
  const at::ScalarType dtype = adapter_only ? at::kFloat : resolve_dtype(o.dtype, precision);
  const uint64_t max_shard = o.max_shard_bytes ? o.max_shard_bytes : io::kDefaultMaxShardBytes;

  // The architecture: the base model's config.json, or the preset's shape for a random init. A
  // PEFT adapter does not need it (it is checked against it when the base is at hand).
  const bool base_here = !base.empty() && fs::is_regular_file(fs::path(base) / "config.json", ec);
  const bool need_base = !base.empty() && !adapter_only;
  FT_CHECK(base_here || !need_base, step_dir, " was trained from the model directory ", base,
           (o.base_model.empty() ? " (ft train --model)" : " (--base-model)"), ", which the ",
           run.lora ? "merge needs (its weights and config.json)"
                    : "export needs (its config.json: the architecture is not in a checkpoint)",
           ", but ", (fs::path(base) / "config.json").string(),
           " does not exist; pass --base-model DIR where that model is now");
  std::optional<model::LlamaConfig> mc;
  if (base.empty()) {
    mc = model_config_from_preset(run.settings.model);
  } else if (base_here) {
    mc = model::load_llama_config((fs::path(base) / "config.json").string());
  }

  // The trained tensors the checkpoint holds, against what the model has.
  std::vector<std::string> held;
  for (const auto& t : ck.tensors())
    if (t.rfind(kParam, 0) == 0) held.push_back(t.substr(kParam.size()));
  FT_CHECK_T(FormatError, !held.empty(), step_dir, ": the checkpoint holds no param/ tensors");
  const std::set<std::string> held_set(held.begin(), held.end());
  ParamShapes params;
  if (mc) params = model_param_shapes(*mc);
  const char* const other_model =
      " (is it a checkpoint of another model? --base-model must be the model it was trained "
      "from)";
  model::LoraConfig lc;
  if (run.lora) lc = lora_config_from_preset(run.settings.lora, base);
  // The adapter of each adapted module: (A, B) names.
  std::map<std::string, std::pair<std::string, std::string>> adapters;
  if (!run.lora) {
    std::set<std::string> expected;
    for (const auto& [name, shape] : params) {
      FT_CHECK_T(FormatError, held_set.count(name), step_dir, ": the checkpoint holds no ", kParam,
                 name, ", but every weight of a full fine-tune is trained and saved", other_model);
      FT_CHECK_T(FormatError, ck.shape(kParam + name) == shape, step_dir, ": ", kParam, name,
                 " has shape ", at::IntArrayRef(ck.shape(kParam + name)),
                 " but the model's config makes it ", at::IntArrayRef(shape), other_model);
      expected.insert(name);
    }
    for (const auto& name : held)
      FT_CHECK_T(FormatError, expected.count(name), step_dir, ": the checkpoint holds ", kParam,
                 name, ", which the model does not have", other_model);
  } else {
    for (const auto& name : held)
      FT_CHECK_T(FormatError, name.rfind("base_model.model.", 0) == 0, step_dir,
                 ": the LoRA checkpoint holds ", kParam, name, ", which is not an adapter");
    if (mc) {
      std::set<std::string> expected;
      for (const auto& [name, shape] : params) {
        const std::string module = model::lora_module_of(name, lc);
        if (module.empty()) continue;
        const std::string a = model::peft_key(module, 'A'), b = model::peft_key(module, 'B');
        const std::vector<int64_t> a_shape = {lc.r, shape[1]}, b_shape = {shape[0], lc.r};
        for (const auto& [t, want] : {std::pair{a, a_shape}, std::pair{b, b_shape}}) {
          FT_CHECK_T(FormatError, held_set.count(t), step_dir, ": the checkpoint holds no ", kParam,
                     t, ", but the run's lora.target_modules adapt ", module, other_model);
          FT_CHECK_T(FormatError, ck.shape(kParam + t) == want, step_dir, ": ", kParam, t,
                     " has shape ", at::IntArrayRef(ck.shape(kParam + t)),
                     " but lora.r and the model make it ", at::IntArrayRef(want), other_model);
          expected.insert(t);
        }
        adapters[name] = {a, b};
      }
      for (const auto& name : held)
        FT_CHECK_T(FormatError, expected.count(name), step_dir, ": the checkpoint holds ", kParam,
                   name, ", which adapts no projection of the model", other_model);
    }
  }
  // Random-init bases are drawn (and the model files' headers checked) before anything is written.
  std::unique_ptr<BaseWeights> base_weights;
  if (o.merge_lora)
    base_weights = std::make_unique<BaseWeights>(base, *mc, params,
                                                 static_cast<uint64_t>(run.settings.train.seed));

  // Tokenizer files as final/ has them: the base model's, and the run's --tokenizer.
  std::vector<std::string> tokenizer_files = tokenizer_files_of(base_here ? base : "");
  std::vector<std::string> notes;
  if (!base.empty() && !base_here)
    notes.push_back(
        fmt::format("the base model {} is not here: its tokenizer files are not "
                    "copied (the adapter does not need them)",
                    base));
  if (!run.tokenizer.empty()) {
    if (fs::is_regular_file(run.tokenizer, ec)) {
      tokenizer_files.push_back(run.tokenizer);
    } else {
      notes.push_back(fmt::format("the run's tokenizer {} is missing: not copied", run.tokenizer));
    }
  }

  // --- write: into a temporary directory beside the output, renamed into place at the end ---
  ExportSummary sum;
  sum.checkpoint = step_dir;
  sum.step = ck.step();
  sum.kind = adapter_only ? "adapter" : o.merge_lora ? "merged model" : "model";
  sum.dtype = dtype_label(dtype);
  fs::path out = fs::path(o.output_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();
  const fs::path tmp =
      out.parent_path() / fmt::format("{}.export-tmp-{}", out.filename().string(), ::getpid());
  if (!out.parent_path().empty()) {
    fs::create_directories(out.parent_path(), ec);
    FT_CHECK_T(SystemError, !ec, "cannot create ", out.parent_path().string(), ": ", ec.message());
  }
  fs::create_directory(tmp, ec);
  FT_CHECK_T(SystemError, !ec, "cannot create ", tmp.string(), ": ", ec.message());
  auto say = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  for (const auto& n : notes) say("note: " + n);
  try {
    if (adapter_only) {
      io::NamedTensors tensors;
      for (const auto& name : held) {
        tensors.emplace_back(name, read_whole(ck, kParam + name));
        sum.bytes += tensors.back().second.nbytes();
      }
      save_peft_adapter(lc, tensors, tmp.string());
      sum.tensors = static_cast<int64_t>(tensors.size());
      sum.files = {"adapter_model.safetensors", "adapter_config.json"};
      say(fmt::format("wrote adapter_model.safetensors ({} tensors, {})", tensors.size(),
                      human_bytes(static_cast<int64_t>(sum.bytes))));
    } else {
      io::DeferredTensors tensors;
      const double scale = lc.scale();
      for (const auto& [name, shape] : params) {
        std::function<at::Tensor()> make;
        if (!run.lora) {
          make = [&ck, name = name, dtype] { return read_whole(ck, kParam + name).to(dtype); };
        } else {
          auto it = adapters.find(name);
          BaseWeights* bw = base_weights.get();
          make = [&ck, bw, name = name, dtype, compute, scale,
                  ab = it == adapters.end() ? std::pair<std::string, std::string>{} : it->second] {
            at::Tensor w = bw->fp32(name, compute);
            if (!ab.first.empty())
              w = model::merge_lora(w, read_whole(ck, kParam + ab.first),
                                    read_whole(ck, kParam + ab.second), scale);
            return w.to(dtype);
          };
        }
        tensors.push_back({name, shape, dtype, std::move(make)});
        int64_t numel = 1;
        for (int64_t d : shape) numel *= d;
        sum.bytes += static_cast<uint64_t>(numel) * c10::elementSize(dtype);
      }
      sum.tensors = static_cast<int64_t>(tensors.size());
      sum.files =
          save_hf_model(*mc, tensors, tmp.string(), max_shard,
                        [&](const std::string& file, size_t number, size_t count, uint64_t bytes) {
                          say(fmt::format("wrote {} ({}/{}, {})", file, number, count,
                                          human_bytes(static_cast<int64_t>(bytes))));
                        });
    }
    copy_files_into(tokenizer_files, tmp.string());
    for (const auto& f : tokenizer_files) sum.files.push_back(fs::path(f).filename().string());
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

#include "model/lora.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "core/json.h"

namespace ft::model {

using nlohmann::json;

namespace {
const std::set<std::string> kModules = {"q_proj",   "k_proj",       "v_proj",
                                        "qkv_proj", "o_proj",       "gate_proj",
                                        "up_proj",  "gate_up_proj", "down_proj"};
const std::vector<std::string> kSeparate = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                            "gate_proj", "up_proj", "down_proj"};
const std::vector<std::string> kFused = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
const std::vector<std::string> kAttention = {"q_proj", "k_proj", "v_proj", "o_proj"};

// (module path, projection) pairs of a layer, in PEFT's key order; those the family has.
std::vector<std::pair<std::string, Linear*>> projections(DecoderLayer& L) {
  std::vector<std::pair<std::string, Linear*>> all = {
      {"self_attn.q_proj", &L.q_proj}, {"self_attn.k_proj", &L.k_proj},
      {"self_attn.v_proj", &L.v_proj}, {"self_attn.qkv_proj", &L.qkv_proj},
      {"self_attn.o_proj", &L.o_proj}, {"mlp.gate_proj", &L.gate_proj},
      {"mlp.up_proj", &L.up_proj},     {"mlp.gate_up_proj", &L.gate_up_proj},
      {"mlp.down_proj", &L.down_proj}};
  std::vector<std::pair<std::string, Linear*>> out;
  for (auto& p : all)
    if (p.second->weight.defined()) out.push_back(p);
  return out;
}

std::string leaf(const std::string& path) { return path.substr(path.rfind('.') + 1); }

// A target_parameters entry as the expert parameter it names. PEFT matches an entry against
// "<module path>.<parameter>" by equality or as a dotted suffix; ft adapts the experts of every
// MoE layer, so an entry names one of kExpertParameters whole or by a suffix of it.
std::string expert_parameter_of(const std::string& entry, const std::string& path) {
  for (const auto& p : kExpertParameters)
    if (p == entry ||
        (p.size() > entry.size() && p.compare(p.size() - entry.size(), entry.size(), entry) == 0 &&
         p[p.size() - entry.size() - 1] == '.'))
      return p;
  FT_CHECK_T(FormatError, false, path, ": target_parameters entry '", entry,
             "' is not an expert weight ft adapts (",
             fmt::format("{}", fmt::join(kExpertParameters, " ")),
             "; LoRA on the router or on one layer's experts is not supported)");
  return "";
}

// A target_modules entry as the projection it names. PEFT matches a listed entry against a module
// path by equality or as a dotted suffix, and saves `target_modules="all-linear"` as every
// projection's full path ("model.layers.0.mlp.down_proj"): such an entry names the projection in
// the layers it lists. ft adapts a projection in every layer; an adapter that leaves a layer out
// is refused when its tensors are read (train/weights.cpp: load_adapter names the missing one).
std::string projection_of_target(const std::string& entry, const std::string& path) {
  static const std::regex kPath(R"(((model\.)?layers\.[0-9]+\.)?(self_attn|mlp)\.([a-z_]+))");
  if (entry.find('.') == std::string::npos) return entry;  // a plain name; validate() checks it
  static const std::set<std::string> kMlp = {"gate_proj", "up_proj", "gate_up_proj", "down_proj"};
  std::smatch m;
  const bool ok = std::regex_match(entry, m, kPath) && kModules.count(m[4].str()) &&
                  (m[3] == "mlp") == (kMlp.count(m[4].str()) > 0);
  FT_CHECK_T(FormatError, ok, path, ": target_modules entry '", entry,
             "' is not a projection of a decoder layer ft adapts (a name such as q_proj, or a path "
             "such as model.layers.0.self_attn.q_proj or model.layers.0.mlp.down_proj)");
  return m[4].str();
}
}  // namespace

const std::vector<std::string> kExpertParameters = {"mlp.experts.gate_up_proj",
                                                    "mlp.experts.down_proj"};

double LoraConfig::scale() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

void LoraConfig::validate(const std::string& where) const {
  FT_CHECK(r >= 1, where, ": lora r must be >= 1, got ", r);
  FT_CHECK(alpha > 0, where, ": lora alpha must be > 0, got ", alpha);
  FT_CHECK(dropout >= 0 && dropout < 1, where, ": lora dropout must be in [0, 1), got ", dropout);
  FT_CHECK(!target_modules.empty() || !target_parameters.empty(), where,
           ": lora target_modules and target_parameters are both empty: nothing to adapt");
  for (const auto& p : target_parameters)
    FT_CHECK(
        std::find(kExpertParameters.begin(), kExpertParameters.end(), p) != kExpertParameters.end(),
        where, ": lora target parameter '", p, "' is not an expert weight ft adapts (",
        fmt::format("{}", fmt::join(kExpertParameters, " ")), ")");
  FT_CHECK(target_parameters.empty() || dropout == 0, where, ": lora dropout is ", dropout,
           " but target_parameters adapt the experts: PEFT cannot load an adapter on expert "
           "weights with dropout (its ParamWrapper refuses it), so set lora.dropout to 0");
  for (const auto& m : target_modules)
    FT_CHECK(
        kModules.count(m), where, ": lora target module '", m,
        "' is not a projection ft adapts (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; "
        "qkv_proj gate_up_proj in Phi-3)");
}

const std::vector<std::string>& lora_modules_of(const ModelConfig& model) {
  if (model.moe.enabled() && model.num_moe_layers() == model.num_hidden_layers) return kAttention;
  return model.family().fused_projections ? kFused : kSeparate;
}

void fit_lora_targets(LoraConfig& config, const ModelConfig& model) {
  const std::vector<std::string>& has = lora_modules_of(model);
  std::vector<std::string> sorted = config.target_modules;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::string> all = kSeparate;
  std::sort(all.begin(), all.end());
  // The default: every projection there is; in a MoE model the attention's (its experts are not
  // projections; a Qwen3-MoE's dense layers' MLPs are adapted only when named).
  if (sorted == all) config.target_modules = model.moe.enabled() ? kAttention : has;
  for (const auto& m : config.target_modules)
    FT_CHECK(std::find(has.begin(), has.end(), m) != has.end(), "lora.target_modules: '", m,
             "' is not a projection of a ", model.model_type, " model (it has ",
             fmt::format("{}", fmt::join(has, " ")), ")");
  FT_CHECK(config.target_parameters.empty() || model.moe.enabled(),
           "lora.target_parameters: ", fmt::format("{}", fmt::join(config.target_parameters, " ")),
           " adapt experts, but a ", model.model_type,
           " model has none; leave target_parameters empty");
  FT_CHECK(!config.train_router || model.moe.enabled(), "lora.train_router: a ", model.model_type,
           " model has no router (it is not a mixture of experts); leave it false");
}

std::pair<std::string, std::string> expert_lora_keys(const std::string& param,
                                                     const LoraConfig& config) {
  const auto& targets = config.target_parameters;
  const size_t mlp = param.find(".mlp.");
  if (param.rfind("model.layers.", 0) != 0 || mlp == std::string::npos) return {};
  const auto it = std::find(targets.begin(), targets.end(), param.substr(mlp + 1));
  if (it == targets.end()) return {};
  // Wrapped in kExpertParameters' order: the targets registered after this one wrap it.
  const auto own = std::find(kExpertParameters.begin(), kExpertParameters.end(), *it);
  std::string module = param.substr(0, param.rfind('.'));  // "model.layers.1.mlp.experts"
  for (auto later = own + 1; later != kExpertParameters.end(); ++later)
    if (std::find(targets.begin(), targets.end(), *later) != targets.end()) module += ".base_layer";
  return {peft_key(module, 'A'), peft_key(module, 'B')};
}

std::string peft_key(const std::string& module, char which) {
  return fmt::format("base_model.model.{}.lora_{}.weight", module, which);
}

std::string lora_module_of(const std::string& param, const LoraConfig& config) {
  const std::string suffix = ".weight";
  if (param.rfind("model.layers.", 0) != 0 || param.size() <= suffix.size() ||
      param.compare(param.size() - suffix.size(), suffix.size(), suffix) != 0)
    return "";
  const std::string module = param.substr(0, param.size() - suffix.size());
  const std::string proj = leaf(module);
  const bool targeted =
      kModules.count(proj) && std::find(config.target_modules.begin(), config.target_modules.end(),
                                        proj) != config.target_modules.end();
  return targeted ? module : "";
}

at::Tensor merge_lora(const at::Tensor& weight, const at::Tensor& a, const at::Tensor& b,
                      double scale) {
  FT_ASSERT(weight.dim() == 2 && a.dim() == 2 && b.dim() == 2 && b.size(1) == a.size(0) &&
                weight.size(0) == b.size(0) && weight.size(1) == a.size(1),
            "merge_lora: weight ", weight.sizes(), ", A ", a.sizes(), ", B ", b.sizes());
  at::NoGradGuard no_grad;
  return weight.to(at::kFloat) + at::mm(b.to(at::kFloat), a.to(at::kFloat)).mul_(scale);
}

LoraConfig load_lora_config(const std::string& path) {
  std::ifstream in(path);
  FT_CHECK_T(FormatError, in.good(), "cannot read adapter config ", path);
  std::stringstream text;
  text << in.rdbuf();
  const json j = parse_json<FormatError>(text.str(), path);
  auto str = [&](const char* k, const std::string& d) {
    return j.contains(k) && j[k].is_string() ? j[k].get<std::string>() : d;
  };
  FT_CHECK_T(FormatError, str("peft_type", "LORA") == "LORA", path, ": peft_type \"",
             str("peft_type", ""), "\" is not LORA");
  FT_CHECK_T(FormatError, str("bias", "none") == "none", path, ": bias \"", str("bias", ""),
             "\" is not supported (ft trains no biases in LoRA)");
  const json none = json::array();
  const json& saved = j.contains("modules_to_save") && !j["modules_to_save"].is_null()
                          ? j["modules_to_save"]
                          : none;
  FT_CHECK_T(FormatError, saved.empty() || saved == json::array({"gate"}), path,
             ": modules_to_save ", excerpt(saved.dump(), 120),
             " is not supported: ft trains only a mixture-of-experts model's routers in full "
             "(modules_to_save [\"gate\"], lora.train_router)");
  for (const char* k : {"rank_pattern", "alpha_pattern"})
    FT_CHECK_T(FormatError, !j.contains(k) || j[k].is_null() || j[k].empty(), path, ": ", k,
               " (per-layer ranks) is not supported");
  FT_CHECK_T(FormatError, !j.value("fan_in_fan_out", false), path,
             ": fan_in_fan_out is not supported");
  // Variants that change the adapter's math or where it applies: refused, never ignored.
  for (const char* k : {"use_dora", "lora_bias"})
    FT_CHECK_T(FormatError, !(j.contains(k) && j[k].is_boolean() && j[k].get<bool>()), path, ": ",
               k, " is not supported");
  for (const char* k :
       {"layers_to_transform", "layers_pattern", "exclude_modules", "layer_replication"})
    FT_CHECK_T(FormatError, !j.contains(k) || j[k].is_null() || (j[k].is_array() && j[k].empty()),
               path, ": ", k, " is not supported (ft adapts every layer)");
  LoraConfig c;
  try {
    c.r = j.at("r").get<int64_t>();
    c.alpha = j.value("lora_alpha", static_cast<double>(c.r));
    c.dropout = j.value("lora_dropout", 0.0);
    c.use_rslora = j.value("use_rslora", false);
    c.train_router = !saved.empty();
    c.base_model_name_or_path = str("base_model_name_or_path", "");
    const json& t = j.at("target_modules");
    c.target_modules.clear();
    if (t.is_string()) {
      c.target_modules.push_back(t.get<std::string>());
    } else {
      std::set<std::string> names;
      for (const auto& m : t) names.insert(projection_of_target(m.get<std::string>(), path));
      c.target_modules.assign(names.begin(), names.end());  // sorted, each projection once
    }
    if (j.contains("target_parameters") && !j["target_parameters"].is_null()) {
      std::set<std::string> names;
      for (const auto& p : j["target_parameters"])
        names.insert(expert_parameter_of(p.get<std::string>(), path));
      c.target_parameters.assign(names.begin(), names.end());
    }
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}: {}", path, e.what()));
  }
  std::sort(c.target_modules.begin(), c.target_modules.end());
  try {
    c.validate(path);
  } catch (const ConfigError& e) {
    throw FormatError(e.what());
  }
  return c;
}

std::string lora_config_json(const LoraConfig& c) {
  json j = {{"peft_type", "LORA"},
            {"task_type", "CAUSAL_LM"},
            {"r", c.r},
            {"lora_alpha", c.alpha},
            {"lora_dropout", c.dropout},
            {"target_modules", c.target_modules},
            {"target_parameters",
             c.target_parameters.empty() ? json(nullptr) : json(c.target_parameters)},
            {"use_rslora", c.use_rslora},
            {"bias", "none"},
            {"fan_in_fan_out", false},
            {"init_lora_weights", true},
            {"inference_mode", true},
            {"modules_to_save", c.train_router ? json::array({"gate"}) : json(nullptr)},
            {"base_model_name_or_path", c.base_model_name_or_path}};
  return j.dump(2) + "\n";
}

namespace {
// An adapter pair for a weight of `base`'s options: A [a_rows, in] drawn as PEFT's kaiming-uniform
// (bound 1/sqrt(in)) from `gen`, B [out, b_cols] zero. `shapes_only`: meta tensors, nothing drawn.
// A base that is still shapes only (a strategy will shard it) gets real CPU adapters: the strategy
// reads their values when it lays out its shards.
std::pair<at::Tensor, at::Tensor> new_adapter(const at::Tensor& base, int64_t a_rows, int64_t in,
                                              int64_t out, int64_t b_cols, at::Generator& gen,
                                              bool shapes_only) {
  if (shapes_only) {
    const auto meta = base.options().device(at::kMeta);
    return {at::empty({a_rows, in}, meta), at::empty({out, b_cols}, meta)};
  }
  auto opts = base.options();
  if (base.is_meta()) opts = opts.device(at::kCPU);
  at::Tensor a = at::empty({a_rows, in}, at::kFloat);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  a.uniform_(-bound, bound, gen);
  return {a.to(opts), at::zeros({out, b_cols}, opts)};
}

// The adapters of a MoE layer's targeted expert weights (model/moe.h: ExpertLora), as PEFT's
// nn.Linear(in, r E) and nn.Linear(r E, out); every expert's, also under expert parallelism.
void attach_expert_lora(MoeWeights& moe, const ModelConfig& mc, const LoraConfig& config,
                        at::Generator& gen, bool shapes_only) {
  const int64_t E = mc.moe.num_experts, r = config.r;
  for (const auto& target : config.target_parameters) {
    const bool gate_up = target == kExpertParameters[0];
    const at::Tensor& w = gate_up ? moe.gate_up : moe.down;
    ExpertLora& l = gate_up ? moe.gate_up_lora : moe.down_lora;
    std::tie(l.a, l.b) = new_adapter(w, E * r, w.size(2), w.size(1), r * E, gen, shapes_only);
    l.scale = config.scale();
  }
}
}  // namespace

void attach_lora(DecoderModel& model, const LoraConfig& config, uint64_t seed, bool shapes_only) {
  config.validate("lora");
  const std::vector<std::string>& has = lora_modules_of(model.config());
  for (const auto& m : config.target_modules)
    FT_CHECK(std::find(has.begin(), has.end(), m) != has.end(), "lora target module '", m,
             "' is not a projection of a ", model.config().model_type, " model (it has ",
             fmt::format("{}", fmt::join(has, " ")), ")");
  FT_CHECK(
      (config.target_parameters.empty() && !config.train_router) || model.config().moe.enabled(),
      "lora target_parameters or train_router adapt experts or routers, but a ",
      model.config().model_type, " model has none");
  at::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const std::set<std::string> targets(config.target_modules.begin(), config.target_modules.end());
  for (auto& L : model.layers()) {
    for (auto& [path, lin] : projections(L)) {
      if (!targets.count(leaf(path))) continue;
      const at::Tensor& w = lin->weight;
      std::tie(lin->lora_a, lin->lora_b) = new_adapter(
          w, config.r, lin->in_features(), lin->out_features(), config.r, gen, shapes_only);
      lin->lora_scale = config.scale();
      lin->lora_dropout = config.dropout;
    }
    if (!L.moe.defined()) continue;
    attach_expert_lora(L.moe, model.config(), config, gen, shapes_only);
    L.moe.router_trained = config.train_router;
  }
}

std::vector<NamedTensor> lora_parameters(DecoderModel& model) {
  std::vector<NamedTensor> out;
  auto& layers = model.layers();
  for (size_t i = 0; i < layers.size(); ++i) {
    for (auto& [path, lin] : projections(layers[i])) {
      if (!lin->lora_a.defined()) continue;
      std::string module = fmt::format("model.layers.{}.{}", i, path);
      out.push_back({peft_key(module, 'A'), &lin->lora_a});
      out.push_back({peft_key(module, 'B'), &lin->lora_b});
    }
    MoeWeights& moe = layers[i].moe;
    LoraConfig targets;  // what the layer's adapters target: their PEFT keys' nesting
    if (moe.gate_up_lora.defined()) targets.target_parameters.push_back(kExpertParameters[0]);
    if (moe.down_lora.defined()) targets.target_parameters.push_back(kExpertParameters[1]);
    for (auto [target, l] : {std::pair{&kExpertParameters[0], &moe.gate_up_lora},
                             std::pair{&kExpertParameters[1], &moe.down_lora}}) {
      if (!l->defined()) continue;
      const auto [a, b] = expert_lora_keys(fmt::format("model.layers.{}.{}", i, *target), targets);
      out.push_back({a, &l->a});
      out.push_back({b, &l->b});
    }
    if (moe.router_trained)
      out.push_back(
          {fmt::format("base_model.model.model.layers.{}.mlp.gate.weight", i), &moe.router});
  }
  return out;
}

}  // namespace ft::model

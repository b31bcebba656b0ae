// Fidelity of ft's Llama-family model against Hugging Face transformers and PEFT: the fixtures in
// tests/model/fixtures were written by make_fixtures.py (transformers' own save_pretrained plus its
// logits, loss and gradients); these tests need no Python. Activation checkpointing is checked
// against the same model's plain forward.
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <unordered_map>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/attention.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/fused_loss.h"
#include "model/lora.h"
#include "support/catch_torch.h"
#include "support/numerics.h"
#include "support/subprocess.h"

using namespace ft;
using namespace ft::model;

namespace {

std::string fixture(const std::string& name) {
  return std::string(FT_TEST_DIR) + "/model/fixtures/" + name;
}

// test::rel_error of `a` against the reference `b`, which must have the same shape.
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  return test::rel_error(a, b);
}

DecoderModel load_model(const std::string& dir) {
  DecoderModel m(load_model_config(dir + "/config.json"), at::TensorOptions().dtype(at::kFloat));
  auto files = io::SafetensorsIndex::open(dir);
  m.load([&](const std::string& name, at::Tensor& dst) {
    REQUIRE(files.has(name));
    files.copy_to(name, dst);
  });
  return m;
}

void require_grad(std::vector<NamedTensor> params) {
  for (auto& p : params) p.tensor->requires_grad_(true);
}

// The fixture directories holding a file `marker` (model.safetensors: a model transformers saved;
// adapter_config.json: a PEFT adapter), sorted: every family's, as make_fixtures.py and
// make_family_fixtures.py wrote them.
std::vector<std::string> fixtures_with(const std::string& marker) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(fixture("")))
    if (std::filesystem::exists(e.path() / marker) &&
        std::filesystem::exists(e.path() / "expected.safetensors"))
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("every family's fixtures are here", "[unit]") {
  const auto models = fixtures_with("model.safetensors");
  std::set<std::string> types;
  for (const auto& name : models)
    types.insert(load_model_config(fixture(name) + "/config.json").model_type);
  for (const char* t : {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
                        "olmo2", "granite"}) {
    INFO(t);
    CHECK(types.count(t) == 1);
  }
}

TEST_CASE("logits, loss and gradients equal transformers' (fp32)", "[unit]") {
  for (const std::string& name : fixtures_with("model.safetensors")) {
    DYNAMIC_SECTION(name) {
      std::string dir = fixture(name);
      DecoderModel m = load_model(dir);
      auto expected = io::SafetensorsFile::open(dir + "/expected.safetensors");
      require_grad(m.parameters());
      at::Tensor ids = expected.tensor("input_ids").clone();
      at::Tensor labels = expected.tensor("labels").clone();
      at::Tensor logits = m.forward(ids);
      CHECK(rel_err(logits, expected.tensor("logits")) < 1e-5);
      LossSum ls = causal_lm_loss_sum(logits, labels);
      at::Tensor loss = ls.sum / static_cast<double>(ls.tokens);
      double ref_loss = expected.tensor("loss").item<double>();
      CHECK(std::abs(loss.item<double>() - ref_loss) / ref_loss < 1e-5);
      loss.backward();
      for (auto& p : m.parameters()) {
        INFO(p.name);
        REQUIRE(expected.has("grad." + p.name));
        CHECK(rel_err(p.tensor->grad(), expected.tensor("grad." + p.name)) < 1e-4);
      }
      // The trainer's path: the head and the loss chunk by chunk (5 tokens a chunk), with the
      // family's map of the logits (Gemma 2's cap, Granite's divisor) inside.
      for (auto& p : m.parameters()) p.tensor->mutable_grad() = at::Tensor();
      const at::Tensor hidden = m.hidden_states(ids, {}, false);
      LossSum chunked =
          chunked_lm_loss_sum(hidden, m.lm_head(), labels, true, 5 * m.config().vocab_size, nullptr,
                              nullptr, m.logit_map());
      REQUIRE(chunked.tokens == ls.tokens);
      at::Tensor closs = chunked.sum / static_cast<double>(chunked.tokens);
      CHECK(std::abs(closs.item<double>() - ref_loss) / ref_loss < 1e-5);
      closs.backward();
      for (auto& p : m.parameters()) {
        INFO("chunked: " << p.name);
        CHECK(rel_err(p.tensor->grad(), expected.tensor("grad." + p.name)) < 1e-4);
      }
    }
  }
}

TEST_CASE("LoRA forward and adapter gradients equal PEFT's, PEFT files load, merged weights too",
          "[unit]") {
  for (const std::string& name : fixtures_with("adapter_config.json")) {
    DYNAMIC_SECTION(name) {
      std::string dir = fixture(name);
      // make_fixtures.py writes "../<base fixture>".
      const std::string base =
          load_lora_config(dir + "/adapter_config.json").base_model_name_or_path.substr(3);
      DecoderModel m = load_model(fixture(base));
      LoraConfig lc = load_lora_config(dir + "/adapter_config.json");
      CHECK(lc.r == 4);
      attach_lora(m, lc, 0);
      auto adapter = io::SafetensorsFile::open(dir + "/adapter_model.safetensors");
      auto params = lora_parameters(m);
      CHECK(params.size() == adapter.size());
      for (auto& p : params) {
        INFO(p.name);
        REQUIRE(adapter.has(p.name));
        at::NoGradGuard g;
        adapter.copy_to(p.name, *p.tensor);
      }
      require_grad(params);
      auto expected = io::SafetensorsFile::open(dir + "/expected.safetensors");
      at::Tensor ids = expected.tensor("input_ids").clone();
      at::Tensor logits = m.forward(ids);
      CHECK(rel_err(logits, expected.tensor("logits")) < 1e-5);
      LossSum ls = causal_lm_loss_sum(logits, ids);
      (ls.sum / static_cast<double>(ls.tokens)).backward();
      for (auto& p : params) {
        // PEFT's in-memory names carry the adapter name: "...lora_A.default.weight".
        std::string key = "grad." + p.name.substr(0, p.name.size() - 6) + "default.weight";
        INFO(key);
        REQUIRE(expected.has(key));
        CHECK(rel_err(p.tensor->grad(), expected.tensor(key)) < 1e-4);
      }

      // merge_lora folds each adapter into its projection (PEFT's merge_and_unload): the plain
      // model with merged weights gives PEFT's logits too.
      DecoderModel merged = load_model(fixture(base));
      int folded = 0;
      for (auto& p : merged.parameters()) {
        const std::string module = lora_module_of(p.name, lc);
        if (module.empty()) continue;
        INFO(p.name);
        REQUIRE(adapter.has(peft_key(module, 'A')));
        at::NoGradGuard g;
        p.tensor->copy_(merge_lora(*p.tensor, adapter.tensor(peft_key(module, 'A')),
                                   adapter.tensor(peft_key(module, 'B')), lc.scale()));
        ++folded;
      }
      CHECK(2 * folded == static_cast<int>(adapter.size()));  // every adapter, once
      at::NoGradGuard g;
      CHECK(rel_err(merged.forward(ids), expected.tensor("logits")) < 1e-5);
    }
  }
}

TEST_CASE("lora_module_of names the adapted modules of base parameters", "[unit]") {
  LoraConfig lc;
  lc.target_modules = {"q_proj", "down_proj"};
  CHECK(lora_module_of("model.layers.3.self_attn.q_proj.weight", lc) ==
        "model.layers.3.self_attn.q_proj");
  CHECK(lora_module_of("model.layers.0.mlp.down_proj.weight", lc) ==
        "model.layers.0.mlp.down_proj");
  for (const char* none :
       {"model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.q_proj.bias",
        "model.embed_tokens.weight", "model.layers.1.input_layernorm.weight", "lm_head.weight"})
    CHECK(lora_module_of(none, lc).empty());
}

TEST_CASE("adapter_config.json: PEFT's full module paths (all-linear) name projections", "[unit]") {
  const std::string dir = test::make_temp_dir();
  auto load = [&](const std::string& targets) {
    std::ofstream(dir + "/adapter_config.json")
        << R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": )" << targets << "}";
    return load_lora_config(dir + "/adapter_config.json").target_modules;
  };
  // What PEFT 0.21 saves for target_modules="all-linear" on a 2-layer Phi-3 (a set, unordered).
  CHECK(load(R"(["model.layers.1.self_attn.qkv_proj", "model.layers.0.mlp.down_proj",
                 "model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.gate_up_proj",
                 "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.qkv_proj",
                 "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"])") ==
        std::vector<std::string>{"down_proj", "gate_up_proj", "o_proj", "qkv_proj"});
  // PEFT also matches a dotted suffix of the module path.
  CHECK(load(R"(["self_attn.q_proj", "layers.3.mlp.up_proj", "v_proj"])") ==
        std::vector<std::string>{"q_proj", "up_proj", "v_proj"});
  for (const char* bad : {R"(["model.layers.0.mlp.q_proj"])", R"(["model.embed_tokens"])",
                          R"(["lm_head"])", R"(["model.layers.x.self_attn.q_proj"])",
                          R"(["model.layers.0.self_attn.q_proj.base_layer"])"})
    CHECK_THROWS_WITH(load(bad), Catch::Contains(dir + "/adapter_config.json") &&
                                     Catch::Contains("not a projection"));
}

TEST_CASE("config.json: both rope formats, refusals name the file and key", "[unit]") {
  std::string dir = test::make_temp_dir();
  auto write = [&](const std::string& text) {
    std::ofstream(dir + "/config.json") << text;
    return dir + "/config.json";
  };
  const std::string base =
      R"("vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5)";
  // Llama 3.1's own file format: rope_theta + rope_scaling with rope_type.
  auto c = load_model_config(write("{" + base + R"(, "rope_theta": 500000.0, "rope_scaling":
      {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
       "original_max_position_embeddings": 8192, "rope_type": "llama3"}})"));
  CHECK(c.rope.type == "llama3");
  CHECK(c.rope.theta == 500000.0);
  CHECK(c.head_dim == 8);
  CHECK(c.num_key_value_heads == 2);
  // Older "type" spelling.
  c = load_model_config(
      write("{" + base + R"(, "rope_scaling": {"type": "linear", "factor": 4}})"));
  CHECK(c.rope.type == "linear");
  CHECK(c.rope.factor == 4.0);
  // The config ft writes reads back the same.
  c = load_model_config(write(model_config_json(c)));
  CHECK(c.rope.factor == 4.0);
  // The count the config gives is the model's (shapes only: nothing allocated).
  DecoderModel shapes(c, at::kFloat, /*materialize=*/false);
  int64_t elements = 0;
  for (const auto& p : shapes.parameters()) elements += p.tensor->numel();
  CHECK(c.num_parameters() == elements);

  CHECK_THROWS_WITH(load_model_config(write(R"({"vocab_size": 10})")),
                    Catch::Contains("config.json: required key \"hidden_size\" is missing"));
  CHECK_THROWS_WITH(load_model_config(write(std::string(100000, '[') + std::string(100000, ']'))),
                    Catch::Contains("config.json: JSON nested deeper than 256 levels"));
  CHECK_THROWS_WITH(
      load_model_config(
          write("{" + base + R"(, "rope_scaling": {"rope_type": "dynamic", "factor": 2}})")),
      Catch::Contains("\"rope_scaling\" type 'dynamic' is not supported"));
  CHECK_THROWS_WITH(load_model_config(write("{" + base + R"(, "model_type": "gpt2"})")),
                    Catch::Contains("model_type \"gpt2\""));
  CHECK_THROWS_WITH(load_model_config(write("{" + base + R"(, "hidden_size": "64"})")),
                    Catch::Contains("key \"hidden_size\" has the wrong type"));
  CHECK_THROWS_WITH(load_model_config(write(R"({"vocab_size": 100, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
      "num_key_value_heads": 3})")),
                    Catch::Contains("multiple of num_key_value_heads"));
  // Mistral's window is computed now, on every layer.
  c = load_model_config(write(
      "{" + base +
      R"(, "model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768})"));
  CHECK(c.layer_windows == std::vector<int64_t>{4096, 4096});
  // Families ft knows but does not train are refused by name, with the reason.
  CHECK_THROWS_WITH(
      load_model_config(write("{" + base + R"(, "model_type": "qwen2_moe"})")),
      Catch::Contains("config.json: model_type \"qwen2_moe\" is a mixture-of-experts"));
  // Every family of 2025-26 that transformers trains and ft does not yet, each with its reason
  // (gemma4 got the generic "not a model family" while qwen3_5 got its reason: issue 51).
  for (const char* type :
       {"qwen3_5", "qwen3_5_moe", "gemma4", "gpt_oss", "glm4_moe", "glm4_moe_lite", "deepseek_v3",
        "mistral4", "llama4", "olmo3", "smollm3", "exaone4", "seed_oss", "hunyuan_v1_dense",
        "ernie4_5", "qwen3_next", "granitemoehybrid", "falcon_h1"}) {
    INFO(type);
    CHECK_THROWS_WITH(
        load_model_config(write("{" + base + ", \"model_type\": \"" + type + "\"}")),
        Catch::Contains(std::string("model_type \"") + type + "\" is ") &&
            !Catch::Contains("is not a model family"));
  }
  // MoE families (issue 31): which layers are MoE, and what ft refuses in them.
  c = load_model_config(write("{" + base + R"(, "model_type": "qwen3_moe",
      "decoder_sparse_step": 2, "num_experts": 8})"));
  CHECK(c.moe.layers == std::vector<uint8_t>{0, 1});
  CHECK(load_model_config(write("{" + base + R"(, "model_type": "qwen3_moe", "num_experts": 8,
      "mlp_only_layers": [1]})"))
            .moe.layers == std::vector<uint8_t>{1, 0});
  CHECK(c.moe.experts_per_token == 8);
  CHECK_FALSE(c.moe.norm_topk_prob);
  c = load_model_config(
      write("{" + base + R"(, "model_type": "mixtral", "num_local_experts": 4})"));
  CHECK(c.moe.layers == std::vector<uint8_t>{1, 1});
  CHECK(c.moe.norm_topk_prob);
  CHECK(c.moe.expert_intermediate == c.intermediate_size);
  CHECK_THROWS_WITH(load_model_config(write("{" + base + R"(, "model_type": "mixtral",
      "router_jitter_noise": 0.1})")),
                    Catch::Contains("router_jitter_noise 0.1 is not supported"));
  CHECK_THROWS_WITH(
      load_model_config(write("{" + base + R"(, "model_type": "mixtral",
      "num_local_experts": 2, "num_experts_per_tok": 3})")),
      Catch::Contains("num_experts_per_tok (3) must be between 1 and num_experts (2)"));
  CHECK_THROWS_WITH(load_model_config(write("{" + base + R"(, "model_type": "qwen3_next"})")),
                    Catch::Contains("linear-attention layers"));
  CHECK_THROWS_WITH(load_model_config(write("{" + base + R"(, "model_type": "gemma3"})")),
                    Catch::Contains("multimodal Gemma 3"));
  // A layer kind ft does not implement, a rope type it lacks: refused naming the key.
  CHECK_THROWS_WITH(
      load_model_config(write("{" + base +
                              R"(, "model_type": "qwen3", "layer_types": ["full_attention",
                                 "linear_attention"]})")),
      Catch::Contains("layer_types[1] is \"linear_attention\""));
  CHECK_THROWS_WITH(load_model_config(write("{" + base + R"(, "model_type": "qwen2", "rope_scaling":
          {"rope_type": "yarn", "factor": 4.0}})")),
                    Catch::Contains("\"rope_scaling\" type 'yarn' is not supported"));
  CHECK_THROWS_WITH(
      load_model_config(write("{" + base + R"(, "model_type": "phi3", "resid_pdrop": 0.1})")),
      Catch::Contains("resid_pdrop 0.1 is not supported"));
  CHECK_THROWS_WITH(load_model_config(write("{" + base +
                                            R"(, "model_type": "gemma2", "hidden_activation":
                                               "relu"})")),
                    Catch::Contains("hidden_activation \"relu\" is not supported"));
  CHECK_THROWS_WITH(load_model_config(write("{" + base +
                                            R"(, "model_type": "llama",
                                               "partial_rotary_factor": 0.5})")),
                    Catch::Contains("partial_rotary_factor 0.5 is not supported"));
  // Weights saved quantized: bitsandbytes' NF4 is QLoRA's base (tests/model/qlora_test.cpp);
  // every other method is refused naming it, before any weight's shape is compared.
  const ModelConfig nf4 = load_model_config(write("{" + base + R"(, "quantization_config": {
      "quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_use_double_quant": true}})"));
  CHECK((nf4.quant.nf4 && nf4.quant.in_files && nf4.quant.double_quant));
  CHECK_THROWS_WITH(load_model_config(write("{" + base + R"(, "quantization_config": {
      "quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "fp4"}})")),
                    Catch::Contains("quantization_config: the weights are saved quantized "
                                    "(bitsandbytes 4-bit fp4)") &&
                        Catch::Contains("give --model the model this one was quantized from"));
  CHECK_THROWS_WITH(load_model_config(write("{" + base + R"(, "quantization_config": {
      "quant_method": "bitsandbytes", "load_in_8bit": true}})")),
                    Catch::Contains("(bitsandbytes 8-bit)"));
  for (const std::string method : {"gptq", "awq", "fp8", "compressed-tensors"})
    CHECK_THROWS_WITH(load_model_config(write("{" + base + R"(, "quantization_config": {
        "quant_method": ")" + method + R"(", "bits": 4}})")),
                      Catch::Contains("saved quantized (" + method + ")"));
  CHECK_THROWS_AS(load_model_config(write("{not json")), FormatError);
  CHECK_THROWS_AS(load_model_config(dir + "/missing.json"), FormatError);
}

TEST_CASE("a weight of the wrong shape is refused naming the tensor", "[unit]") {
  std::string dir = test::make_temp_dir();
  auto c = load_model_config(fixture("mistral_gqa") + "/config.json");
  DecoderModel m(c, at::kFloat);
  m.init_random(1);
  io::NamedTensors ts;
  for (auto& p : m.parameters()) ts.push_back({p.name, *p.tensor});
  ts[1].second = at::zeros({3, 3});  // input_layernorm of layer 0
  io::write_safetensors(dir + "/model.safetensors", ts);
  std::ofstream(dir + "/config.json") << model_config_json(c);
  try {
    load_model(dir);
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("model.layers.0.input_layernorm.weight"));
    CHECK_THAT(e.what(), Catch::Contains("model.safetensors"));
  }
}

TEST_CASE("random init is deterministic and transformers-shaped", "[unit]") {
  auto c = load_model_config(fixture("llama3_gqa_tied") + "/config.json");
  DecoderModel a(c, at::kFloat), b(c, at::kFloat), other(c, at::kFloat);
  a.init_random(5);
  b.init_random(5);
  other.init_random(6);
  auto pa = a.parameters(), pb = b.parameters(), po = other.parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) CHECK(at::equal(*pa[i].tensor, *pb[i].tensor));
  CHECK_FALSE(at::equal(*pa[0].tensor, *po[0].tensor));
  CHECK(pa[1].tensor->eq(1).all().item<bool>());  // a norm
  double sd = pa[0].tensor->std().item<double>();
  CHECK(sd == Approx(c.initializer_range).epsilon(0.1));
}

namespace {

// The llama3 fixture's shape (vocabulary 96, hidden 32, GQA 4/2, llama3 RoPE, tied) with `layers`
// layers, for random models small enough to compare every gradient quickly.
ModelConfig tiny_config(int64_t layers) {
  ModelConfig c = load_model_config(fixture("llama3_gqa_tied") + "/config.json");
  c.num_hidden_layers = layers;
  c.initializer_range = 0.1;
  return c;
}

struct Pass {
  at::Tensor loss;
  std::vector<at::Tensor> grads;  // in the order of `params`
};

// One training forward + backward with the model's current checkpointing; gradients are taken
// from (and then cleared on) `params`.
// The labels are the ids unless given.
Pass train_pass(DecoderModel& m, const std::vector<NamedTensor>& params, const at::Tensor& ids,
                const at::Tensor& segment_ids, const at::Tensor& labels = {}) {
  at::Tensor logits = m.forward(ids, {}, /*training=*/true, segment_ids);
  LossSum ls = causal_lm_loss_sum(logits, labels.defined() ? labels : ids);
  at::Tensor loss = ls.sum / static_cast<double>(ls.tokens);
  Pass out;
  out.loss = loss.detach();
  loss.backward();
  for (const auto& p : params) {
    REQUIRE(p.tensor->grad().defined());
    out.grads.push_back(p.tensor->grad().clone());
    p.tensor->mutable_grad() = at::Tensor();
  }
  return out;
}

// A strategy that sinks every layer weight's gradient into buffers of its own
// (UnitHooks::grad_sink), as the engine does into its accumulator.
class SinkAll final : public UnitHooks {
 public:
  explicit SinkAll(DecoderModel& m) {
    for (auto& L : m.layers())
      for (Linear* l :
           {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.gate_proj, &L.up_proj, &L.down_proj}) {
        index[l->weight.unsafeGetTensorImpl()] = static_cast<int64_t>(into.size());
        into.push_back(at::zeros_like(l->weight));
      }
  }
  void before_unit(int) override {}
  void after_unit(int, const at::Tensor&) override {}
  GradSink grad_sink(const at::Tensor& w) override {
    const auto it = index.find(w.unsafeGetTensorImpl());
    if (it == index.end()) return {};
    ++asked;
    return {into[static_cast<size_t>(it->second)], it->second};
  }
  void grad_sunk(int64_t id) override { sunk.push_back(id); }
  std::unordered_map<const c10::TensorImpl*, int64_t> index;
  std::vector<at::Tensor> into;
  std::vector<int64_t> sunk;
  int asked = 0;
};

// Bytes of live CPU tensors, counted by an allocator installed in front of c10's while a
// LiveBytes exists. The counter is global so that blocks freed later still find it.
std::atomic<int64_t> g_live_bytes{0};

class LiveBytes final : public c10::Allocator {
 public:
  LiveBytes() : base_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this); }
  ~LiveBytes() override { c10::SetCPUAllocator(base_); }
  LiveBytes(const LiveBytes&) = delete;
  LiveBytes& operator=(const LiveBytes&) = delete;
  int64_t now() const { return g_live_bytes.load(); }

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    g_live_bytes += static_cast<int64_t>(n);
    return {data, new Block{std::move(inner), n}, &Block::release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t n;
    static void release(void* p) {
      auto* b = static_cast<Block*>(p);
      g_live_bytes -= static_cast<int64_t>(b->n);
      delete b;
    }
  };
  c10::Allocator* base_;
};

}  // namespace

// The trainer's shortcut (data::Batch::attention_segments): rows that hold one record and then
// padding attend causally instead of through the segment mask. Padding comes after the record, so
// no trained position sees it either way; only padding positions (no loss) see differently.
TEST_CASE("one record per row: causal attention gives the segment mask's loss and gradients",
          "[unit]") {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    DYNAMIC_SECTION(c10::toString(dtype)) {
      // (fp32: the masked rows' products run over every key, zeros past the diagonal included,
      // the causal rows' over the keys they see: the same sums in other orders.)
      const double tol = dtype == at::kFloat ? 4e-6 : 1e-12;
      DecoderModel m(tiny_config(2), at::TensorOptions().dtype(dtype));
      m.init_random(5);
      auto params = m.parameters();
      require_grad(params);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
      at::Tensor ids = at::randint(1, 96, {2, 16}, gen, at::kLong);
      at::Tensor labels = ids.clone();
      at::Tensor segments = at::zeros({2, 16}, at::kLong);
      // Row 0: a record of 11 tokens, then 5 of padding (id 0, no loss, its own segment).
      ids.index_put_({0, at::indexing::Slice(11)}, 0);
      labels.index_put_({0, at::indexing::Slice(11)}, -100);
      segments.index_put_({0, at::indexing::Slice(11)}, 1);
      auto pass = [&](const at::Tensor& seg) { return train_pass(m, params, ids, seg, labels); };
      const Pass masked = pass(segments);
      const Pass causal = pass(at::Tensor());
      CHECK(rel_err(causal.loss, masked.loss) <= tol);
      for (size_t i = 0; i < params.size(); ++i) {
        INFO(params[i].name);
        CHECK(rel_err(causal.grads[i], masked.grads[i]) <= tol);
      }
      // And the shortcut is not taken where a row packs two records.
      at::Tensor two = segments.clone();
      two.index_put_({1, at::indexing::Slice(8)}, 1);
      const Pass packed = pass(two);
      CHECK(rel_err(packed.loss, masked.loss) > tol);
    }
  }
}

TEST_CASE("activation checkpointing: loss and every gradient equal the plain forward's", "[unit]") {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (bool packed : {false, true}) {
      DYNAMIC_SECTION(c10::toString(dtype) << (packed ? " packed" : " causal")) {
        const double tol = dtype == at::kFloat ? 1e-6 : 1e-12;
        DecoderModel m(tiny_config(3), at::TensorOptions().dtype(dtype));
        m.init_random(3);
        auto params = m.parameters();
        require_grad(params);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
        at::Tensor ids = at::randint(0, 96, {2, 16}, gen, at::kLong);
        at::Tensor segments;
        if (packed)
          segments = at::arange(16, at::kLong).div(5, "floor").unsqueeze(0).repeat({2, 1});
        const Pass ref = train_pass(m, params, ids, segments);
        for (auto [mode, n] : {std::pair{ActivationCheckpointing::kFull, 1},
                               std::pair{ActivationCheckpointing::kEveryN, 2}}) {
          INFO((mode == ActivationCheckpointing::kFull ? "full" : "every_n=2"));
          m.set_activation_checkpointing(mode, n);
          const Pass got = train_pass(m, params, ids, segments);
          // On the CPU the recompute runs the same kernels on the same inputs in the same order,
          // so the results are bit-identical; the tolerance says how far off they are should a
          // LibTorch change ever break that.
          CHECK(rel_err(got.loss, ref.loss) <= tol);
          CHECK(at::equal(got.loss, ref.loss));
          for (size_t i = 0; i < params.size(); ++i) {
            INFO(params[i].name);
            CHECK(rel_err(got.grads[i], ref.grads[i]) <= tol);
            CHECK(at::equal(got.grads[i], ref.grads[i]));
          }
          // Without grad nothing is recomputed: the plain forward runs.
          at::NoGradGuard no_grad;
          at::Tensor logits = m.forward(ids, {}, true, segments);
          CHECK_FALSE(logits.requires_grad());
        }
        m.set_activation_checkpointing(ActivationCheckpointing::kNone);
      }
    }
  }
}

TEST_CASE("activation checkpointing replays LoRA dropout and feeds adapters behind a frozen base",
          "[unit]") {
  DecoderModel m(tiny_config(3), at::kFloat);
  m.init_random(3);
  LoraConfig lc;
  lc.r = 4;
  lc.dropout = 0.3;
  attach_lora(m, lc, 1);
  auto params = lora_parameters(m);
  {
    // lora_B starts at zero, which would make every lora_A gradient zero.
    at::NoGradGuard g;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
    for (auto& p : params) p.tensor->normal_(0.0, 0.1, gen);
  }
  require_grad(params);  // the base stays frozen: the layers' inputs never require grad
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  at::Tensor ids = at::randint(0, 96, {2, 16}, gen, at::kLong);
  auto seeded_pass = [&](uint64_t seed) {
    at::manual_seed(seed);
    Pass p = train_pass(m, params, ids, {});
    return std::pair{p, at::detail::getDefaultCPUGenerator().get_state()};
  };
  const auto [ref, ref_state] = seeded_pass(7);
  // Dropout is live: another seed gives another loss.
  CHECK(seeded_pass(8).first.loss.item<double>() != ref.loss.item<double>());
  for (auto [mode, n] : {std::pair{ActivationCheckpointing::kFull, 1},
                         std::pair{ActivationCheckpointing::kEveryN, 2}}) {
    INFO((mode == ActivationCheckpointing::kFull ? "full" : "every_n=2"));
    m.set_activation_checkpointing(mode, n);
    const auto [got, state] = seeded_pass(7);
    CHECK(rel_err(got.loss, ref.loss) <= 1e-6);
    for (size_t i = 0; i < params.size(); ++i) {
      INFO(params[i].name);
      REQUIRE(ref.grads[i].abs().max().item<double>() > 0);
      CHECK(rel_err(got.grads[i], ref.grads[i]) <= 1e-6);
    }
    // The recompute put the generator back: it stands where the plain pass left it.
    CHECK(at::equal(state, ref_state));
  }
}

// The weights' gradients added straight into a strategy's buffers (the engine's accumulator): the
// same bits as autograd's (one micro-batch into zeros), no .grad on the weights, each sunk once per
// backward (also under activation checkpointing, where the recompute asks again), and a second
// backward adds to the first.
// Names of the autograd nodes behind `t`.
std::set<std::string> graph_nodes(const at::Tensor& t) {
  std::set<std::string> names;
  std::vector<torch::autograd::Node*> todo = {t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (!n || !seen.insert(n).second) continue;
    names.insert(n->name());
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  return names;
}

bool has_node(const std::set<std::string>& names, const std::string& part) {
  for (const auto& n : names)
    if (n.find(part) != std::string::npos) return true;
  return false;
}

// Every layer's attention block and MLP each run as one node (model/decoder.cpp: SinkAttentionFn,
// SinkMlpFn), with grouped-query attention (the fixture's config) or as many key/value heads as
// query heads, causal or under a packed batch's mask; in Llama, in Qwen3 (per-head q/k norms, its
// own head_dim) and in Gemma 3 (those norms as 1 + w, GeGLU, sandwich norms, the query scale, a
// sliding layer whose window covers the sequence and a full one).
TEST_CASE("linear weights' gradients sunk into a strategy's buffers: autograd's bits, once each",
          "[unit]") {
  const std::string family = GENERATE("llama3_gqa_tied", "qwen3_headdim", "gemma3_local_global");
  const bool gqa = GENERATE(true, false);
  const bool packed = GENERATE(false, true);
  INFO(family << (gqa ? ", grouped-query attention" : ", as many key/value heads as query heads")
              << (packed ? ", packed" : ", causal"));
  ModelConfig config = tiny_config(2);
  if (family != "llama3_gqa_tied") {
    config = load_model_config(fixture(family) + "/config.json").with_layers(2);
    if (!config.layer_windows.empty()) config.layer_windows = {32, 0};
  }
  if (!gqa) config.num_key_value_heads = config.num_attention_heads;
  REQUIRE((config.num_key_value_heads != config.num_attention_heads) == gqa);
  DecoderModel m(config, at::kFloat);
  m.init_random(3);
  auto params = m.parameters();
  {
    // Norm weights away from their init (ones, or Gemma's zeros), so that they matter.
    at::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    for (auto& p : params)
      if (p.name.find("norm") != std::string::npos)
        p.tensor->add_(at::randn(p.tensor->sizes(), gen) * 0.2);
  }
  require_grad(params);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor ids = at::randint(0, 96, {2, 16}, gen, at::kLong);
  // Packed: row 0 holds records of 5 and 11 tokens, row 1 one of 16.
  at::Tensor segments;
  if (packed) {
    segments = at::zeros({2, 16}, at::kLong);
    segments.index_put_({0, at::indexing::Slice(0, 5)}, 1);
  }
  const Pass ref = train_pass(m, params, ids, segments);
  for (const auto mode : {ActivationCheckpointing::kNone, ActivationCheckpointing::kFull}) {
    INFO((mode == ActivationCheckpointing::kNone ? "plain" : "activation checkpointing"));
    m.set_activation_checkpointing(mode);
    SinkAll sinks(m);
    m.set_unit_hooks(&sinks);
    for (int pass = 0; pass < 2; ++pass) {
      at::Tensor logits = m.forward(ids, {}, /*training=*/true, segments);
      if (mode == ActivationCheckpointing::kNone) {  // (else the layers' nodes come in backward)
        const auto nodes = graph_nodes(logits);
        CHECK(has_node(nodes, "SinkMlpFn"));
        CHECK(has_node(nodes, "SinkAttentionFn"));
        CHECK_FALSE(has_node(nodes, "SinkLinearFn"));
        CHECK_FALSE(has_node(nodes, "SwiGluFn"));
        CHECK_FALSE(has_node(nodes, "RopeFn"));
      }
      LossSum ls = causal_lm_loss_sum(logits, ids);
      (ls.sum / static_cast<double>(ls.tokens)).backward();
      if (pass == 1) break;
      CHECK(sinks.sunk.size() == sinks.into.size());
      // Compare with autograd's gradient of the same weight.
      size_t checked = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        const auto it = sinks.index.find(params[i].tensor->unsafeGetTensorImpl());
        if (it == sinks.index.end()) {
          REQUIRE(params[i].tensor->grad().defined());  // norms, embeddings: autograd as before
          CHECK(at::equal(params[i].tensor->grad(), ref.grads[i]));
          params[i].tensor->mutable_grad() = at::Tensor();
          continue;
        }
        INFO(params[i].name);
        CHECK_FALSE(params[i].tensor->grad().defined());
        CHECK(at::equal(sinks.into[static_cast<size_t>(it->second)], ref.grads[i]));
        ++checked;
      }
      CHECK(checked == sinks.into.size());
      CHECK(checked == 14);
    }
    // The second backward added its gradient to the first.
    CHECK(sinks.sunk.size() == 2 * sinks.into.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const auto it = sinks.index.find(params[i].tensor->unsafeGetTensorImpl());
      if (it == sinks.index.end()) {
        params[i].tensor->mutable_grad() = at::Tensor();
        continue;
      }
      CHECK(rel_err(sinks.into[static_cast<size_t>(it->second)], ref.grads[i] * 2) <= 1e-6);
    }
    m.set_unit_hooks(nullptr);
  }
  m.set_activation_checkpointing(ActivationCheckpointing::kNone);
  // Without grad mode nothing is asked.
  SinkAll sinks(m);
  m.set_unit_hooks(&sinks);
  {
    at::NoGradGuard no_grad;
    m.forward(ids, {}, true, {});
  }
  CHECK(sinks.asked == 0);
  m.set_unit_hooks(nullptr);
}

TEST_CASE("activation checkpointing keeps less between forward and backward", "[unit]") {
  DecoderModel m(tiny_config(4), at::kFloat);
  m.init_random(3);
  auto params = m.parameters();
  require_grad(params);
  at::Tensor ids =
      at::randint(0, 96, {2, 64}, at::make_generator<at::CPUGeneratorImpl>(1), at::kLong);
  // Bytes still allocated once the loss is computed: what the graph saved for backward.
  auto held = [&](ActivationCheckpointing mode, int64_t n) {
    m.set_activation_checkpointing(mode, n);
    LiveBytes live;
    const int64_t before = live.now();
    LossSum ls = causal_lm_loss_sum(m.forward(ids, {}, true), ids);
    const int64_t after = live.now() - before;
    ls.sum.backward();
    for (auto& p : params) p.tensor->mutable_grad() = at::Tensor();
    return after;
  };
  const int64_t none = held(ActivationCheckpointing::kNone, 1);
  const int64_t every2 = held(ActivationCheckpointing::kEveryN, 2);
  const int64_t full = held(ActivationCheckpointing::kFull, 1);
  INFO("held after forward: none " << none << " B, every_n=2 " << every2 << " B, full " << full
                                   << " B");
  const int64_t hidden_bytes = 2 * 64 * 32 * 4;  // one [B, T, hidden] fp32 activation
  CHECK(none > 4 * 4 * hidden_bytes);            // the counter sees the activations at all
  CHECK(every2 < none);
  CHECK(full < every2);
  CHECK(full < none / 2);
}

// The packed batch's mask is made into its 0 / -inf form once per forward on the CPU, and every
// layer's attention keeps that one tensor (at::scaled_dot_product_attention would make, and its
// flash attention keep, one per layer).
TEST_CASE("a packed batch's attention mask is held once, not once per layer", "[unit]") {
  constexpr int64_t kLayers = 6, B = 2, T = 256;
  DecoderModel m(tiny_config(kLayers), at::kFloat);
  m.init_random(3);
  auto params = m.parameters();
  require_grad(params);
  const at::Tensor ids =
      at::randint(0, 96, {B, T}, at::make_generator<at::CPUGeneratorImpl>(1), at::kLong);
  const at::Tensor segments =
      at::arange(T, at::kLong).div(100, "floor").unsqueeze(0).repeat({B, 1});
  auto held = [&](const at::Tensor& seg) {
    LiveBytes live;
    const int64_t before = live.now();
    LossSum ls = causal_lm_loss_sum(m.forward(ids, {}, true, seg), ids);
    const int64_t after = live.now() - before;
    ls.sum.backward();
    for (auto& p : params) p.tensor->mutable_grad() = at::Tensor();
    return after;
  };
  const int64_t causal = held({}), packed = held(segments);
  const int64_t mask_bytes = B * T * T * 4;  // [B, 1, T, T] fp32
  INFO("held after forward: causal " << causal << " B, packed " << packed << " B, one mask "
                                     << mask_bytes << " B");
  CHECK(packed >= causal + mask_bytes);
  CHECK(packed < causal + 2 * mask_bytes);
}

TEST_CASE("activation checkpointing settings are checked", "[unit]") {
  CHECK(parse_activation_checkpointing("none") == ActivationCheckpointing::kNone);
  CHECK(parse_activation_checkpointing("full") == ActivationCheckpointing::kFull);
  CHECK(parse_activation_checkpointing("every_n") == ActivationCheckpointing::kEveryN);
  CHECK_THROWS_AS(parse_activation_checkpointing("partial"), ConfigError);
  CHECK_THROWS_WITH(parse_activation_checkpointing("partial"),
                    Catch::Contains("none, full or every_n, got 'partial'"));
  DecoderModel m(tiny_config(3), at::kFloat);
  CHECK_THROWS_WITH(m.set_activation_checkpointing(ActivationCheckpointing::kEveryN, 0),
                    Catch::Contains("train.checkpoint_every_n_layers must be >= 1, got 0"));
  m.set_activation_checkpointing(ActivationCheckpointing::kEveryN, 2);
  CHECK(m.checkpoints_layer(0));
  CHECK_FALSE(m.checkpoints_layer(1));
  CHECK(m.checkpoints_layer(2));
  m.set_activation_checkpointing(ActivationCheckpointing::kFull);
  CHECK(m.checkpoints_layer(1));
  m.set_activation_checkpointing(ActivationCheckpointing::kNone);
  CHECK_FALSE(m.checkpoints_layer(0));
}

// attend_windowed (chunks of W queries against at most 2W - 1 keys) equals attend() under the
// dense sliding-window mask (transformers' sliding_window_overlay on the causal mask), with and
// without packed segments, grouped-query heads and a soft cap, in value and gradient.
TEST_CASE("windowed attention equals the dense sliding-window mask", "[unit]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const int64_t B = 2, H = 4, KV = 2, T = 13, D = 8;
  for (int64_t window : {1, 3, 5, 12, 13}) {
    for (bool packed : {false, true}) {
      for (double cap : {0.0, 0.7}) {
        DYNAMIC_SECTION("window " << window << (packed ? " packed" : "") << " cap " << cap) {
          at::Tensor q = at::randn({B, H, T, D}, gen, f64).requires_grad_(true);
          at::Tensor k = at::randn({B, KV, T, D}, gen, f64).requires_grad_(true);
          at::Tensor v = at::randn({B, KV, T, D}, gen, f64).requires_grad_(true);
          at::Tensor seg;
          if (packed)
            seg = at::cat({at::zeros({B, 6}, at::kLong), at::ones({B, T - 6}, at::kLong)}, 1);
          const at::Tensor i = at::arange(T, at::kLong).unsqueeze(1);
          const at::Tensor j = at::arange(T, at::kLong).unsqueeze(0);
          at::Tensor dense = j.le(i).logical_and(i.sub(j).lt(window)).view({1, 1, T, T});
          if (packed) dense = dense.logical_and(seg.unsqueeze(2).eq(seg.unsqueeze(1)).unsqueeze(1));
          const double scale = 0.3;
          const at::Tensor got = attend_windowed(q, k, v, seg, window, scale, cap, true);
          const at::Tensor want = attend(q, k, v, dense, false, scale, cap, true);
          // A soft cap takes Gemma 2's eager path, whose softmax is fp32 (as transformers'): rows
          // of 2W - 1 keys and of T keys are summed in other vector orders there (on AVX2 the
          // difference reached 4e-7), so the bound is fp32's.
          const double tol = cap > 0 ? 1e-6 : 1e-12;
          CHECK(rel_err(got, want) < tol);
          const at::Tensor w = at::randn(got.sizes(), gen, f64);
          const auto g1 = torch::autograd::grad({(got * w).sum()}, {q, k, v});
          const auto g2 = torch::autograd::grad({(want * w).sum()}, {q, k, v});
          // (With a window of 1 the output is v: q's and k's gradients are 0 up to rounding.)
          for (size_t n = 0; n < 3; ++n)
            CHECK((g1[n] - g2[n]).abs().max().item<double>() <=
                  tol * (1 + g2[n].abs().max().item<double>()));
        }
      }
    }
  }
}

// The config.json ft writes for an export reads back as the same model: the file as read (its
// own keys kept), and one built from the fields alone (a preset's shape, or a changed config).
TEST_CASE("every family's config.json round-trips through ft's writer", "[unit]") {
  const std::string dir = test::make_temp_dir();
  auto same = [](const ModelConfig& a, const ModelConfig& b) {
    CHECK(a.model_type == b.model_type);
    CHECK(a.num_parameters() == b.num_parameters());
    CHECK(a.head_dim == b.head_dim);
    CHECK(a.layer_windows == b.layer_windows);
    CHECK(a.attn_softcap == b.attn_softcap);
    CHECK(a.final_softcap == b.final_softcap);
    CHECK(a.softmax_scale() == Approx(b.softmax_scale()).epsilon(1e-12));
    CHECK(a.embedding_scale == Approx(b.embedding_scale).epsilon(1e-12));
    CHECK(a.residual_multiplier == b.residual_multiplier);
    CHECK(a.logits_divisor == b.logits_divisor);
    CHECK(a.partial_rotary_factor == b.partial_rotary_factor);
    CHECK(a.rope.type == b.rope.type);
    CHECK(a.rope.theta == b.rope.theta);
    CHECK(a.rope.factor == b.rope.factor);
    CHECK(a.rope.long_factor == b.rope.long_factor);
    CHECK(a.rope.attention_factor == Approx(b.rope.attention_factor).epsilon(1e-12));
    CHECK(a.has_local_rope == b.has_local_rope);
    CHECK(a.local_rope.theta == b.local_rope.theta);
    CHECK(a.qkv_bias == b.qkv_bias);
    CHECK(a.o_bias == b.o_bias);
    CHECK(a.mlp_bias == b.mlp_bias);
    CHECK(a.activation == b.activation);
    CHECK(a.tie_word_embeddings == b.tie_word_embeddings);
  };
  for (const std::string& name : fixtures_with("model.safetensors")) {
    DYNAMIC_SECTION(name) {
      ModelConfig c = load_model_config(fixture(name) + "/config.json");
      const std::string path = dir + "/" + name + ".json";
      std::ofstream(path) << model_config_json(c);
      same(c, load_model_config(path));
      c.source_json.clear();
      std::ofstream(path) << model_config_json(c);
      same(c, load_model_config(path));
    }
  }
  std::filesystem::remove_all(dir);
}

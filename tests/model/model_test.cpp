// Fidelity of ft's Llama-family model against Hugging Face transformers and PEFT: the fixtures in
// tests/model/fixtures were written by make_fixtures.py (transformers' own save_pretrained plus its
// logits, loss and gradients); these tests need no Python.
#include <fstream>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/lora.h"
#include "support/catch_torch.h"
#include "support/subprocess.h"

using namespace ft;
using namespace ft::model;

namespace {

std::string fixture(const std::string& name) {
  return std::string(FT_TEST_DIR) + "/model/fixtures/" + name;
}

// max |a - b| / max |b|: the error relative to the reference's scale.
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  double scale = b.abs().max().item<double>();
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
         std::max(scale, 1e-30);
}

LlamaModel load_model(const std::string& dir) {
  LlamaModel m(load_llama_config(dir + "/config.json"), at::TensorOptions().dtype(at::kFloat));
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

}  // namespace

TEST_CASE("logits, loss and gradients equal transformers' (fp32)", "[unit]") {
  for (const char* name : {"llama2_mha_linear", "llama3_gqa_tied", "mistral_gqa"}) {
    DYNAMIC_SECTION(name) {
      std::string dir = fixture(name);
      LlamaModel m = load_model(dir);
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
    }
  }
}

TEST_CASE("LoRA forward and adapter gradients equal PEFT's and PEFT files load", "[unit]") {
  for (auto [name, base] : {std::pair{"lora_llama3", "llama3_gqa_tied"},
                            std::pair{"rslora_llama2", "llama2_mha_linear"}}) {
    DYNAMIC_SECTION(name) {
      std::string dir = fixture(name);
      LlamaModel m = load_model(fixture(base));
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
    }
  }
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
  auto c = load_llama_config(write("{" + base + R"(, "rope_theta": 500000.0, "rope_scaling":
      {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
       "original_max_position_embeddings": 8192, "rope_type": "llama3"}})"));
  CHECK(c.rope.type == "llama3");
  CHECK(c.rope.theta == 500000.0);
  CHECK(c.head_dim == 8);
  CHECK(c.num_key_value_heads == 2);
  // Older "type" spelling.
  c = load_llama_config(
      write("{" + base + R"(, "rope_scaling": {"type": "linear", "factor": 4}})"));
  CHECK(c.rope.type == "linear");
  CHECK(c.rope.factor == 4.0);
  // The config ft writes reads back the same.
  c = load_llama_config(write(llama_config_json(c)));
  CHECK(c.rope.factor == 4.0);
  CHECK(c.num_parameters() ==
        LlamaModel(c, at::kFloat).parameters().size() * 0 + c.num_parameters());

  CHECK_THROWS_WITH(load_llama_config(write(R"({"vocab_size": 10})")),
                    Catch::Contains("config.json: required key \"hidden_size\" is missing"));
  CHECK_THROWS_WITH(
      load_llama_config(
          write("{" + base + R"(, "rope_scaling": {"rope_type": "dynamic", "factor": 2}})")),
      Catch::Contains("\"rope_scaling\" type 'dynamic' is not supported"));
  CHECK_THROWS_WITH(load_llama_config(write("{" + base + R"(, "model_type": "gpt2"})")),
                    Catch::Contains("model_type \"gpt2\""));
  CHECK_THROWS_WITH(load_llama_config(write("{" + base + R"(, "hidden_size": "64"})")),
                    Catch::Contains("key \"hidden_size\" has the wrong type"));
  CHECK_THROWS_WITH(load_llama_config(write(R"({"vocab_size": 100, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
      "num_key_value_heads": 3})")),
                    Catch::Contains("multiple of num_key_value_heads"));
  CHECK_THROWS_WITH(
      load_llama_config(write(
          "{" + base +
          R"(, "model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768})")),
      Catch::Contains("sliding_window 4096"));
  CHECK_THROWS_AS(load_llama_config(write("{not json")), FormatError);
  CHECK_THROWS_AS(load_llama_config(dir + "/missing.json"), FormatError);
}

TEST_CASE("a weight of the wrong shape is refused naming the tensor", "[unit]") {
  std::string dir = test::make_temp_dir();
  auto c = load_llama_config(fixture("mistral_gqa") + "/config.json");
  LlamaModel m(c, at::kFloat);
  m.init_random(1);
  io::NamedTensors ts;
  for (auto& p : m.parameters()) ts.push_back({p.name, *p.tensor});
  ts[1].second = at::zeros({3, 3});  // input_layernorm of layer 0
  io::write_safetensors(dir + "/model.safetensors", ts);
  std::ofstream(dir + "/config.json") << llama_config_json(c);
  try {
    load_model(dir);
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("model.layers.0.input_layernorm.weight"));
    CHECK_THAT(e.what(), Catch::Contains("model.safetensors"));
  }
}

TEST_CASE("random init is deterministic and transformers-shaped", "[unit]") {
  auto c = load_llama_config(fixture("llama3_gqa_tied") + "/config.json");
  LlamaModel a(c, at::kFloat), b(c, at::kFloat), other(c, at::kFloat);
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

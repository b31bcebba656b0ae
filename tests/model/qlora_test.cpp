// QLoRA (issue 33) against transformers + PEFT + bitsandbytes 0.50.2 on the CPU
// (tests/model/fixtures/qlora, written by make_qlora_fixtures.py): a tiny model quantized by ft
// as it reads the fp32 weights holds the bytes bitsandbytes saved; with a PEFT adapter on the
// quantized model ft's loss and adapter gradients equal PEFT's, and so do the losses and the
// adapter over three AdamW steps. Also the NF4 projection's own forward and backward, and
// what is refused.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/lora.h"
#include "model/nf4.h"
#include "model/quantized_linear.h"
#include "support/numerics.h"
#include "support/subprocess.h"
#include "train/optimizer.h"
#include "train/saved_model.h"
#include "train/weights.h"

using namespace ft;
using namespace ft::model;

namespace {

std::string qlora_dir() { return std::string(FT_TEST_DIR) + "/model/fixtures/qlora/"; }

double rel(const at::Tensor& a, const at::Tensor& b) { return test::rel_error(a, b); }

// The model of `dir` as ft train reads it; `quantize` asks for NF4 as lora.quantize_base does
// (a directory saved quantized is read as NF4 whatever it says).
DecoderModel load_quantized(const std::string& dir, bool quantize, bool double_quant,
                            at::ScalarType dtype = at::kFloat) {
  ModelConfig c = load_model_config(dir + "/config.json");
  if (quantize && !c.quant.in_files) {
    c.quant.nf4 = true;
    c.quant.double_quant = double_quant;
  }
  DecoderModel m(c, at::TensorOptions().dtype(dtype));
  train::BaseWeights w(dir, c, train::model_param_shapes(c), 0);
  m.load([&](const std::string& name, at::Tensor& dst) { w.copy_to(name, dst); });
  return m;
}

// The PEFT in-memory name of an adapter tensor ("...lora_A.default.weight").
std::string peft_memory_name(const std::string& name) {
  return name.substr(0, name.size() - 6) + "default.weight";
}

}  // namespace

TEST_CASE("An NF4 projection computes with the dequantized weight, forward and backward",
          "[unit]") {
  at::manual_seed(3);
  const at::Tensor w = at::randn({96, 128}) * 0.05;
  const Nf4Weight q = quantize_nf4(w, /*double_quant=*/true);
  const Nf4Shape s = nf4_shape(q);
  const at::Tensor blob = nf4_blob(q);
  REQUIRE(blob.numel() == s.bytes());
  CHECK(s.bytes() == 96 * 128 / 2 + 4 * (96 * 128 / 64));
  // An odd count in a short last block too: the vectorized kernel's tail and the last nibble.
  const Nf4Weight odd = quantize_nf4(at::randn({37, 31}), false);
  for (const Nf4Weight* w : {&q, &odd})
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      INFO(dtype << " " << w->numel());
      // The blob as a model holds it (in elements of its dtype) dequantizes to dequantize_nf4's
      // values, rounded once.
      const at::Tensor held = nf4_blob(*w).view(dtype);
      CHECK(held.numel() == nf4_shape(*w).elements(dtype));
      CHECK(at::equal(dequantize_blob(held, nf4_shape(*w), dtype), dequantize_nf4(*w, dtype)));
    }
  const at::Tensor dense = dequantize_nf4(q, at::kFloat);
  const at::Tensor x = at::randn({2, 5, 128}).requires_grad_(true);
  const at::Tensor x2 = x.detach().clone().requires_grad_(true);
  const at::Tensor y = nf4_linear(x, blob.view(at::kFloat), s);
  const at::Tensor y2 = at::linear(x2, dense);
  CHECK(rel(y, y2) < 1e-6);
  const at::Tensor g = at::randn(y.sizes());
  y.backward(g);
  y2.backward(g);
  CHECK(rel(x.grad(), x2.grad()) < 1e-6);
  CHECK_THROWS_WITH(nf4_linear(at::randn({3, 64}), blob.view(at::kFloat), s),
                    Catch::Contains("given input"));
}

TEST_CASE(
    "NF4 at load equals bitsandbytes' saved bytes, and QLoRA's loss, gradients and steps PEFT's",
    "[unit]") {
  for (const std::string name : {"llama", "qwen2", "mixtral", "qwen3moe"}) {
    DYNAMIC_SECTION(name) {
      const std::string nf4_dir = qlora_dir() + name + "_nf4";
      const ModelConfig saved = load_model_config(nf4_dir + "/config.json");
      REQUIRE(saved.quant.nf4);
      REQUIRE(saved.quant.in_files);
      DecoderModel from_files = load_quantized(nf4_dir, true, saved.quant.double_quant);
      DecoderModel at_load =
          load_quantized(qlora_dir() + name + "_base", true, saved.quant.double_quant);
      int quantized = 0;
      auto a = from_files.parameters(), b = at_load.parameters();
      REQUIRE(a.size() == b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        INFO(a[i].name);
        CHECK((a[i].nf4 != nullptr) == (b[i].nf4 != nullptr));
        quantized += a[i].nf4 != nullptr;
        // The blobs' bits (as bytes: packed codes read as floats may be NaNs), every other weight.
        CHECK(at::equal(a[i].tensor->view(at::kByte), b[i].tensor->view(at::kByte)));
      }
      // Every projection of both layers (in the MoE models the attention's: transformers 5 +
      // bitsandbytes leave the experts and routers alone); never the head or embeddings.
      CHECK(quantized == 2 * (saved.moe.enabled() ? 4 : 7));

      // PEFT's adapter on the quantized model: loss and adapter gradients, then three AdamW steps.
      DecoderModel& m = from_files;
      const std::string adapter_dir = qlora_dir() + name + "_adapter";
      const LoraConfig lc = load_lora_config(adapter_dir + "/adapter_config.json");
      attach_lora(m, lc, 0);
      train::load_adapter(m, adapter_dir);
      auto params = lora_parameters(m);
      std::vector<train::AdamW::Param> opt_params;
      for (auto& p : params) {
        p.tensor->requires_grad_(true);
        opt_params.emplace_back(*p.tensor, true);
      }
      train::AdamWOptions ao;
      ao.weight_decay = 0.0;
      train::AdamW opt(opt_params, ao);
      auto expected = io::SafetensorsFile::open(qlora_dir() + name + "_expected.safetensors");
      const at::Tensor ids = expected.tensor("input_ids"), labels = expected.tensor("labels");
      for (int step = 0; step <= 3; ++step) {
        INFO("step " << step);
        for (auto& p : params) p.tensor->mutable_grad() = at::Tensor();
        const LossSum ls = causal_lm_loss_sum(m.forward(ids, {}, /*training=*/true), labels);
        const at::Tensor loss = ls.sum / static_cast<double>(ls.tokens);
        const double want = expected.tensor("loss." + std::to_string(step)).item<double>();
        CHECK(std::abs(loss.item<double>() - want) / want < 1e-5);
        if (step == 3) break;
        loss.backward();
        if (step == 0)
          for (auto& p : params) {
            INFO(p.name);
            CHECK(rel(p.tensor->grad(), expected.tensor("grad." + peft_memory_name(p.name))) <
                  1e-4);
          }
        opt.step(1e-2);
      }
      // After three AdamW steps: each step divides a gradient by its own root mean square, so an
      // entry near zero carries its rounding into the update at full size. PEFT's attention is
      // LibTorch's flash kernel, ft's its own (model/cpu_attention.h): the gradients above agree
      // to 1e-6, the final weights to 2e-4 (llama's q_proj lora_B).
      for (auto& p : params) {
        INFO(p.name);
        CHECK(rel(*p.tensor, expected.tensor("final." + peft_memory_name(p.name))) < 5e-4);
      }
    }
  }
}

// A sharded load reads slices: without double quantization a slice is quantized from the blocks
// it covers only; every slice, at every boundary, equals the same bytes of the whole blob.
TEST_CASE("NF4 slices quantized from their own blocks equal the whole blob's bytes", "[unit]") {
  for (const bool dq : {false, true}) {
    ModelConfig c = load_model_config(qlora_dir() + "llama_base/config.json");
    c.quant.nf4 = true;
    c.quant.double_quant = dq;
    train::BaseWeights sliced(qlora_dir() + "llama_base", c, train::model_param_shapes(c), 0);
    train::BaseWeights whole(qlora_dir() + "llama_base", c, train::model_param_shapes(c), 0);
    DecoderModel meta(c, at::TensorOptions().dtype(at::kFloat), false);
    for (const auto& p : meta.parameters()) {
      if (!p.nf4) continue;
      INFO(p.name << " double quant " << dq);
      for (const auto dtype : {at::kFloat, at::kBFloat16}) {
        const int64_t n = p.nf4->elements(dtype);
        at::Tensor all = at::empty({n}, dtype);
        whole.copy_to(p.name, all);
        // Cuts inside the codes, at the padding, inside the absmax, and 1-3 ranks' shards.
        for (const int64_t parts : {1, 2, 3, 7}) {
          at::Tensor got = at::empty({n}, dtype);
          for (int64_t k = 0; k < parts; ++k) {
            const int64_t b = n * k / parts, e = n * (k + 1) / parts;
            sliced.read_range(p.name, b, e, got.narrow(0, b, e - b));
          }
          CHECK(at::equal(got.view(at::kByte), all.view(at::kByte)));
        }
      }
    }
  }
}

TEST_CASE("A quantized base is held in NF4 in bf16 too, and refused where it cannot be", "[unit]") {
  // In bf16 the blob is the same bytes, in half as many elements as in fp32.
  DecoderModel f32 = load_quantized(qlora_dir() + "llama_nf4", true, true);
  DecoderModel b16 = load_quantized(qlora_dir() + "llama_nf4", true, true, at::kBFloat16);
  auto a = f32.parameters(), b = b16.parameters();
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].nf4) {
      INFO(a[i].name);
      CHECK(b[i].tensor->numel() == 2 * a[i].tensor->numel());
      CHECK(at::equal(a[i].tensor->view(at::kByte), b[i].tensor->view(at::kByte)));
    }
  const at::Tensor ids = at::arange(12).view({1, 12});
  CHECK(rel(b16.forward(ids).to(at::kFloat), f32.forward(ids)) < 2e-2);

  const std::string dir = test::make_temp_dir();
  auto write_config = [&](const std::string& quantization) {
    std::ifstream in(qlora_dir() + "llama_base/config.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    text.insert(text.find('{') + 1, "\"quantization_config\": " + quantization + ",");
    std::ofstream(dir + "/config.json") << text;
    return dir + "/config.json";
  };
  using Catch::Contains;
  CHECK_THROWS_WITH(
      load_model_config(write_config(
          R"({"quant_method": "bitsandbytes", "load_in_4bit": true,
                            "bnb_4bit_quant_type": "fp4"})")),
      Contains("bitsandbytes 4-bit fp4") && Contains("bitsandbytes 4-bit NF4 checkpoints only"));
  CHECK_THROWS_WITH(load_model_config(write_config(R"({"quant_method": "gptq", "bits": 4})")),
                    Contains("(gptq)"));
  CHECK_THROWS_WITH(
      load_model_config(write_config(
          R"({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4",
              "llm_int8_skip_modules": ["o_proj"]})")),
      Contains("llm_int8_skip_modules"));
  // A checkpoint whose config says NF4 but whose files lack a projection's state.
  std::filesystem::copy(qlora_dir() + "llama_base/model.safetensors", dir + "/model.safetensors");
  const ModelConfig c = load_model_config(write_config(
      R"({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4"})"));
  CHECK_THROWS_WITH(train::BaseWeights(dir, c, train::model_param_shapes(c), 0),
                    Contains("model.layers.0.self_attn.q_proj.weight.absmax\" is missing"));

  // What a run cannot do with an NF4 base: train it in full, or compute in fp64.
  {
    config::LoraSettings lora;
    lora.enabled = false;
    ModelConfig saved_nf4 = load_model_config(qlora_dir() + "llama_nf4/config.json");
    CHECK_THROWS_WITH(train::apply_base_quant(lora, "bf16", "DIR", saved_nf4),
                      Contains("DIR is saved quantized") && Contains("set lora.enabled=true"));
    lora.quantize_base = "nf4";
    ModelConfig plain = load_model_config(qlora_dir() + "llama_base/config.json");
    CHECK_THROWS_WITH(train::apply_base_quant(lora, "bf16", "", plain),
                      Contains("lora.quantize_base=nf4 quantizes the base"));
    lora.enabled = true;
    CHECK_THROWS_WITH(train::apply_base_quant(lora, "fp64", "", plain),
                      Contains("not precision.mode=fp64"));
    train::apply_base_quant(lora, "bf16", "", plain);
    CHECK((plain.quant.nf4 && !plain.quant.in_files && !plain.quant.double_quant));
  }

  // bitsandbytes' tensors that do not fit the weight: named with the file, refused at open.
  const std::string saved = qlora_dir() + "llama_nf4";
  auto rewrite = [&](const std::string& key, const at::Tensor& value) {
    const std::string bad = test::make_temp_dir();
    for (const char* f : {"config.json", "generation_config.json"})
      std::filesystem::copy(saved + "/" + f, bad + "/" + f);
    auto file = io::SafetensorsFile::open(saved + "/model.safetensors");
    io::NamedTensors tensors;
    for (const auto& n : file.names()) tensors.emplace_back(n, n == key ? value : file.tensor(n));
    io::write_safetensors(bad + "/model.safetensors", tensors);
    const ModelConfig qc = load_model_config(bad + "/config.json");
    return train::BaseWeights(bad, qc, train::model_param_shapes(qc), 0);
  };
  const std::string k = "model.layers.1.mlp.down_proj.weight";
  auto file = io::SafetensorsFile::open(saved + "/model.safetensors");
  CHECK_THROWS_WITH(rewrite(k + ".absmax", file.tensor(k + ".absmax").narrow(0, 0, 10)),
                    Contains(k + ".absmax holds 10 values") && Contains("needs 128"));
  CHECK_THROWS_WITH(rewrite(k, file.tensor(k).narrow(0, 0, 100)), Contains(k + " holds 100 bytes"));
  CHECK_THROWS_WITH(rewrite(k + ".quant_map", file.tensor(k + ".quant_map") * 2),
                    Contains("is not the NF4 code table"));
}

// Every family's projections take NF4 (tests/model/fixtures: FAMILIES.md): the quantized model
// computes what the same model with each projection replaced by its dequantized weight does,
// through each family's own attention, norms and fused projections (Phi-3's qkv and gate_up).
TEST_CASE(
    "Every family computes with NF4 projections what it computes with their dequantized "
    "weights",
    "[unit]") {
  const std::string root = std::string(FT_TEST_DIR) + "/model/fixtures";
  int families = 0;
  for (const auto& e : std::filesystem::directory_iterator(root)) {
    const std::string dir = e.path().string();
    if (!std::filesystem::exists(dir + "/config.json") ||
        !std::filesystem::exists(dir + "/model.safetensors"))
      continue;
    if (load_model_config(dir + "/config.json").moe.enabled()) continue;
    DYNAMIC_SECTION(e.path().filename().string()) {
      DecoderModel q = load_quantized(dir, true, false);
      DecoderModel dense = load_quantized(dir, false, false);
      auto qp = q.parameters(), dp = dense.parameters();
      REQUIRE(qp.size() == dp.size());
      int replaced = 0;
      for (size_t i = 0; i < qp.size(); ++i)
        if (qp[i].nf4) {
          at::NoGradGuard g;
          dp[i].tensor->copy_(dequantize_blob(*qp[i].tensor, *qp[i].nf4, at::kFloat));
          ++replaced;
        }
      CHECK(replaced >= 4 * q.config().num_hidden_layers);  // at least qkv, o, gate_up, down
      const at::Tensor ids = at::arange(1, 40).remainder(q.config().vocab_size).view({1, 39});
      at::NoGradGuard g;
      CHECK(rel(q.forward(ids), dense.forward(ids)) < 1e-5);
      ++families;
    }
  }
  CHECK(families >= 1);
}

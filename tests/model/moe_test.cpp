// Mixture-of-experts models against transformers 5.24 (tests/model/fixtures/moe, written by
// make_moe_fixtures.py; MOE.md gives the math): the same experts chosen for every token, the
// cross-entropy and the load-balancing loss within 1e-5 relative, every gradient of the loss
// with the aux term within 1e-4, from either checkpoint layout (per expert, as save_pretrained
// writes it, or transformers 5's fused expert tensors).
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <ATen/Parallel.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/lora.h"
#include "model/moe.h"
#include "support/numerics.h"
#include "support/subprocess.h"
#include "train/weights.h"

using namespace ft;
using namespace ft::model;

namespace {

std::string moe_fixtures() {
  const char* dir = std::getenv("FT_MOE_FIXTURES");
  return dir ? dir : std::string(FT_TEST_DIR) + "/model/fixtures/moe";
}

std::vector<std::string> moe_fixture_dirs() {
  std::vector<std::string> out;
  if (!std::filesystem::exists(moe_fixtures())) return out;
  for (const auto& e : std::filesystem::directory_iterator(moe_fixtures()))
    if (std::filesystem::exists(e.path() / "model.safetensors") &&
        std::filesystem::exists(e.path() / "expected.safetensors"))
      out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The model with its weights read through BaseWeights, as ft train reads them.
DecoderModel load_moe(const std::string& dir) {
  const ModelConfig c = load_model_config(dir + "/config.json");
  DecoderModel m(c, at::TensorOptions().dtype(at::kFloat));
  train::BaseWeights w(dir, c, train::model_param_shapes(c), 0);
  m.load([&](const std::string& name, at::Tensor& dst) { w.copy_to(name, dst); });
  return m;
}

double rel(const at::Tensor& a, const at::Tensor& b) { return test::rel_error(a, b); }

// A PEFT adapter fixture's checks on `m` with the adapter loaded: the logits (1e-5), transformers'
// loss with the aux term (1e-5) and every adapter tensor's gradient of it (1e-4). The fixture's
// gradients are of that loss, so the aux term reaches the attention's adapters through the
// routers' inputs.
void check_adapter_fixture(DecoderModel& m, io::SafetensorsFile& expected, size_t adapters) {
  auto params = lora_parameters(m);
  REQUIRE(params.size() == adapters);
  for (auto& p : params) p.tensor->set_requires_grad(true);
  const at::Tensor ids = expected.tensor("input_ids").clone();
  const at::Tensor logits = m.forward(ids);
  CHECK(rel(logits, expected.tensor("logits")) < 1e-5);
  const LossSum ls = causal_lm_loss_sum(logits, ids);
  const at::Tensor ce = ls.sum / static_cast<double>(ls.tokens);
  const double coef = m.config().moe.router_aux_loss_coef;
  const double aux = router_aux_loss(m.router_aux(), m.config().moe.num_experts, coef);
  const double ref = expected.tensor("loss").item<double>();
  CHECK(std::abs(ce.item<double>() + coef * aux - ref) / ref < 1e-5);
  ce.backward();
  for (auto& p : params) {
    // PEFT's in-memory names carry the adapter name: "...lora_A.default.weight".
    const std::string key = "grad." + p.name.substr(0, p.name.size() - 6) + "default.weight";
    INFO(key);
    REQUIRE(expected.has(key));
    CHECK(rel(p.tensor->grad(), expected.tensor(key)) < 1e-4);
  }
}

}  // namespace

// Both ways of running the experts' products: the per-expert ones (auto on the CPU) and
// LibTorch's grouped GEMM (moe.grouped_mm=on).
TEST_CASE("MoE logits, losses, routing and gradients equal transformers' (fp32)", "[unit]") {
  const auto dirs = moe_fixture_dirs();
  REQUIRE(dirs.size() >= 2);
  const GroupedMm mode = GENERATE(GroupedMm::kAuto, GroupedMm::kOn);
  for (const std::string& dir : dirs) {
    DYNAMIC_SECTION(std::filesystem::path(dir).filename().string()
                    << (mode == GroupedMm::kOn ? " grouped_mm" : "")) {
      DecoderModel m = load_moe(dir);
      m.set_moe_grouped_mm(mode);
      const MoeConfig& moe = m.config().moe;
      REQUIRE(moe.enabled());
      auto expected = io::SafetensorsFile::open(dir + "/expected.safetensors");
      for (auto& p : m.parameters()) p.tensor->set_requires_grad(true);
      const at::Tensor ids = expected.tensor("input_ids").clone();
      const at::Tensor labels = expected.tensor("labels").clone();
      const at::Tensor logits = m.forward(ids);
      CHECK(rel(logits, expected.tensor("logits")) < 1e-5);
      // Every MoE layer picked the same k experts for every token, in the same order.
      RouterAux& aux = m.router_aux();
      REQUIRE(static_cast<int64_t>(aux.picks.size()) == m.config().num_moe_layers());
      int layer = 0;
      for (int64_t i = 0; i < m.config().num_hidden_layers; ++i) {
        if (!m.config().is_moe_layer(i)) continue;
        const std::string key = "topk_index." + std::to_string(i);
        if (expected.has(key)) CHECK(at::equal(aux.picks[layer], expected.tensor(key)));
        ++layer;
      }
      const LossSum ls = causal_lm_loss_sum(logits, labels);
      const at::Tensor ce = ls.sum / static_cast<double>(ls.tokens);
      const double coef = moe.router_aux_loss_coef;
      const double aux_loss = router_aux_loss(aux, moe.num_experts, coef);
      const double ref_aux = expected.tensor("aux_loss").item<double>();
      CHECK(std::abs(aux_loss - ref_aux) / ref_aux < 1e-5);
      const double ref_loss = expected.tensor("loss").item<double>();
      const double loss = ce.item<double>() + coef * aux_loss;
      CHECK(std::abs(loss - ref_loss) / ref_loss < 1e-5);
      ce.backward();
      for (auto& p : m.parameters()) {
        INFO(p.name);
        REQUIRE(expected.has("grad." + p.name));
        CHECK(rel(p.tensor->grad(), expected.tensor("grad." + p.name)) < 1e-4);
      }
    }
  }
}

TEST_CASE("MoE checkpoints load from either layout to the same parameters", "[unit]") {
  const auto dirs = moe_fixture_dirs();
  REQUIRE_FALSE(dirs.empty());
  for (const std::string& dir : dirs) {
    const std::string fused = dir + "_fused";
    if (!std::filesystem::exists(fused)) continue;
    INFO(fused);
    DecoderModel a = load_moe(dir), b = load_moe(fused);
    auto pa = a.parameters(), pb = b.parameters();
    REQUIRE(pa.size() == pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      INFO(pa[i].name);
      CHECK(at::equal(*pa[i].tensor, *pb[i].tensor));
    }
  }
}

TEST_CASE("PEFT's expert adapter config: keys, nesting and refusals", "[unit]") {
  // Written by PEFT 0.21.2 (make_moe_fixtures.py): LoRA on the fused experts of Qwen3-MoE.
  const LoraConfig lc =
      load_lora_config(moe_fixtures() + "/lora_qwen3_moe_experts/adapter_config.json");
  CHECK(lc.target_modules.empty());
  CHECK(lc.target_parameters ==
        std::vector<std::string>{"mlp.experts.down_proj", "mlp.experts.gate_up_proj"});
  // Both targeted: gate_up_proj (registered first) is the inner wrapper.
  CHECK(expert_lora_keys("model.layers.1.mlp.experts.gate_up_proj", lc).first ==
        "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight");
  CHECK(expert_lora_keys("model.layers.1.mlp.experts.down_proj", lc).second ==
        "base_model.model.model.layers.1.mlp.experts.lora_B.weight");
  CHECK(expert_lora_keys("model.layers.1.mlp.gate.weight", lc).first.empty());
  CHECK(expert_lora_keys("model.layers.1.self_attn.q_proj.weight", lc).first.empty());
  LoraConfig one = lc;
  one.target_parameters = {"mlp.experts.gate_up_proj"};
  CHECK(expert_lora_keys("model.layers.1.mlp.experts.gate_up_proj", one).first ==
        "base_model.model.model.layers.1.mlp.experts.lora_A.weight");
  CHECK(expert_lora_keys("model.layers.1.mlp.experts.down_proj", one).first.empty());
  // ft writes what it read back.
  const std::string tmp = test::make_temp_dir();
  { std::ofstream(tmp + "/adapter_config.json") << lora_config_json(lc); }
  CHECK(load_lora_config(tmp + "/adapter_config.json").target_parameters == lc.target_parameters);
  // Dropout with expert targets would make an adapter PEFT cannot load: refused, not dropped.
  LoraConfig dropped = lc;
  dropped.dropout = 0.05;
  CHECK_THROWS_WITH(dropped.validate("preset lora"),
                    Catch::Contains("lora.dropout to 0") && Catch::Contains("ParamWrapper"));
  // The router and one layer's experts are not adapted: refused by name.
  for (const char* entry : {"mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"}) {
    std::ofstream(tmp + "/adapter_config.json")
        << R"({"peft_type": "LORA", "r": 2, "target_modules": [], "target_parameters": [")" << entry
        << R"("]})";
    CHECK_THROWS_WITH(load_lora_config(tmp + "/adapter_config.json"),
                      Catch::Contains(entry) && Catch::Contains("not an expert weight ft adapts"));
  }
  // modules_to_save: the routers ("gate") train in full; anything else is refused by name.
  for (const char* saved : {R"(["gate"])", R"(["lm_head"])", R"(["gate", "embed_tokens"])"}) {
    std::ofstream(tmp + "/adapter_config.json")
        << R"({"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"], "modules_to_save": )"
        << saved << "}";
    if (std::string(saved) == R"(["gate"])") {
      const LoraConfig routed = load_lora_config(tmp + "/adapter_config.json");
      CHECK(routed.train_router);
      CHECK_THAT(lora_config_json(routed), Catch::Contains(R"("modules_to_save": [)"));
    } else {
      CHECK_THROWS_WITH(load_lora_config(tmp + "/adapter_config.json"),
                        Catch::Contains("modules_to_save") && Catch::Contains("lora.train_router"));
    }
  }
  // A dense model has no experts to adapt, nor a router to train.
  ModelConfig dense =
      load_model_config(std::string(FT_TEST_DIR) + "/model/fixtures/llama3_gqa_tied/config.json");
  LoraConfig on_dense = lc;
  CHECK_THROWS_WITH(fit_lora_targets(on_dense, dense), Catch::Contains("target_parameters"));
  LoraConfig router_on_dense;
  router_on_dense.train_router = true;
  CHECK_THROWS_WITH(fit_lora_targets(router_on_dense, dense), Catch::Contains("lora.train_router"));
  // The attention-only adapter of Mixtral loads.
  CHECK(load_lora_config(moe_fixtures() + "/lora_mixtral_attn/adapter_config.json").r == 4);
}

TEST_CASE("PEFT's LoRA adapter on Qwen3-MoE's fused experts: logits, loss, gradients, merge",
          "[unit]") {
  const std::string dir = moe_fixtures() + "/lora_qwen3_moe_experts";
  auto expected = io::SafetensorsFile::open(dir + "/expected.safetensors");
  const at::Tensor ids = expected.tensor("input_ids").clone();
  const GroupedMm mode = GENERATE(GroupedMm::kAuto, GroupedMm::kOn);  // (r 2: padded products)
  for (const char* base : {"qwen3_moe_tiny", "qwen3_moe_tiny_fused"}) {
    INFO(base << (mode == GroupedMm::kOn ? " grouped_mm" : ""));
    DecoderModel m = load_moe(moe_fixtures() + "/" + base);
    m.set_moe_grouped_mm(mode);
    const LoraConfig lc = load_lora_config(dir + "/adapter_config.json");
    attach_lora(m, lc, 0);
    train::load_adapter(m, dir);
    check_adapter_fixture(m, expected, 4);  // A and B of gate_up_proj and down_proj, 1 layer
    // The same experts as transformers chose with the adapter.
    CHECK(at::equal(m.router_aux().picks.at(0), expected.tensor("topk_index.1")));
    // The adapter folded into the experts (ft export --merge-lora) gives the same logits.
    DecoderModel merged = load_moe(moe_fixtures() + "/" + base);
    at::NoGradGuard no_grad;
    MoeWeights& w = merged.layers().at(1).moe;
    const MoeWeights& l = m.layers().at(1).moe;
    w.gate_up.copy_(merge_expert_lora(w.gate_up, l.gate_up_lora.a, l.gate_up_lora.b, lc.scale()));
    w.down.copy_(merge_expert_lora(w.down, l.down_lora.a, l.down_lora.b, lc.scale()));
    CHECK(rel(merged.forward(ids), expected.tensor("logits")) < 1e-5);
  }
}

TEST_CASE("PEFT's LoRA adapter on a Mixtral's attention: logits and adapter gradients", "[unit]") {
  const std::string dir = moe_fixtures() + "/lora_mixtral_attn";
  DecoderModel m = load_moe(moe_fixtures() + "/mixtral_tiny");
  const LoraConfig lc = load_lora_config(dir + "/adapter_config.json");
  attach_lora(m, lc, 0);
  train::load_adapter(m, dir);
  auto expected = io::SafetensorsFile::open(dir + "/expected.safetensors");
  check_adapter_fixture(m, expected, 2 * 4 * 2);  // A and B, q k v o, 2 layers
}

namespace {

// Sinks for one MoE layer's two expert weights, as the engine gives them (UnitHooks::grad_sink).
class ExpertSinks final : public UnitHooks {
 public:
  ExpertSinks(const at::Tensor& gate_up, const at::Tensor& down)
      : weights{gate_up, down}, into{at::zeros_like(gate_up), at::zeros_like(down)} {}
  void before_unit(int) override {}
  void after_unit(int, const at::Tensor&) override {}
  GradSink grad_sink(const at::Tensor& w) override {
    for (int64_t i = 0; i < 2; ++i)
      if (w.unsafeGetTensorImpl() == weights[i].unsafeGetTensorImpl()) return {into[i], i};
    return {};
  }
  void grad_sunk(int64_t id) override { sunk.push_back(id); }
  std::vector<at::Tensor> weights, into;
  std::vector<int64_t> sunk;
};

struct BlockPass {
  at::Tensor out, dx, dgate_up, ddown;
};

// One MoE block forward and backward of sum(out * r) for a fixed random r.
BlockPass block_pass(const MoeWeights& w, const MoeConfig& c, const at::Tensor& x,
                     const MoeOptions& o) {
  const at::Tensor xi = x.detach().requires_grad_(true);
  const at::Tensor out = moe_forward(w, c, xi, o);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  (out * at::randn(out.sizes(), gen, out.options())).sum().backward();
  BlockPass p{out.detach(), xi.grad(), {}, {}};
  for (auto [t, into] : {std::pair{&w.gate_up, &p.dgate_up}, std::pair{&w.down, &p.ddown}})
    if (t->grad().defined()) {
      *into = t->grad().clone();
      const_cast<at::Tensor&>(*t).mutable_grad() = at::Tensor();
    }
  return p;
}

struct TestBlock {
  MoeConfig c;
  MoeWeights w;
  at::Tensor x;
};

// 6 experts of 24, top 2, hidden 16, 30 tokens; expert 4 is never chosen (its router row is far
// below the others for the positive inputs).
TestBlock test_block(at::ScalarType dtype) {
  TestBlock b;
  b.c.num_experts = 6;
  b.c.experts_per_token = 2;
  b.c.expert_intermediate = 24;
  const int64_t H = 16;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto opt = at::TensorOptions().dtype(dtype);
  b.w.router = at::randn({6, H}, gen, opt);
  b.w.router[4].fill_(-50);
  b.w.gate_up = (at::randn({6, 48, H}, gen, opt) * 0.2).requires_grad_(true);
  b.w.down = (at::randn({6, H, 24}, gen, opt) * 0.2).requires_grad_(true);
  b.x = at::randn({2, 15, H}, gen, opt).abs();
  return b;
}

}  // namespace

// moe.cpp runs the local experts as one autograd node on the CPU (fused SwiGLU, no expert
// adapter); the per-expert nodes (expert_node false) are the reference: the same products on
// the same operands, so the same bits, with an expert that gets no token, with the weights'
// gradients returned or added into the strategy's sinks, and with the experts frozen. On one
// thread: the node runs each fp32 product whole on one thread, where at::mm on several may
// split a product this small between them and sum in another order (the next test).
TEST_CASE("MoE experts as one node give the per-expert nodes' bits", "[unit]") {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    DYNAMIC_SECTION(c10::toString(dtype)) {
      auto [c, w, x] = test_block(dtype);
      MoeOptions node, per_expert;
      per_expert.expert_node = false;
      const BlockPass ref = block_pass(w, c, x, per_expert);
      REQUIRE(ref.dgate_up.defined());
      // The reference's gradient of the unused expert is zero, the used ones' not.
      CHECK(ref.dgate_up[4].abs().max().item<double>() == 0);
      CHECK(ref.ddown[3].abs().max().item<double>() > 0);
      const BlockPass got = block_pass(w, c, x, node);
      CHECK(at::equal(got.out, ref.out));
      CHECK(at::equal(got.dx, ref.dx));
      CHECK(at::equal(got.dgate_up, ref.dgate_up));
      CHECK(at::equal(got.ddown, ref.ddown));

      ExpertSinks sinks(w.gate_up, w.down);
      node.hooks = &sinks;
      const BlockPass sunk = block_pass(w, c, x, node);
      CHECK(at::equal(sunk.dx, ref.dx));
      CHECK_FALSE(sunk.dgate_up.defined());  // not through autograd: into the sinks
      CHECK(sinks.sunk == std::vector<int64_t>{1, 0});
      CHECK(at::equal(sinks.into[0], ref.dgate_up));
      CHECK(at::equal(sinks.into[1], ref.ddown));

      w.gate_up.requires_grad_(false);
      w.down.requires_grad_(false);
      const BlockPass frozen_ref = block_pass(w, c, x, per_expert);
      const BlockPass frozen = block_pass(w, c, x, node);
      CHECK(at::equal(frozen.dx, frozen_ref.dx));
      CHECK(at::equal(frozen.dx, ref.dx));
      CHECK_FALSE(frozen.dgate_up.defined());
      CHECK(sinks.sunk.size() == 2);  // frozen weights ask for no sink
    }
  }
  at::set_num_threads(threads);
}

TEST_CASE(
    "MoE experts as one node on two threads: within 1e-6 of the per-expert nodes, and "
    "the same bits as on one thread",
    "[unit]") {
  const int threads = at::get_num_threads();
  auto [c, w, x] = test_block(at::kFloat);
  MoeOptions per_expert;
  per_expert.expert_node = false;
  at::set_num_threads(1);
  const BlockPass one = block_pass(w, c, x, MoeOptions());
  at::set_num_threads(2);
  const BlockPass ref = block_pass(w, c, x, per_expert);
  const BlockPass got = block_pass(w, c, x, MoeOptions());
  at::set_num_threads(threads);
  CHECK(rel(got.out, ref.out) < 1e-6);
  CHECK(rel(got.dx, ref.dx) < 1e-6);
  CHECK(rel(got.dgate_up, ref.dgate_up) < 1e-6);
  CHECK(rel(got.ddown, ref.ddown) < 1e-6);
  for (auto [a, b] : {std::pair{&got.out, &one.out}, std::pair{&got.dx, &one.dx},
                      std::pair{&got.dgate_up, &one.dgate_up}, std::pair{&got.ddown, &one.ddown}})
    CHECK(at::equal(*a, *b));
}

// moe.grouped_mm=on runs the experts as at::_grouped_mm on the CPU too: LibTorch's CPU grouped
// GEMM is one at::mm per group, so on one thread the per-expert nodes' bits, forward and
// backward, with an expert that gets no token (its gradient zero) and with the experts frozen.
// The strategy's sinks are not used (the weights' gradients come through autograd). bf16 runs
// too; fp64 and sizes that are not multiples of 16 bytes are refused with the key's name, and
// auto runs them per expert (on the CPU auto never takes the grouped GEMM).
TEST_CASE("MoE experts as LibTorch's grouped GEMM give the per-expert nodes' bits", "[unit]") {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  auto [c, w, x] = test_block(at::kFloat);
  MoeOptions grouped, per_expert;
  grouped.grouped_mm = GroupedMm::kOn;
  per_expert.expert_node = false;
  const BlockPass ref = block_pass(w, c, x, per_expert);
  const BlockPass got = block_pass(w, c, x, grouped);
  CHECK(at::equal(got.out, ref.out));
  CHECK(at::equal(got.dx, ref.dx));
  REQUIRE(got.dgate_up.defined());
  CHECK(at::equal(got.dgate_up, ref.dgate_up));
  CHECK(at::equal(got.ddown, ref.ddown));
  CHECK(got.dgate_up[4].abs().max().item<double>() == 0);  // the expert no token chose
  CHECK(got.ddown[4].abs().max().item<double>() == 0);

  ExpertSinks sinks(w.gate_up, w.down);
  grouped.hooks = &sinks;
  const BlockPass hooked = block_pass(w, c, x, grouped);
  CHECK(sinks.sunk.empty());
  CHECK(at::equal(hooked.dgate_up, ref.dgate_up));
  grouped.hooks = nullptr;

  w.gate_up.requires_grad_(false);
  w.down.requires_grad_(false);
  const BlockPass frozen = block_pass(w, c, x, grouped);
  CHECK(at::equal(frozen.dx, ref.dx));
  CHECK_FALSE(frozen.dgate_up.defined());
  at::set_num_threads(threads);

  SECTION("bf16") {
    auto [cb, wb, xb] = test_block(at::kBFloat16);
    const BlockPass r = block_pass(wb, cb, xb, per_expert);
    const BlockPass g = block_pass(wb, cb, xb, grouped);
    CHECK(rel(g.out.to(at::kFloat), r.out.to(at::kFloat)) < 1e-2);
    CHECK(rel(g.dx.to(at::kFloat), r.dx.to(at::kFloat)) < 1e-2);
    CHECK(rel(g.ddown.to(at::kFloat), r.ddown.to(at::kFloat)) < 1e-2);
  }
  SECTION("what it cannot take: an error naming the key under on, the per-expert path under auto") {
    auto [cd, wd, xd] = test_block(at::kDouble);
    CHECK_THROWS_WITH(moe_forward(wd, cd, xd, grouped),
                      Catch::Contains("moe.grouped_mm=on") && Catch::Contains("Double"));
    MoeOptions automatic;
    const BlockPass r = block_pass(wd, cd, xd, per_expert);
    CHECK(at::equal(block_pass(wd, cd, xd, automatic).out, r.out));
    // hidden 18: rows 72 bytes apart.
    MoeWeights odd = w;
    odd.router = at::randn({6, 18});
    odd.gate_up = at::randn({6, 48, 18});
    odd.down = at::randn({6, 18, 24});
    CHECK_THROWS_WITH(moe_forward(odd, c, at::randn({2, 15, 18}), grouped),
                      Catch::Contains("multiples of 4"));
  }
  CHECK(parse_grouped_mm("on") == GroupedMm::kOn);
  CHECK_THROWS_WITH(parse_grouped_mm("yes"), Catch::Contains("auto, on or off"));
}

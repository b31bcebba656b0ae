#include "model/flops.h"

#include <algorithm>

#include "core/error.h"

namespace ft::model {

namespace {

// Input and output width of one of a layer's projections.
std::pair<int64_t, int64_t> projection_shape(const ModelConfig& c, const std::string& name) {
  const int64_t d = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim, i = c.intermediate_size;
  if (name == "q_proj") return {d, q};
  if (name == "k_proj" || name == "v_proj") return {d, kv};
  if (name == "o_proj") return {q, d};
  if (name == "gate_proj" || name == "up_proj") return {d, i};
  if (name == "down_proj") return {i, d};
  if (name == "qkv_proj") return {d, q + 2 * kv};
  if (name == "gate_up_proj") return {d, 2 * i};
  throw ConfigError("FLOP count: unknown projection '" + name + "'");
}

bool is_mlp(const std::string& projection) {
  return projection == "gate_proj" || projection == "up_proj" || projection == "down_proj" ||
         projection == "gate_up_proj";
}

constexpr const char* kProjections[] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                        "gate_proj", "up_proj", "down_proj"};

}  // namespace

FlopCount training_flops(const ModelConfig& c, int64_t context,
                         const std::vector<std::string>& lora_targets, int64_t lora_r) {
  FlopCount f;
  int64_t attention = 0, mlp = 0;
  for (const char* p : kProjections) {
    const auto [in, out] = projection_shape(c, p);
    (is_mlp(p) ? mlp : attention) += in * out;
  }
  // A MoE layer's token goes through the router and its k experts only.
  const int64_t moe_layers = c.num_moe_layers(), dense_layers = c.num_hidden_layers - moe_layers;
  const int64_t expert_mlp =
      c.moe.experts_per_token * 3 * c.hidden_size * c.moe.expert_intermediate +
      c.moe.num_experts * c.hidden_size;
  f.matmul_weights = c.num_hidden_layers * attention + dense_layers * mlp +
                     moe_layers * expert_mlp + c.hidden_size * c.vocab_size;  // + the head
  for (const auto& t : lora_targets) {
    const auto [in, out] = projection_shape(c, t);
    f.adapter_weights += (is_mlp(t) ? dense_layers : c.num_hidden_layers) * lora_r * (in + out);
  }
  // Q K^T and scores x V: 2 x heads x head_dim x context FLOPs each, per token and layer; a
  // windowed layer's context is its window where that is shorter.
  double contexts = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const int64_t w = c.window(l);
    contexts += static_cast<double>(w > 0 ? std::min(w, context) : context);
  }
  const double attn_forward =
      4.0 * static_cast<double>(c.num_attention_heads * c.head_dim) * contexts;
  const double n = static_cast<double>(f.matmul_weights),
               a = static_cast<double>(f.adapter_weights);
  const bool lora = !lora_targets.empty();
  f.forward = 2 * n + 2 * a + attn_forward;
  // Backward: each product's input gradient (2 per weight) and, for trained weights, the weight's
  // gradient (2 more); attention has no weights, both of its operands get gradients.
  f.backward = (lora ? 2 * n : 4 * n) + 4 * a + 2 * attn_forward;
  f.attention = 3 * attn_forward;
  return f;
}

}  // namespace ft::model

// The FLOP count MFU uses (model/flops.h), against a count by hand for a small model.
#include "model/flops.h"

#include <catch2/catch.hpp>

using ft::model::ModelConfig;
using ft::model::training_flops;

namespace {
// d 8, 2 heads of 4, 1 KV head (GQA), MLP 16, 2 layers, vocabulary 32.
ModelConfig small() {
  ModelConfig c;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  c.intermediate_size = 16;
  c.num_hidden_layers = 2;
  c.vocab_size = 32;
  return c;
}
}  // namespace

TEST_CASE("training FLOPs per token, full fine-tuning: a count by hand") {
  // Per layer: q 8x8 = 64, k 8x4 = 32, v 8x4 = 32, o 8x8 = 64, gate 8x16 = 128, up 128, down 16x8
  // = 128: 576 weights; 2 layers 1152, the head 8x32 = 256: 1408 weights multiplied per token.
  // Attention over a context of 5: Q K^T 2*8*5 = 80 and scores x V 80 per layer, 2 layers: 320.
  const auto f = training_flops(small(), 5);
  CHECK(f.matmul_weights == 1408);
  CHECK(f.adapter_weights == 0);
  CHECK(f.forward == 2 * 1408 + 320);       // 3136
  CHECK(f.backward == 4 * 1408 + 2 * 320);  // 6272
  CHECK(f.attention == 3 * 320);
  CHECK(f.per_token() == 9408);  // = 6 N + 12 L H hd T (PaLM): 8448 + 960
}

TEST_CASE("training FLOPs per token, LoRA: frozen weights get only the input's gradient") {
  // r 2 on q (8 -> 8: 2*(8+8) = 32) and v (8 -> 4: 2*(8+4) = 24): 56 per layer, 112 in all.
  const auto f = training_flops(small(), 5, {"q_proj", "v_proj"}, 2);
  CHECK(f.matmul_weights == 1408);
  CHECK(f.adapter_weights == 112);
  CHECK(f.forward == 2 * 1408 + 2 * 112 + 320);       // 3360
  CHECK(f.backward == 2 * 1408 + 4 * 112 + 2 * 320);  // 3904
  CHECK(f.per_token() == 7264);
}

TEST_CASE("training FLOPs per token: Llama 2 7B at 4096 is PaLM's 6N + 12 L H Q T") {
  ModelConfig c;  // the defaults are Llama 2 7B's shape
  const auto f = training_flops(c, 4096);
  // 32 layers x (4 x 4096^2 + 3 x 4096 x 11008) + 4096 x 32000 = 6,607,077,376 weights.
  CHECK(f.matmul_weights == 6607077376LL);
  CHECK(f.per_token() == 6.0 * 6607077376LL + 12.0 * 32 * 4096 * 4096);
}

// The decoder of every model family ft trains (model/family.h), on ATen with autograd, assembled
// from the family's row: RMSNorm in its three styles and three placements, optional q/k norms,
// rotary embeddings (rotate-half on HF's q/k layout; partial; linear, llama3 and longrope scaling;
// a local theta for sliding layers), grouped-query attention (fp32 on the host by
// model/cpu_attention.h, elsewhere scaled_dot_product_attention; an explicit softmax where scores
// are soft-capped), sliding windows computed chunk by chunk,
// SwiGLU or GeGLU MLPs, fused qkv / gate_up projections, and the families' scales. Parameters
// carry the family's Hugging Face names so weight files map one to one. The model owns its
// parameter tensors; a strategy (later) may replace their storage with shards. Layers may run under
// activation checkpointing (recomputed in backward). Not thread-safe: one training thread per
// model.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <array>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/fused_ops.h"
#include "model/moe.h"
#include "model/nf4.h"
#include "model/unit_hooks.h"

namespace ft::model {

// logits -> tanh(logits / divisor / softcap) * softcap (softcap 0: logits / divisor).
struct LogitMap {
  double divisor = 1;
  double softcap = 0;
  bool identity() const { return divisor == 1 && softcap == 0; }
  at::Tensor apply(const at::Tensor& logits) const;
};

struct NamedTensor {
  std::string name;  // Hugging Face parameter name, e.g. "model.layers.0.self_attn.q_proj.weight"
  at::Tensor* tensor;
  const Nf4Shape* nf4 = nullptr;  // an NF4 projection's weight: *tensor is its blob
};

// A projection y = x W^T (+ b), with an optional LoRA adapter added by model/lora.
struct Linear {
  // [out, in]; an NF4 base (ModelConfig::quant): the blob model/nf4.h lays out, 1-D in the
  // model's dtype, frozen (model/quantized_linear.h computes with it).
  at::Tensor weight;
  Nf4Shape nf4;       // rows 0: not quantized
  at::Tensor bias;    // [out] or undefined
  at::Tensor lora_a;  // [r, in] or undefined
  at::Tensor lora_b;  // [out, r] or undefined
  double lora_scale = 0;
  double lora_dropout = 0;
  // `hooks` (optional): asked for the weight's gradient sink (UnitHooks::grad_sink).
  at::Tensor forward(const at::Tensor& x, bool training, UnitHooks* hooks = nullptr) const;
  bool requires_grad() const;  // some tensor of it (base or adapter) requires grad
  int64_t out_features() const { return nf4.defined() ? nf4.rows : weight.size(0); }
  int64_t in_features() const { return nf4.defined() ? nf4.cols : weight.size(1); }
};

// A layer's tensors; those its family lacks stay undefined.
struct DecoderLayer {
  at::Tensor input_layernorm;  // [hidden]; none in post-norm families
  Linear q_proj, k_proj, v_proj,
      o_proj;                 // [heads*hd, hidden], [kv*hd, hidden] x2, [hidden, heads*hd]
  Linear qkv_proj;            // fused families: [(heads + 2 kv) * hd, hidden], rows q, k, v
  at::Tensor q_norm, k_norm;  // [head_dim] per head, or [heads*hd] / [kv*hd] whole
  at::Tensor post_attention_layernorm;    // [hidden]: before the MLP (pre), on attention's output
  at::Tensor pre_feedforward_layernorm;   // [hidden] sandwich
  at::Tensor post_feedforward_layernorm;  // [hidden] sandwich, post
  Linear gate_proj, up_proj, down_proj;   // [inter, hidden] x2, [hidden, inter]
  Linear gate_up_proj;                    // fused families: [2 inter, hidden], rows gate, up
  MoeWeights moe;                         // a MoE layer's router and experts (no dense MLP)
  bool requires_grad() const;             // some parameter of the layer requires grad
};

// Which transformer layers run under activation checkpointing (model/activation_checkpoint.h):
// none, every layer, or the layers whose index is a multiple of n (0, n, 2n, ...).
enum class ActivationCheckpointing { kNone, kFull, kEveryN };

// "none" | "full" | "every_n", as train.activation_checkpointing spells them; ConfigError
// otherwise.
ActivationCheckpointing parse_activation_checkpointing(const std::string& name);

class DecoderModel {
 public:
  // Allocates every parameter (uninitialised) with `options` (dtype, device). With
  // `materialize` false the parameters are shapes only (meta device): a strategy gives them
  // storage.
  DecoderModel(const ModelConfig& config, at::TensorOptions options, bool materialize = true);

  const ModelConfig& config() const { return config_; }

  // Every base parameter with its HF name, in file order: embeddings, layers, final norm, head.
  // A tied head is not listed (it is the embedding).
  std::vector<NamedTensor> parameters();

  // transformers' init: normal(0, initializer_range) for projections and embeddings, ones for
  // norms, zeros for biases, from a CPU generator seeded with `seed` (identical on every machine).
  void init_random(uint64_t seed);

  // Fills every parameter through `fill(name, dst)`, which must copy the named tensor into `dst`
  // (checking its shape). Used with io::ModelFiles; a missing name is the caller's error to raise.
  void load(const std::function<void(const std::string& name, at::Tensor& dst)>& fill);

  // input_ids: [B, T] int64. position_ids: [B, T] int64 or undefined (0..T-1). segment_ids:
  // [B, T] int64 or undefined; with packed sequences, tokens attend only within their segment.
  // Returns logits [B, T, vocab] in the parameters' dtype (logit_map applied).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& position_ids = {},
                     bool training = false, const at::Tensor& segment_ids = {}) const;

  // Final hidden states [B, T, hidden] (before the LM head).
  at::Tensor hidden_states(const at::Tensor& input_ids, const at::Tensor& position_ids,
                           bool training, const at::Tensor& segment_ids = {}) const;
  const at::Tensor& lm_head() const {
    return config_.tie_word_embeddings ? embed_tokens_ : lm_head_;
  }
  // What the family does to the head's product before the loss (Granite's divisor, Gemma 2's cap).
  LogitMap logit_map() const { return {config_.logits_divisor, config_.final_softcap}; }

  std::vector<DecoderLayer>& layers() { return layers_; }
  // Installs (or with nullptr removes) the hooks the forward calls around its units. Not owned.
  void set_unit_hooks(UnitHooks* hooks) { hooks_ = hooks; }
  UnitHooks* unit_hooks() const { return hooks_; }
  int num_units() const { return 1 + static_cast<int>(layers_.size()); }
  // The unit a parameter (HF or PEFT name) belongs to: 0 root, i+1 for model.layers.i.
  static int unit_of(const std::string& name);
  // The value init_random gives the parameter `name` of `shape`: fp32 on CPU, drawn from `gen`
  // (which advances only for projections and embeddings), so streaming every parameter in
  // parameters() order reproduces init_random exactly without holding the model.
  at::Tensor init_value(const std::string& name, at::IntArrayRef shape, at::Generator& gen) const;

  // From now on, forward passes with grad run the chosen layers without keeping their activations
  // and recompute them in backward: same loss and gradients, less memory held between forward and
  // backward, one more forward of those layers per step. `every_n` (>= 1) is used by kEveryN.
  // Gradients reach the parameters through backward() only (not torch::autograd::grad), and the
  // graph refers to the layers, so the model must outlive it.
  void set_activation_checkpointing(ActivationCheckpointing mode, int64_t every_n = 1);
  bool checkpoints_layer(int64_t index) const;

  // Which fused kernels (model/fused_ops.h, CPU and CUDA) the forward uses; all by default. The
  // unfused path (transformers' op sequence) runs where one is off.
  void set_fused_ops(FusedOps ops) { fused_ = ops; }
  // The embedding's gradient as a sparse COO tensor (one row per token) instead of a dense
  // [vocab, hidden] one: for a consumer that adds it into its own buffer (parallel/engine.cpp on
  // the CPU). Off by default: a plain autograd user finds a dense .grad().
  void set_sparse_embedding_grad(bool on) { sparse_embedding_grad_ = on; }
  const FusedOps& fused_ops() const { return fused_; }
  // How MoE layers run their experts' products (moe.grouped_mm, model/moe.h); auto by default.
  void set_moe_grouped_mm(GroupedMm mode) { moe_grouped_mm_ = mode; }

  // What the last forward's MoE layers routed (model/moe.h); cleared by every forward. The
  // trainer turns it into the aux loss between forward and backward.
  RouterAux& router_aux() const { return router_aux_; }
  // Expert parallelism: MoE layers send their rows through `exchange` (not owned; nullptr: every
  // expert local). Set before the forward; the layers' expert tensors hold its local experts.
  void set_expert_exchange(ExpertExchange* exchange) { exchange_ = exchange; }

 private:
  // cos and sin [B, T, rotary_dim] in `dtype` for the global (or, `local`, the sliding layers')
  // rotary table, longrope's short or long set picked from the positions.
  std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& position_ids,
                                                 at::ScalarType dtype, bool local) const;
  bool fuses_norm(const at::Tensor& x, const at::Tensor& weight) const;
  // The weight the fused norm multiplies by: 1 + w for Gemma's style (an autograd op), else w.
  at::Tensor fused_norm_weight(const at::Tensor& weight) const;
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight) const;
  // q, k, v [B, T, heads, head_dim] of a layer's projections (fused or not), q/k-normed.
  std::array<at::Tensor, 3> qkv(const DecoderLayer& layer, const at::Tensor& x,
                                bool training) const;
  at::Tensor attention(const DecoderLayer& layer, const at::Tensor& x, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& mask, const at::Tensor& segment_ids,
                       int64_t window, bool training) const;
  at::Tensor mlp(const DecoderLayer& layer, const at::Tensor& x, bool training,
                 bool record = true) const;
  // Whether the single-node attention / MLP (one autograd node, gradients into sinks) can run
  // this layer on input x: the family's pieces there are Llama's, per-head q/k norms (Qwen3,
  // Gemma 3) where the fused norm runs, a window no shorter than the sequence; SwiGLU or GeGLU.
  bool plain_attention(const DecoderLayer& layer, const at::Tensor& x, int64_t window,
                       int64_t T) const;
  bool plain_mlp() const;
  // One decoder layer: hidden [B, T, hidden] -> [B, T, hidden]; cos, sin [B, T, head_dim]; mask
  // [B, 1, T, T] bool or undefined (causal).
  // Whether every one of `linears` gives its weight's gradient to a sink and has nothing else
  // trained (no bias, no LoRA); their sinks, in order, into `sinks`. Needs hooks_.
  bool all_sunk(std::initializer_list<const Linear*> linears, UnitHooks::GradSink* sinks) const;
  // in: {hidden, cos, sin, mask, segment_ids} (model/activation_checkpoint.h's block inputs).
  // `record`: MoE layers record their routing (false in an activation checkpoint's recompute).
  at::Tensor layer_forward(int64_t index, const std::vector<at::Tensor>& in, bool training,
                           bool record = true) const;
  at::Tensor moe_mlp(const DecoderLayer& layer, const at::Tensor& x, bool record) const;
  ModelConfig config_;
  const Family* family_;     // config_'s row, looked up once (the forward asks it per norm)
  at::Tensor embed_tokens_;  // [vocab, hidden]
  std::vector<DecoderLayer> layers_;
  at::Tensor norm_;            // [hidden]
  at::Tensor lm_head_;         // [vocab, hidden], undefined when tied
  at::Tensor inv_freq_;        // [rotary_dim/2] fp32, rotary inverse frequencies (with scaling)
  at::Tensor long_inv_freq_;   // longrope: the long set (inv_freq_ is the short one)
  at::Tensor local_inv_freq_;  // Gemma 3's sliding layers
  UnitHooks* hooks_ = nullptr;
  ActivationCheckpointing checkpointing_ = ActivationCheckpointing::kNone;
  int64_t checkpoint_every_n_ = 1;
  FusedOps fused_;
  GroupedMm moe_grouped_mm_ = GroupedMm::kAuto;
  bool sparse_embedding_grad_ = false;
  mutable RouterAux router_aux_;
  ExpertExchange* exchange_ = nullptr;
};

// Rotary inverse frequencies exactly as transformers computes them (fp32), [rotary_dim / 2], for
// `rope` (config.rope or config.local_rope); longrope's `long_factor` set with `long_set`.
at::Tensor rope_inv_freq(const ModelConfig& config, const RopeConfig& rope, bool long_set = false);

// Sum of next-token cross-entropy over positions whose shifted label is not -100, in fp32, and the
// number of such tokens. logits [B, T, V], labels [B, T] int64 (the shift happens here, as in HF).
struct LossSum {
  at::Tensor sum;      // [] fp32 (fp64 for fp64 logits; chunked_lm_loss_sum: see there)
  int64_t tokens = 0;  // 0 when not counted
};
// count_tokens=false leaves `tokens` 0: counting reads a value back, which on a GPU makes the host
// wait there (the trainer counts the tokens from the host's copy of the labels instead).
LossSum causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels,
                           bool count_tokens = true);

}  // namespace ft::model

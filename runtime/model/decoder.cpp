#include "model/decoder.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "model/activation_checkpoint.h"
#include "model/attention.h"
#include "model/cpu_attention.h"
#include "model/host_blas.h"
#include "model/quantized_linear.h"
#include "model/sink_nodes.h"

namespace ft::model {

at::Tensor Linear::forward(const at::Tensor& x, bool training, UnitHooks* hooks) const {
  UnitHooks::GradSink sink;
  if (hooks && !bias.defined() && weight.requires_grad() && at::GradMode::is_enabled())
    sink = hooks->grad_sink(weight);
  at::Tensor y;
  if (nf4.defined()) {
    y = nf4_linear(x, weight, nf4);
    if (bias.defined()) y = y + bias;
  } else {
    y = sink.into.defined()
            ? sink_linear(x, weight, sink.into, hooks, sink.id)
            : at::linear(x, weight,
                         bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
  }
  if (lora_a.defined()) {
    at::Tensor h = lora_dropout > 0 && training ? at::dropout(x, lora_dropout, true) : x;
    y = y + at::linear(at::linear(h, lora_a), lora_b) * lora_scale;
  }
  return y;
}

bool Linear::requires_grad() const {
  for (const at::Tensor* t : {&weight, &bias, &lora_a, &lora_b})
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

bool DecoderLayer::requires_grad() const {
  for (const Linear* l : {&q_proj, &k_proj, &v_proj, &o_proj, &qkv_proj, &gate_proj, &up_proj,
                          &down_proj, &gate_up_proj})
    if (l->requires_grad()) return true;
  for (const at::Tensor* t :
       {&input_layernorm, &q_norm, &k_norm, &post_attention_layernorm, &pre_feedforward_layernorm,
        &post_feedforward_layernorm, &moe.router, &moe.gate_up, &moe.down, &moe.gate_up_lora.a,
        &moe.gate_up_lora.b, &moe.down_lora.a, &moe.down_lora.b})
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

at::Tensor LogitMap::apply(const at::Tensor& logits) const {
  at::Tensor l = divisor == 1 ? logits : logits / divisor;
  return softcap > 0 ? at::tanh(l / softcap) * softcap : l;
}

ActivationCheckpointing parse_activation_checkpointing(const std::string& name) {
  if (name == "none") return ActivationCheckpointing::kNone;
  if (name == "full") return ActivationCheckpointing::kFull;
  if (name == "every_n") return ActivationCheckpointing::kEveryN;
  FT_CHECK(false, "train.activation_checkpointing must be none, full or every_n, got '", name, "'");
  return ActivationCheckpointing::kNone;
}

at::Tensor rope_inv_freq(const ModelConfig& c, const RopeConfig& rope, bool long_set) {
  const int64_t dim = c.rotary_dim();
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  // 1 / base^(arange(0, dim, 2) / dim), in fp32 as transformers does.
  at::Tensor exponent = at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
                        static_cast<double>(dim);
  at::Tensor base = at::pow(at::scalar_tensor(rope.theta, f32), exponent);
  if (rope.type == "longrope") {
    // _compute_longrope_parameters: 1 / (ext_factors * base^(...)).
    const std::vector<double>& ext = long_set ? rope.long_factor : rope.short_factor;
    return (1.0 / (at::tensor(ext, at::kDouble).to(at::kFloat) * base)).contiguous();
  }
  at::Tensor inv_freq = 1.0 / base;
  if (rope.type == "linear") {
    inv_freq = inv_freq / rope.factor;
  } else if (rope.type == "llama3") {
    const double factor = rope.factor, lo = rope.low_freq_factor, hi = rope.high_freq_factor;
    const double old_ctx = static_cast<double>(rope.original_max_position_embeddings);
    const double low_freq_wavelen = old_ctx / lo, high_freq_wavelen = old_ctx / hi;
    at::Tensor wavelen = 2 * M_PI / inv_freq;
    at::Tensor llama = at::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
    at::Tensor smooth = (old_ctx / wavelen - lo) / (hi - lo);
    at::Tensor smoothed = (1 - smooth) * llama / factor + smooth * llama;
    at::Tensor medium =
        at::logical_not(wavelen < high_freq_wavelen) * at::logical_not(wavelen > low_freq_wavelen);
    inv_freq = at::where(medium, smoothed, llama);
  }
  return inv_freq.contiguous();
}

DecoderModel::DecoderModel(const ModelConfig& config, at::TensorOptions options, bool materialize)
    : config_(config), family_(&config_.family()) {
  config_.validate("model config");
  const auto& c = config_;
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  const at::TensorOptions param_options = materialize ? options : options.device(at::kMeta);
  auto make = [&](std::initializer_list<int64_t> shape) { return at::empty(shape, param_options); };
  auto linear = [&](int64_t out, int64_t in, bool bias) {
    Linear l;
    if (c.quant.nf4) {
      l.nf4 = {out, in, c.quant.blocksize};
      l.weight = make({l.nf4.elements(param_options.dtype().toScalarType())});
    } else {
      l.weight = make({out, in});
    }
    if (bias) l.bias = make({out});
    return l;
  };
  const Family& f = *family_;
  const bool pre = f.placement != NormPlacement::kPost, fused = f.fused_projections;
  embed_tokens_ = make({c.vocab_size, c.hidden_size});
  layers_.resize(c.num_hidden_layers);
  for (auto& L : layers_) {
    if (pre) L.input_layernorm = make({c.hidden_size});
    if (fused) {
      L.qkv_proj = linear(q + 2 * kv, c.hidden_size, c.qkv_bias);
    } else {
      L.q_proj = linear(q, c.hidden_size, c.qkv_bias);
      L.k_proj = linear(kv, c.hidden_size, c.qkv_bias);
      L.v_proj = linear(kv, c.hidden_size, c.qkv_bias);
    }
    L.o_proj = linear(c.hidden_size, q, c.o_bias);
    if (f.qk_norm != QkNorm::kNone) {
      L.q_norm = make({f.qk_norm == QkNorm::kPerHead ? c.head_dim : q});
      L.k_norm = make({f.qk_norm == QkNorm::kPerHead ? c.head_dim : kv});
    }
    L.post_attention_layernorm = make({c.hidden_size});
    if (f.placement == NormPlacement::kSandwich)
      L.pre_feedforward_layernorm = make({c.hidden_size});
    if (f.placement != NormPlacement::kPre) L.post_feedforward_layernorm = make({c.hidden_size});
    const int64_t index = &L - layers_.data();
    if (c.is_moe_layer(index)) {
      // The router scores every expert; the expert weights are this rank's (expert parallelism).
      const int64_t E = c.moe.num_experts, local = c.moe.local_experts();
      const int64_t inter = c.moe.expert_intermediate;
      L.moe.router = make({E, c.hidden_size});
      L.moe.gate_up = make({local, 2 * inter, c.hidden_size});
      L.moe.down = make({local, c.hidden_size, inter});
      continue;
    }
    if (fused) {
      L.gate_up_proj = linear(2 * c.intermediate_size, c.hidden_size, c.mlp_bias);
    } else {
      L.gate_proj = linear(c.intermediate_size, c.hidden_size, c.mlp_bias);
      L.up_proj = linear(c.intermediate_size, c.hidden_size, c.mlp_bias);
    }
    L.down_proj = linear(c.hidden_size, c.intermediate_size, c.mlp_bias);
  }
  norm_ = make({c.hidden_size});
  if (!c.tie_word_embeddings) lm_head_ = make({c.vocab_size, c.hidden_size});
  inv_freq_ = rope_inv_freq(c, c.rope).to(options.device());
  if (c.rope.type == "longrope")
    long_inv_freq_ = rope_inv_freq(c, c.rope, true).to(options.device());
  if (c.has_local_rope) local_inv_freq_ = rope_inv_freq(c, c.local_rope).to(options.device());
}

std::vector<NamedTensor> DecoderModel::parameters() {
  std::vector<NamedTensor> out;
  out.push_back({"model.embed_tokens.weight", &embed_tokens_});
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& L = layers_[i];
    std::string p = fmt::format("model.layers.{}.", i);
    auto lin = [&](const std::string& name, Linear& l) {
      if (!l.weight.defined()) return;
      out.push_back({p + name + ".weight", &l.weight, l.nf4.defined() ? &l.nf4 : nullptr});
      if (l.bias.defined()) out.push_back({p + name + ".bias", &l.bias});
    };
    auto norm = [&](const std::string& name, at::Tensor& t) {
      if (t.defined()) out.push_back({p + name + ".weight", &t});
    };
    norm("input_layernorm", L.input_layernorm);
    lin("self_attn.q_proj", L.q_proj);
    lin("self_attn.k_proj", L.k_proj);
    lin("self_attn.v_proj", L.v_proj);
    lin("self_attn.qkv_proj", L.qkv_proj);
    lin("self_attn.o_proj", L.o_proj);
    norm("self_attn.q_norm", L.q_norm);
    norm("self_attn.k_norm", L.k_norm);
    norm("post_attention_layernorm", L.post_attention_layernorm);
    norm("pre_feedforward_layernorm", L.pre_feedforward_layernorm);
    norm("post_feedforward_layernorm", L.post_feedforward_layernorm);
    lin("mlp.gate_proj", L.gate_proj);
    lin("mlp.up_proj", L.up_proj);
    lin("mlp.gate_up_proj", L.gate_up_proj);
    lin("mlp.down_proj", L.down_proj);
    if (L.moe.defined()) {
      out.push_back({p + "mlp.gate.weight", &L.moe.router});
      out.push_back({p + "mlp.experts.gate_up_proj", &L.moe.gate_up});
      out.push_back({p + "mlp.experts.down_proj", &L.moe.down});
    }
  }
  out.push_back({"model.norm.weight", &norm_});
  if (lm_head_.defined()) out.push_back({"lm_head.weight", &lm_head_});
  return out;
}

at::Tensor DecoderModel::init_value(const std::string& name, at::IntArrayRef shape,
                                    at::Generator& gen) const {
  const bool is_norm = name.find("norm") != std::string::npos;
  const bool is_bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  // transformers' init: ones for x * w norms, zeros for Gemma's x * (1 + w).
  if (is_norm)
    return family_->norm == NormStyle::kOffset ? at::zeros(shape, at::kFloat)
                                               : at::ones(shape, at::kFloat);
  if (is_bias) return at::zeros(shape, at::kFloat);
  // Drawn on CPU in fp32 so the values do not depend on the device or the storage dtype.
  at::Tensor cpu = at::empty(shape, at::kFloat);
  cpu.normal_(0.0, config_.initializer_range, gen);
  return cpu;
}

void DecoderModel::init_random(uint64_t seed) {
  at::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& p : parameters()) p.tensor->copy_(init_value(p.name, p.tensor->sizes(), gen));
}

int DecoderModel::unit_of(const std::string& name) {
  // HF "model.layers.<i>." or PEFT "base_model.model.model.layers.<i>."
  const std::string key = "model.layers.";
  const auto at = name.find(key);
  if (at == std::string::npos) return 0;
  return 1 + std::stoi(name.substr(at + key.size()));
}

void DecoderModel::load(const std::function<void(const std::string&, at::Tensor&)>& fill) {
  at::NoGradGuard no_grad;
  for (auto& p : parameters()) fill(p.name, *p.tensor);
}

void DecoderModel::set_activation_checkpointing(ActivationCheckpointing mode, int64_t every_n) {
  FT_CHECK(every_n >= 1, "train.checkpoint_every_n_layers must be >= 1, got ", every_n);
  checkpointing_ = mode;
  checkpoint_every_n_ = every_n;
}

bool DecoderModel::checkpoints_layer(int64_t index) const {
  switch (checkpointing_) {
    case ActivationCheckpointing::kNone:
      return false;
    case ActivationCheckpointing::kFull:
      return true;
    case ActivationCheckpointing::kEveryN:
      return index % checkpoint_every_n_ == 0;
  }
  FT_ASSERT(false, "unknown ActivationCheckpointing ", static_cast<int>(checkpointing_));
  return false;
}

std::pair<at::Tensor, at::Tensor> DecoderModel::rope_cos_sin(const at::Tensor& position_ids,
                                                             at::ScalarType dtype,
                                                             bool local) const {
  const RopeConfig& rope = local ? config_.local_rope : config_.rope;
  at::Tensor inv_freq = local ? local_inv_freq_ : inv_freq_;
  double scaling = 1.0;
  if (rope.type == "longrope") {
    // dynamic_rope_update: the long set when the batch's largest position + 1 passes the
    // original context (a host read; longrope models only).
    if (position_ids.max().item<int64_t>() + 1 > rope.original_max_position_embeddings)
      inv_freq = long_inv_freq_;
    scaling = rope.attention_factor;
  }
  at::Tensor freqs = position_ids.unsqueeze(-1).to(at::kFloat) * inv_freq;  // [B, T, rd/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos(), sin = emb.sin();
  if (scaling != 1.0) {
    cos = cos * scaling;
    sin = sin * scaling;
  }
  return {cos.to(dtype).contiguous(), sin.to(dtype).contiguous()};
}

// The fused RMSNorm runs wherever it equals transformers' within rounding: on CPU tensors of one
// dtype, except fp64, whose norm transformers computes in fp32 (the unfused path does the same);
// for the fp32-weighted styles (OLMo 2, Gemma) in fp32 only, where they round as Llama's does.
bool DecoderModel::fuses_norm(const at::Tensor& x, const at::Tensor& weight) const {
  return fused_.rms_norm && fuses_on_device(x) && weight.scalar_type() == x.scalar_type() &&
         x.scalar_type() != at::kDouble &&
         (family_->norm == NormStyle::kScale || x.scalar_type() == at::kFloat);
}

at::Tensor DecoderModel::fused_norm_weight(const at::Tensor& weight) const {
  return family_->norm == NormStyle::kOffset ? weight + 1.0 : weight;
}

at::Tensor DecoderModel::norm(const at::Tensor& x, const at::Tensor& weight) const {
  if (fuses_norm(x, weight))
    return fused_rms_norm(x, fused_norm_weight(weight), config_.rms_norm_eps);
  return rms_norm(x, weight, config_.rms_norm_eps, family_->norm);
}

bool DecoderModel::all_sunk(std::initializer_list<const Linear*> linears,
                            UnitHooks::GradSink* sinks) const {
  for (const Linear* l : linears)
    if (l->bias.defined() || l->lora_a.defined() || !l->weight.requires_grad()) return false;
  for (const Linear* l : linears) {
    *sinks = hooks_->grad_sink(l->weight);
    if (!sinks->into.defined()) return false;
    ++sinks;
  }
  return true;
}

bool DecoderModel::plain_attention(const DecoderLayer& L, const at::Tensor& x, int64_t window,
                                   int64_t T) const {
  const auto& c = config_;
  const Family& f = *family_;
  // Per-head q/k norms run in the node by the fused norm's kernels, so only where it would run.
  const bool qk_norm =
      f.qk_norm == QkNorm::kNone ||
      (f.qk_norm == QkNorm::kPerHead && fuses_norm(x, L.q_norm) && fuses_norm(x, L.k_norm));
  return !f.fused_projections && qk_norm && c.rotary_dim() == c.head_dim && c.attn_softcap == 0 &&
         (window == 0 || window >= T);
}

bool DecoderModel::plain_mlp() const { return !family_->fused_projections; }

std::array<at::Tensor, 3> DecoderModel::qkv(const DecoderLayer& L, const at::Tensor& x,
                                            bool training) const {
  const auto& c = config_;
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t nq = c.num_attention_heads * c.head_dim, nkv = c.num_key_value_heads * c.head_dim;
  at::Tensor q, k, v;
  if (L.qkv_proj.weight.defined()) {
    const at::Tensor y = L.qkv_proj.forward(x, training, hooks_);
    q = y.narrow(-1, 0, nq);
    k = y.narrow(-1, nq, nkv);
    v = y.narrow(-1, nq + nkv, nkv);
  } else {
    q = L.q_proj.forward(x, training, hooks_);
    k = L.k_proj.forward(x, training, hooks_);
    v = L.v_proj.forward(x, training, hooks_);
  }
  if (family_->qk_norm == QkNorm::kWhole) {  // OLMo 2: over the whole projection
    q = norm(q, L.q_norm);
    k = norm(k, L.k_norm);
  }
  q = q.reshape({B, T, -1, c.head_dim});
  k = k.reshape({B, T, -1, c.head_dim});
  v = v.reshape({B, T, -1, c.head_dim});
  if (family_->qk_norm == QkNorm::kPerHead) {  // Qwen3, Gemma 3: per head
    q = norm(q, L.q_norm);
    k = norm(k, L.k_norm);
  }
  return {q, k, v};
}

at::Tensor DecoderModel::attention(const DecoderLayer& L, const at::Tensor& x,
                                   const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& mask, const at::Tensor& segment_ids,
                                   int64_t window, bool training) const {
  const auto& c = config_;
  const int64_t B = x.size(0), T = x.size(1);
  // One node for the attention block where every weight sinks its gradient.
  const bool node_input = hooks_ && at::GradMode::is_enabled() && x.is_cpu() &&
                          x.scalar_type() == at::kFloat && x.dim() == 3 && x.requires_grad();
  std::array<UnitHooks::GradSink, 4> sinks;
  // (The mask is in its 0 / -inf form here: the node is CPU-only, and hidden_states made it so.)
  if (node_input && fused_.rope && fused_.attention && host_sgemm_available() &&
      plain_attention(L, x, window, T) && (!mask.defined() || mask.scalar_type() != at::kBool) &&
      all_sunk({&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj}, sinks.data())) {
    // The q/k norm weights come in attached: their gradients go through autograd.
    c10::optional<at::Tensor> q_norm, k_norm;
    if (family_->qk_norm == QkNorm::kPerHead) {
      q_norm = fused_norm_weight(L.q_norm);
      k_norm = fused_norm_weight(L.k_norm);
    }
    return sink_attention(x, L.q_proj.weight.detach(), L.k_proj.weight.detach(),
                          L.v_proj.weight.detach(), L.o_proj.weight.detach(), cos, sin, q_norm,
                          k_norm, mask, c.head_dim, c.softmax_scale(), c.rms_norm_eps, hooks_,
                          sinks);
  }
  // [B, T, heads, head_dim]: the rotary embedding before the heads move to dimension 1.
  auto [q, k, v] = qkv(L, x, training);
  if (family_->rope_in_fp32 && q.scalar_type() != at::kFloat) {
    // OLMo 2 rotates in fp32 (cos and sin too) and casts back.
    const auto dtype = q.scalar_type();
    q = rotate(q.to(at::kFloat), cos, sin, fused_.rope).to(dtype).transpose(1, 2);
    k = rotate(k.to(at::kFloat), cos, sin, fused_.rope).to(dtype).transpose(1, 2);
  } else {
    q = rotate(q, cos, sin, fused_.rope).transpose(1, 2);
    k = rotate(k, cos, sin, fused_.rope).transpose(1, 2);
  }
  v = v.transpose(1, 2);
  at::Tensor a = window > 0 && window < T
                     ? attend_windowed(q, k, v, segment_ids, window, c.softmax_scale(),
                                       c.attn_softcap, fused_.attention)
                     : attend(q, k, v, mask, /*causal=*/T > 1, c.softmax_scale(), c.attn_softcap,
                              fused_.attention);
  return L.o_proj.forward(a.transpose(1, 2).reshape({B, T, -1}), training, hooks_);
}

at::Tensor DecoderModel::moe_mlp(const DecoderLayer& L, const at::Tensor& x, bool record) const {
  MoeOptions o;
  o.activation = config_.activation;
  o.fused_swiglu = fused_.swiglu;
  o.grouped_mm = moe_grouped_mm_;
  o.weights_in_dtype = family_->moe == MoeStyle::kQwen;
  o.aux = &router_aux_;
  o.record = record;
  o.exchange = exchange_;
  o.hooks = hooks_;
  return moe_forward(L.moe, config_.moe, x, o);
}

at::Tensor DecoderModel::mlp(const DecoderLayer& L, const at::Tensor& x, bool training,
                             bool record) const {
  if (L.moe.defined()) return moe_mlp(L, x, record);
  const bool node_input = hooks_ && at::GradMode::is_enabled() && x.is_cpu() &&
                          x.scalar_type() == at::kFloat && x.dim() == 3 && x.requires_grad();
  std::array<UnitHooks::GradSink, 3> sinks;
  if (node_input && fused_.swiglu && plain_mlp() &&
      all_sunk({&L.gate_proj, &L.up_proj, &L.down_proj}, sinks.data())) {
    return sink_mlp(x, L.gate_proj.weight.detach(), L.up_proj.weight.detach(),
                    L.down_proj.weight.detach(), config_.activation == Activation::kGeluTanh,
                    hooks_, sinks);
  }
  const bool gelu = config_.activation == Activation::kGeluTanh;
  at::Tensor m;
  if (L.gate_up_proj.weight.defined()) {  // Phi-3: rows gate, then up
    m = gated_product_packed(L.gate_up_proj.forward(x, training, hooks_), gelu, fused_.swiglu);
  } else {
    const at::Tensor gate = L.gate_proj.forward(x, training, hooks_);
    const at::Tensor up = L.up_proj.forward(x, training, hooks_);
    m = gated_product(gate, up, gelu, fused_.swiglu);
  }
  return L.down_proj.forward(m, training, hooks_);
}

at::Tensor DecoderModel::layer_forward(int64_t index, const std::vector<at::Tensor>& in,
                                       bool training, bool record) const {
  const DecoderLayer& L = layers_[static_cast<size_t>(index)];
  const auto& c = config_;
  const at::Tensor &hidden = in[0], &cos = in[1], &sin = in[2], &mask = in[3], &segments = in[4];
  const int64_t window = c.window(index);
  const double rm = c.residual_multiplier;
  auto scaled = [rm](const at::Tensor& t) { return rm == 1.0 ? t : t * rm; };
  at::Tensor h = hidden;
  switch (family_->placement) {
    case NormPlacement::kPre: {
      const at::Tensor o =
          attention(L, norm(h, L.input_layernorm), cos, sin, mask, segments, window, training);
      at::Tensor x;
      if (rm == 1.0 && family_->norm != NormStyle::kOffset &&
          fuses_norm(h, L.post_attention_layernorm)) {
        std::tie(h, x) = fused_add_rms_norm(h, o, L.post_attention_layernorm, c.rms_norm_eps);
      } else {
        h = h + scaled(o);
        x = norm(h, L.post_attention_layernorm);
      }
      return h + scaled(mlp(L, x, training, record));
    }
    case NormPlacement::kSandwich: {
      at::Tensor o =
          attention(L, norm(h, L.input_layernorm), cos, sin, mask, segments, window, training);
      h = h + norm(o, L.post_attention_layernorm);
      o = mlp(L, norm(h, L.pre_feedforward_layernorm), training, record);
      return h + norm(o, L.post_feedforward_layernorm);
    }
    case NormPlacement::kPost: {
      at::Tensor o = attention(L, h, cos, sin, mask, segments, window, training);
      h = h + norm(o, L.post_attention_layernorm);
      return h + norm(mlp(L, h, training, record), L.post_feedforward_layernorm);
    }
  }
  FT_ASSERT(false, "unknown NormPlacement");
  return h;
}

at::Tensor DecoderModel::hidden_states(const at::Tensor& input_ids,
                                       const at::Tensor& position_ids_in, bool training,
                                       const at::Tensor& segment_ids) const {
  FT_CHECK(input_ids.dim() == 2, "input_ids must be [batch, seq], got ", input_ids.sizes());
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  at::Tensor position_ids = position_ids_in.defined()
                                ? position_ids_in
                                : at::arange(T, input_ids.options()).unsqueeze(0).expand({B, T});
  router_aux_.clear();
  if (hooks_) hooks_->before_unit(0);
  at::Tensor h = at::embedding(embed_tokens_, input_ids, config_.pad_token_id,
                               /*scale_grad_by_freq=*/false, sparse_embedding_grad_);
  if (hooks_) hooks_->after_unit(0, h);
  if (config_.embedding_scale != 1.0) {
    // Gemma multiplies by sqrt(hidden) rounded to the model dtype; Granite by the plain number.
    double scale = config_.embedding_scale;
    if (config_.embedding_scale_in_dtype)
      scale = at::scalar_tensor(scale, at::kDouble).to(h.scalar_type()).item<double>();
    h = h * scale;
  }
  const auto dtype = h.scalar_type();
  // [B, T, rotary_dim], in the compute dtype (fp32 where the family rotates in fp32).
  const auto rope_dtype = family_->rope_in_fp32 ? at::kFloat : dtype;
  const auto [cos, sin] = rope_cos_sin(position_ids, rope_dtype, false);
  at::Tensor local_cos, local_sin;
  if (config_.has_local_rope)
    std::tie(local_cos, local_sin) = rope_cos_sin(position_ids, rope_dtype, true);
  // Packed sequences: causal within each segment, nothing across segments. [B, 1, T, T], bool
  // (on the CPU 0 / -inf in the compute dtype, below). Windowed layers build their own per chunk.
  at::Tensor mask;
  if (segment_ids.defined()) {
    at::Tensor same = segment_ids.unsqueeze(2).eq(segment_ids.unsqueeze(1));
    at::Tensor causal = at::ones({T, T}, input_ids.options().dtype(at::kBool)).tril();
    mask = (same & causal).unsqueeze(1);
    // On the CPU, once for every layer, the 0 / -inf mask that the attention (ft's host kernel,
    // or at::scaled_dot_product_attention in other dtypes) would make of the boolean one in each
    // layer and keep for its backward ([B, 1, T, T] in the compute dtype: 64 MiB per layer for
    // 4096 tokens in fp32). The same bits.
    if (mask.is_cpu()) mask = attention_bias(mask, dtype);
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayer& L = layers_[i];
    const int64_t index = static_cast<int64_t>(i);
    const int unit = static_cast<int>(i) + 1;
    const bool local = config_.has_local_rope && config_.window(index) > 0;
    std::vector<at::Tensor> in = {h, local ? local_cos : cos, local ? local_sin : sin, mask,
                                  segment_ids};
    // Unit hooks stay outside the checkpointed block: a recompute must not gather or hook again.
    if (hooks_) hooks_->before_unit(unit);
    if (checkpoints_layer(index)) {
      // The recompute reads the layer's tensors through `layers_` when it runs, not copies.
      // The block runs without grad in the forward and with it in the recompute: MoE layers
      // record their routing only the first time.
      auto block = [this, index, training](const std::vector<at::Tensor>& inputs) {
        return layer_forward(index, inputs, training, !at::GradMode::is_enabled());
      };
      h = run_checkpointed(block, in, L.requires_grad());
    } else {
      h = layer_forward(index, in, training);
    }
    if (hooks_) hooks_->after_unit(unit, h);
  }
  return norm(h, norm_);
}

at::Tensor DecoderModel::forward(const at::Tensor& input_ids, const at::Tensor& position_ids,
                                 bool training, const at::Tensor& segment_ids) const {
  const at::Tensor logits =
      at::linear(hidden_states(input_ids, position_ids, training, segment_ids), lm_head());
  return logit_map().identity() ? logits : logit_map().apply(logits);
}

LossSum causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels, bool count_tokens) {
  FT_CHECK(logits.dim() == 3 && labels.dim() == 2 && logits.size(0) == labels.size(0) &&
               logits.size(1) == labels.size(1),
           "logits ", logits.sizes(), " and labels ", labels.sizes(), " do not match");
  const int64_t V = logits.size(2);
  // Shift the labels rather than the logits (as transformers does): position t predicts label t+1,
  // the last position predicts nothing. Slicing [B, T, V] logits would copy all of them.
  at::Tensor shift_labels =
      at::cat({labels.slice(1, 1), at::full({labels.size(0), 1}, -100, labels.options())}, 1)
          .reshape({-1});
  // fp32 at least (bf16/fp16 logits are upcast); fp64 stays fp64 for exact checks.
  at::Tensor shift_logits =
      logits.reshape({-1, V}).to(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  LossSum out;
  out.sum = at::cross_entropy_loss(shift_logits, shift_labels, /*weight=*/{}, at::Reduction::Sum,
                                   /*ignore_index=*/-100);
  if (count_tokens) out.tokens = shift_labels.ne(-100).sum().item<int64_t>();
  return out;
}

}  // namespace ft::model

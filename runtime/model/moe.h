// The mixture-of-experts block of Mixtral and Qwen3-MoE layers, as transformers 5.24 computes it
// (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock): router logits in the model dtype, softmax over
// all experts in fp32, the top k, renormalised (Mixtral always, Qwen3-MoE per norm_topk_prob),
// the output the weighted sum of the chosen experts' SwiGLU. Dropless: every token reaches its k
// experts. The (token, slot) rows are sorted by expert once (a stable sort) and each expert's rows
// go through one product per weight, never a one-hot dispatch over all experts.
// The load-balancing loss (transformers' load_balancing_loss_func over all MoE layers together,
// L = E * sum_e F_e P_e) is not a graph output: each forward records its layers' pick counts and
// probability sums in a RouterAux, and once the forward is complete the trainer turns them into
// the loss's value and the gradient it adds to every router probability (a constant per expert,
// E * C_e / (L N)^2 times the coefficient), which each block's probabilities receive in backward
// through an identity node. So activation checkpointing and expert parallelism need nothing
// special: a recomputed block applies the same constant. Not thread-safe (one training thread).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "model/config.h"

namespace ft::model {

// What one forward's MoE layers routed, for the aux loss and the expert-load metrics.
struct RouterAux {
  std::vector<at::Tensor> counts;     // per MoE layer in order: [E] int64, picks per expert
  std::vector<at::Tensor> prob_sums;  // per MoE layer: [E] fp32, sum over tokens of the softmax
  std::vector<at::Tensor> picks;      // per MoE layer: [N, k] int64, each token's experts
  int64_t tokens = 0;                 // tokens per layer (N)
  // Added to each layer's router probabilities' gradient in backward ([E] fp32; undefined: none).
  at::Tensor grad_row;
  void clear() { *this = RouterAux(); }
};

// The aux loss of a complete forward: its value E / (L N)^2 * sum_e C_e P_e (C_e: picks of e over
// every MoE layer, P_e: the summed probabilities), and, when `grad_scale` is not 0, `aux.grad_row`
// set to grad_scale * E * C / (L N)^2 for the backward. `counts_total`/`tokens_total` replace
// the local counts and N when the caller counts f_e over a larger batch (all data-parallel ranks).
// 0 when the forward had no MoE layer.
double router_aux_loss(RouterAux& aux, int64_t num_experts, double grad_scale,
                       const at::Tensor& counts_total = {}, int64_t tokens_total = 0);

// A LoRA adapter on one fused expert weight [E, out, in], in the layout PEFT's ParamWrapper
// (LoraConfig.target_parameters) keeps: expert e's update is scale * B_e @ A_e with
// A_e = a.reshape(E, r, in)[e] (rows grouped by expert) and B_e = b.reshape(out, r, E)[:, :, e]
// (columns grouped by rank). Every expert's adapter is held even under expert parallelism (they
// are small); a rank uses its own experts' slices.
struct ExpertLora {
  at::Tensor a;  // [E r, in]
  at::Tensor b;  // [out, r E]
  double scale = 0;
  bool defined() const { return a.defined(); }
};

// The expert weights of one MoE layer (transformers 5's names under model.layers.i.mlp.).
struct MoeWeights {
  at::Tensor router;   // gate.weight [E, hidden]
  at::Tensor gate_up;  // experts.gate_up_proj [E_local, 2 inter, hidden], rows gate then up
  at::Tensor down;     // experts.down_proj [E_local, hidden, inter]
  ExpertLora gate_up_lora, down_lora;  // undefined: no adapter (model/lora.h adds them)
  bool router_trained = false;         // a LoRA run trains the router in full (lora.train_router)
  bool defined() const { return router.defined(); }
};

// The weight with its adapter folded in, as PEFT's merge_and_unload computes it for a 3-D
// parameter: W_e + scale * B_e @ A_e for every expert. weight [E, out, in]; fp32 result.
at::Tensor merge_expert_lora(const at::Tensor& weight, const at::Tensor& a, const at::Tensor& b,
                             double scale);

// Moves the rows of the experts other ranks hold there and back (expert parallelism); the model
// itself holds every expert without one. Implemented by parallel/ (the token exchange).
class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  // The first expert this rank holds and how many.
  virtual int64_t first_local_expert() const = 0;
  virtual int64_t num_local_experts() const = 0;
  // rows [M, hidden] sorted by global expert with `counts` [E] per expert -> the rows of this
  // rank's experts from every rank, grouped by local expert, with their counts; differentiable.
  virtual at::Tensor dispatch(const at::Tensor& rows, const std::vector<int64_t>& counts,
                              std::vector<int64_t>& local_counts) = 0;
  // The inverse of the last dispatch: expert outputs back to the ranks and order they came from.
  virtual at::Tensor combine(const at::Tensor& expert_rows) = 0;
};

// A tensor of a checkpoint's per-expert layout (model/family.h: MoeStyle) as a contiguous range
// of the model's fused parameter: expert J's gate rows, up rows and down matrix, or Mixtral's
// router under its own name.
struct ExpertFilePiece {
  std::string file_name;  // e.g. model.layers.0.block_sparse_moe.experts.3.w1.weight
  int64_t offset = 0;     // first element in the fused parameter, flattened
  std::vector<int64_t> shape;
  int64_t numel() const;
};
// The pieces that make up parameter `name` in the per-expert layout; empty when the name is the
// same in both layouts (not an expert tensor, or a Qwen router).
std::vector<ExpertFilePiece> expert_file_pieces(const ModelConfig& config, const std::string& name);

class UnitHooks;  // model/unit_hooks.h

// How the local experts' products run (moe.grouped_mm): as LibTorch's grouped GEMM
// (at::_grouped_mm, one call per weight for all the experts), or one product per expert with
// rows. kAuto: the grouped GEMM on a CUDA device in bf16 when its operands fit it
// (moe.cpp: grouped_mm_misfit), the per-expert products elsewhere (on the CPU ft's expert node is
// the faster: docs/performance-log.md). kOn: the grouped GEMM wherever LibTorch has one (CPU and CUDA,
// fp32, bf16 and fp16), an ft::Error naming the key where the operands do not fit it.
enum class GroupedMm { kAuto, kOn, kOff };
GroupedMm parse_grouped_mm(const std::string& name);  // auto | on | off
// An ft::Error, before anything runs, where moe.grouped_mm=on cannot take this model's experts in
// `dtype` (its dtype or its sizes; the forward checks the rest: CUDA data alignment).
void check_grouped_mm(GroupedMm mode, at::ScalarType dtype, const ModelConfig& config);

struct MoeOptions {
  Activation activation = Activation::kSilu;
  bool fused_swiglu = true;
  // The local experts as one autograd node where it applies (moe.cpp: ExpertGroupFn); false: a
  // node per expert op, the reference moe_test compares it with bit for bit.
  bool expert_node = true;
  GroupedMm grouped_mm = GroupedMm::kAuto;
  bool weights_in_dtype = false;       // the k weights cast to x's dtype first (Qwen3-MoE's router)
  RouterAux* aux = nullptr;            // where the forward records (null: nowhere)
  bool record = true;                  // false in a recompute: recorded once already
  ExpertExchange* exchange = nullptr;  // null: every expert is local
  // The strategy's hooks (null: none): asked for the expert weights' gradient sinks
  // (UnitHooks::grad_sink), into which the expert group's backward adds their gradients.
  UnitHooks* hooks = nullptr;
};

// x [B, T, hidden] -> [B, T, hidden].
at::Tensor moe_forward(const MoeWeights& w, const MoeConfig& config, const at::Tensor& x,
                       const MoeOptions& options);

}  // namespace ft::model

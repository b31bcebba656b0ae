#include "model/moe.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <numeric>

#include "core/error.h"
#include "model/decoder.h"
#include "model/fused_ops.h"
#include "model/host_blas.h"

namespace ft::model {

namespace {

// Identity on the router probabilities [N, E] whose backward adds the aux loss's constant row
// (RouterAux::grad_row, set after the forward is complete) to every token's gradient.
struct AuxGradFn : public torch::autograd::Function<AuxGradFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& probs,
                            RouterAux* aux) {
    ctx->saved_data["aux"] = reinterpret_cast<int64_t>(aux);
    return probs.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* aux = reinterpret_cast<RouterAux*>(ctx->saved_data["aux"].toInt());
    at::Tensor g = grads[0];
    if (aux->grad_row.defined()) g = g + aux->grad_row.to(g.device()).unsqueeze(0);
    return {g, at::Tensor()};
  }
};

// One fused expert weight's per-expert matrices, and its adapter's per-expert factors for the
// local experts [first, first + local) when it has one (undefined entries when not).
struct ExpertMats {
  std::vector<at::Tensor> w, a, b;
  double scale = 0;
};

// An adapter's factors for the local experts [first, first + local) of a fused weight
// [local, out, in]: {A [local, r, in], B [local, out, r]} (views of PEFT's layout).
std::array<at::Tensor, 2> local_lora_factors(const at::Tensor& weight, const ExpertLora& lora,
                                             int64_t num_experts, int64_t first) {
  const int64_t local = weight.size(0), out = weight.size(1), in = weight.size(2);
  const int64_t r = lora.a.size(0) / num_experts;
  return {lora.a.reshape({num_experts, r, in}).narrow(0, first, local),
          lora.b.reshape({out, r, num_experts}).permute({2, 0, 1}).narrow(0, first, local)};
}

ExpertMats expert_mats(const at::Tensor& weight, const ExpertLora& lora, int64_t num_experts,
                       int64_t first) {
  ExpertMats m;
  m.w = weight.unbind(0);
  if (!lora.defined()) {
    m.a.resize(weight.size(0));
    m.b.resize(weight.size(0));
    return m;
  }
  const auto [a, b] = local_lora_factors(weight, lora, num_experts, first);
  m.a = a.unbind(0);
  m.b = b.unbind(0);
  m.scale = lora.scale;
  return m;
}

// x W_e^T, plus scale (x A_e^T) B_e^T with an adapter: PEFT's x (W_e + scale B_e A_e)^T without
// making the merged weight.
at::Tensor expert_linear(const at::Tensor& x, const ExpertMats& m, size_t e) {
  const at::Tensor y = at::linear(x, m.w[e]);
  if (!m.a[e].defined()) return y;
  return y + at::linear(at::linear(x, m.a[e]), m.b[e]) * m.scale;
}

// One expert's SwiGLU on its rows [n, hidden]: down(act(gate(x)) * up(x)), transformers'
// op sequence (or ft's fused SwiGLU, the same bits, on fp32 CPU rows).
at::Tensor expert_mlp(const at::Tensor& x, const ExpertMats& gate_up, const ExpertMats& down,
                      size_t e, const MoeOptions& o) {
  const at::Tensor y = expert_linear(x, gate_up, e);
  return expert_linear(
      gated_product_packed(y, o.activation == Activation::kGeluTanh, o.fused_swiglu), down, e);
}

// a @ b into `out` (a view: its rows of a larger tensor).
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::mm_out(out, a, b); }

// One expert's product: c = a @ b, or c += a @ b with `accumulate`; `rows` its expert's rows
// (its cost, for the order it is taken in).
struct Product {
  at::Tensor c, a, b;
  bool accumulate = false;
  int64_t rows = 0;
};
using Products = std::vector<Product>;

// f(expert, first row, rows) for every expert with rows.
template <typename F>
void for_experts(const std::vector<int64_t>& counts, F&& f) {
  int64_t at = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0) f(static_cast<int64_t>(e), at, counts[e]);
    at += counts[e];
  }
}

// Adds to `out` the product f(e, first row, rows) -> {c, a, b} of every expert with rows.
template <typename F>
void add_products(Products& out, const std::vector<int64_t>& counts, bool accumulate, F&& f) {
  for_experts(counts, [&](int64_t e, int64_t at, int64_t n) {
    std::array<at::Tensor, 3> p = f(e, at, n);
    out.push_back({std::move(p[0]), std::move(p[1]), std::move(p[2]), accumulate, n});
  });
}

// Runs independent products (no two write the same tensor). In fp32 they are spread over the
// threads, each whole on one thread (sgemm_ inside a parallel region runs on its caller's
// thread): on two cores, 32 experts of 128 rows took 13-30% less than splitting every product
// between the threads (docs/performance-log.md). The largest first, each taken by the next thread
// that is free, so that a thread slowed by its products' shapes or by the machine gets fewer
// and the threads end within about the smallest product of each other. A product's bits are the
// one-thread sgemm_'s whatever the thread count, the order or the other products (and at one
// thread those of at::mm); the products host_mm does not take (fp64, bf16, one row) go through
// at::mm_out / addmm_ after.
void run_products(const Products& products) {
  const int64_t threads = at::get_num_threads();
  std::vector<char> done(products.size(), 0);
  if (threads > 1 && products.size() > 1) {
    std::vector<size_t> order(products.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return products[a].rows > products[b].rows; });
    std::atomic<size_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (size_t k = next.fetch_add(1); k < order.size(); k = next.fetch_add(1)) {
        const Product& p = products[order[k]];
        done[order[k]] = host_mm(p.c, p.a, p.b, p.accumulate) ? 1 : 0;
      }
    });
  }
  for (size_t i = 0; i < products.size(); ++i) {
    if (done[i]) continue;
    const Product& p = products[i];
    if (p.accumulate) {
      if (!host_addmm(p.c, p.a, p.b)) p.c.addmm_(p.a, p.b);
    } else {
      mm_into(p.c, p.a, p.b);
    }
  }
}

// The local experts' SwiGLU MLPs over rows grouped by expert (`counts` each) as one node: each
// expert's products into its rows of one [rows, 2I] and one [rows, hidden] tensor, the fused
// SwiGLU over all rows at once (it works row by row), and in backward each expert's weight
// gradients into their slices of one [E, 2I, hidden] / [E, hidden, I] gradient, or of the
// strategy's accumulator when it gives sinks (the weights then come in detached): no per-expert
// views for autograd to gather, no cat, stack or zero-filled gradients, no weight-sized add.
// The products are the ones expert_mlp's nodes make, on the same operands and into contiguous
// rows, so on one thread the same bits (moe_test compares; on several, run_products); experts
// without rows add nothing. Backward runs each layer's input gradient and weight gradient
// products together (they are independent), two batches in all.
// CPU, SiLU with the fused SwiGLU, no expert adapter (expert_group_node says when).
struct ExpertGroupFn : public torch::autograd::Function<ExpertGroupFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows,
                            const at::Tensor& gate_up, const at::Tensor& down,
                            const std::vector<int64_t>* counts, UnitHooks* hooks,
                            const std::array<UnitHooks::GradSink, 2>* sinks) {
    const int64_t R = rows.size(0);
    at::Tensor gu = at::empty({R, gate_up.size(1)}, rows.options());
    at::Tensor out = at::empty({R, down.size(1)}, rows.options());
    Products first, second;
    add_products(first, *counts, false, [&](int64_t e, int64_t at, int64_t n) {
      return std::array{gu.narrow(0, at, n), rows.narrow(0, at, n), gate_up[e].t()};
    });
    run_products(first);
    const at::Tensor m = swiglu_packed_forward(gu);
    add_products(second, *counts, false, [&](int64_t e, int64_t at, int64_t n) {
      return std::array{out.narrow(0, at, n), m.narrow(0, at, n), down[e].t()};
    });
    run_products(second);
    ctx->save_for_backward({rows, gu, m, gate_up, down});
    ctx->saved_data["counts"] = c10::IValue(*counts);
    for (int i = 0; i < 2; ++i) save_grad_sink(ctx, hooks, (*sinks)[static_cast<size_t>(i)], i);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &rows = s[0], &gu = s[1], &m = s[2], &gate_up = s[3], &down = s[4];
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const at::Tensor g = grad_out[0].contiguous();
    torch::autograd::variable_list grads(6);
    // down: m's gradient and down's (autograd's MmBackward0: grad @ W, grad^T @ input).
    at::Tensor gm = at::empty_like(m);
    Products first, second;
    add_products(first, counts, false, [&](int64_t e, int64_t at, int64_t n) {
      return std::array{gm.narrow(0, at, n), g.narrow(0, at, n), down[e]};
    });
    WeightGrad down_grad = weight_grads(ctx, 1, 2, counts, down, g, m, first);
    run_products(first);
    grads[2] = down_grad.finish();
    // gate_up: the rows' gradient and gate_up's.
    const at::Tensor dgu = swiglu_packed_backward(gu, gm);
    at::Tensor grows = at::empty_like(rows);
    add_products(second, counts, false, [&](int64_t e, int64_t at, int64_t n) {
      return std::array{grows.narrow(0, at, n), dgu.narrow(0, at, n), gate_up[e]};
    });
    WeightGrad gate_up_grad = weight_grads(ctx, 0, 1, counts, gate_up, dgu, rows, second);
    run_products(second);
    grads[1] = gate_up_grad.finish();
    grads[0] = grows;
    return grads;
  }

  // A weight's gradient being made: into a sink (reported done when the products have run), or
  // a tensor for autograd, or nothing.
  struct WeightGrad {
    SavedGradSink sink;
    at::Tensor grad;
    at::Tensor finish() const {
      if (sink.into.defined()) sink.done();
      return grad;
    }
  };

  // Adds to `out` the weight's gradient products, expert e's slice grad_e^T @ input_e: added
  // into the sink of `slot`, or into a tensor when autograd wants one (experts without rows
  // zero).
  static WeightGrad weight_grads(torch::autograd::AutogradContext* ctx, int slot, size_t input,
                                 const std::vector<int64_t>& counts, const at::Tensor& weight,
                                 const at::Tensor& grad, const at::Tensor& x, Products& out) {
    WeightGrad w{saved_grad_sink(ctx, slot), {}};
    if (w.sink.into.defined()) {
      add_products(out, counts, true, [&](int64_t e, int64_t at, int64_t n) {
        return std::array{w.sink.into[e], grad.narrow(0, at, n).t(), x.narrow(0, at, n)};
      });
      return w;
    }
    if (!ctx->needs_input_grad(input)) return w;
    w.grad = at::empty_like(weight);
    for (size_t e = 0; e < counts.size(); ++e)
      if (counts[e] == 0) w.grad[static_cast<int64_t>(e)].zero_();
    add_products(out, counts, false, [&](int64_t e, int64_t at, int64_t n) {
      return std::array{w.grad[e], grad.narrow(0, at, n).t(), x.narrow(0, at, n)};
    });
    return w;
  }
};

// Whether the expert group runs as one ExpertGroupFn: on the CPU, SiLU with the fused SwiGLU,
// no expert adapter, contiguous weights; with sinks for both weights when the strategy gives
// them (`sinks` filled) and the rows need a gradient (else no backward would report them).
bool expert_group_node(const MoeWeights& w, const at::Tensor& rows, const MoeOptions& o,
                       std::array<UnitHooks::GradSink, 2>& sinks) {
  if (!o.expert_node || !rows.is_cpu() || o.activation != Activation::kSilu || !o.fused_swiglu ||
      w.gate_up_lora.defined() || w.down_lora.defined() || !w.gate_up.is_contiguous() ||
      !w.down.is_contiguous() || rows.dim() != 2)
    return false;
  if (o.hooks && at::GradMode::is_enabled() && rows.requires_grad() && w.gate_up.requires_grad() &&
      w.down.requires_grad()) {
    sinks[0] = o.hooks->grad_sink(w.gate_up);
    sinks[1] = o.hooks->grad_sink(w.down);
    if (!sinks[0].into.defined() || !sinks[1].into.defined()) sinks = {};
  }
  return true;
}

// One fused expert weight [E, out, in] as the grouped GEMM's operands for the local experts
// [first, first + local): the weight transposed ([E, in, out], a view) and, with an adapter,
// A_e^T ([E, in, r], a view) and B_e^T ([E, r, out], made contiguous: PEFT's layout interleaves
// the experts in B's columns).
struct GroupedWeight {
  at::Tensor w, a, b;
  double scale = 0;
};

GroupedWeight grouped_weight(const at::Tensor& weight, const ExpertLora& lora, int64_t num_experts,
                             int64_t first) {
  if (!lora.defined()) return {weight.transpose(1, 2), {}, {}, 0};
  const auto [a, b] = local_lora_factors(weight, lora, num_experts, first);
  return {weight.transpose(1, 2), a.transpose(1, 2), b.transpose(1, 2).contiguous(), lora.scale};
}

// x [R, in] grouped by expert (offs: each expert's end row, int32 on x's device) -> [R, out],
// each expert's rows times its weight, plus scale (x A_e^T) B_e^T with an adapter (as
// expert_linear).
at::Tensor grouped_linear(const at::Tensor& x, const GroupedWeight& g, const at::Tensor& offs) {
  const at::Tensor y = at::_grouped_mm(x, g.w, offs);
  if (!g.a.defined()) return y;
  return y + at::_grouped_mm(at::_grouped_mm(x, g.a, offs), g.b, offs) * g.scale;
}

// What keeps the grouped GEMM from taking a model's experts, "" when nothing (LibTorch 2.11's
// rules, ATen/native/GroupedMMUtils.h): fp32, bf16 or fp16, and each matrix's rows a multiple of
// 16 bytes apart, so hidden_size and moe_intermediate_size multiples of 16 bytes' elements (which
// also keeps the outputs contiguous). The adapters' rank is free: an [R, r] product comes back
// with padded rows, which the next one takes.
std::string grouped_mm_misfit(at::ScalarType dtype, int64_t hidden, int64_t inter) {
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf)
    return fmt::format("it takes fp32, bf16 or fp16, and this run computes in {}",
                       c10::toString(dtype));
  const int64_t align = 16 / static_cast<int64_t>(c10::elementSize(dtype));
  if (hidden % align != 0 || inter % align != 0)
    return fmt::format(
        "in {} it needs hidden_size and moe_intermediate_size to be multiples of {}, and they "
        "are {} and {}",
        c10::toString(dtype), align, hidden, inter);
  return "";
}

// The same for the operands of one forward, and on CUDA their data 16-byte aligned.
std::string grouped_mm_misfit(const at::Tensor& rows, const std::array<GroupedWeight, 2>& gw) {
  // gw[0].w is gate_up transposed, [E, hidden, 2 inter]; gw[1].w down's, [E, inter, hidden].
  std::string misfit = grouped_mm_misfit(rows.scalar_type(), gw[0].w.size(1), gw[1].w.size(1));
  if (misfit.empty() && rows.is_cuda())
    for (const at::Tensor* t : {&rows, &gw[0].w, &gw[0].a, &gw[1].w, &gw[1].a})
      if (t->defined() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0)
        return "it needs 16-byte aligned data, and an expert weight starts between two 16-byte "
               "boundaries in the strategy's flat buffer";
  return misfit;
}

// moe.grouped_mm=on's error.
std::string grouped_mm_refusal(const std::string& misfit) {
  return "moe.grouped_mm=on: LibTorch's grouped GEMM (at::_grouped_mm) cannot take this model's "
         "experts: " +
         misfit + "; set moe.grouped_mm=auto (one product per expert where it cannot)";
}

// Whether the local experts are to run as the grouped GEMM (MoeOptions::grouped_mm), before
// looking at the operands: never over no rows (the per-expert path's product over zero rows
// keeps the weights in the graph); auto on CUDA in bf16.
bool wants_grouped_mm(const at::Tensor& rows, const MoeOptions& o) {
  if (o.grouped_mm == GroupedMm::kOff || rows.dim() != 2 || rows.size(0) == 0) return false;
  return o.grouped_mm == GroupedMm::kOn || (rows.is_cuda() && rows.scalar_type() == at::kBFloat16);
}

// Whether the operands fit the grouped GEMM: auto runs the per-expert products where they do
// not, and says so once per process (on stderr: the run goes on, slower); on says why in an
// error naming the key.
bool fits_grouped_mm(const at::Tensor& rows, const std::array<GroupedWeight, 2>& gw,
                     const MoeOptions& o) {
  const std::string misfit = grouped_mm_misfit(rows, gw);
  FT_CHECK(misfit.empty() || o.grouped_mm != GroupedMm::kOn, grouped_mm_refusal(misfit));
  if (!misfit.empty()) {
    static std::once_flag once;
    std::call_once(once, [&] {
      fmt::print(stderr,
                 "ft: warning: moe.grouped_mm=auto: the experts run one product per expert, "
                 "not LibTorch's grouped GEMM: {} (moe.grouped_mm=off says this is meant)\n",
                 misfit);
    });
  }
  return misfit.empty();
}

// The local experts as LibTorch's grouped GEMM: rows [R, hidden] grouped by expert (`counts`
// each) -> [R, hidden], two grouped products and the gated activation between them over all
// rows; backward is at::_grouped_mm's own. On the CPU the products are LibTorch's per-group
// at::mm, so the per-expert nodes' bits (moe_test).
at::Tensor grouped_experts(const at::Tensor& rows, const std::array<GroupedWeight, 2>& gw,
                           const std::vector<int64_t>& counts, const MoeOptions& o) {
  std::vector<int32_t> ends(counts.size());
  int64_t end = 0;
  for (size_t e = 0; e < counts.size(); ++e) ends[e] = static_cast<int32_t>(end += counts[e]);
  FT_CHECK(end < std::numeric_limits<int32_t>::max(), "moe.grouped_mm: ", end,
           " rows for the local experts exceed the grouped GEMM's int32 offsets; set "
           "moe.grouped_mm=off or lower train.micro_batch");
  const at::Tensor offs = at::tensor(ends, at::kInt).to(rows.device());
  const at::Tensor y = grouped_linear(rows.contiguous(), gw[0], offs);
  return grouped_linear(
      gated_product_packed(y, o.activation == Activation::kGeluTanh, o.fused_swiglu), gw[1], offs);
}

// Rows grouped by local expert (`counts` each) through their experts, in the same order. The
// weights are unbound and the rows split once, so backward has one node per tensor gathering
// every expert's gradient; indexing each expert (gate_up[e], rows.narrow) instead gave each
// slice's gradient as a zero tensor of the whole parameter, E of them added per step (45% of a
// 32-expert step: bench/moe_block.py, docs/performance-log.md).
at::Tensor run_experts(const MoeWeights& w, const MoeConfig& config, const at::Tensor& rows,
                       const std::vector<int64_t>& counts, const MoeOptions& o) {
  const int64_t first = o.exchange ? o.exchange->first_local_expert() : 0;
  if (wants_grouped_mm(rows, o)) {
    const std::array gw{grouped_weight(w.gate_up, w.gate_up_lora, config.num_experts, first),
                        grouped_weight(w.down, w.down_lora, config.num_experts, first)};
    if (fits_grouped_mm(rows, gw, o)) return grouped_experts(rows, gw, counts, o);
  }
  const ExpertMats gate_up = expert_mats(w.gate_up, w.gate_up_lora, config.num_experts, first);
  const ExpertMats down = expert_mats(w.down, w.down_lora, config.num_experts, first);
  std::array<UnitHooks::GradSink, 2> sinks;
  if (expert_group_node(w, rows, o, sinks)) {
    const bool sunk = sinks[0].into.defined();
    return ExpertGroupFn::apply(rows.contiguous(), sunk ? w.gate_up.detach() : w.gate_up,
                                sunk ? w.down.detach() : w.down, &counts, o.hooks, &sinks);
  }
  const std::vector<at::Tensor> parts = rows.split_with_sizes(counts);
  std::vector<at::Tensor> outs;
  for (size_t e = 0; e < counts.size(); ++e)
    if (counts[e] > 0) outs.push_back(expert_mlp(parts[e], gate_up, down, e, o));
  // No rows for any local expert: a product over zero rows, so that the result depends on the
  // weights as every other rank's does (under expert parallelism combine's backward is a
  // collective, and a rank whose output needed no gradient would leave the others waiting).
  if (outs.empty()) return expert_mlp(parts.empty() ? rows : parts[0], gate_up, down, 0, o);
  return outs.size() == 1 ? outs[0] : at::cat(outs);
}

std::vector<int64_t> host_counts(const at::Tensor& picks, int64_t num_experts) {
  const at::Tensor c = at::bincount(picks, {}, num_experts).to(at::kCPU).to(at::kLong);
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

}  // namespace

GroupedMm parse_grouped_mm(const std::string& name) {
  if (name == "auto") return GroupedMm::kAuto;
  if (name == "on") return GroupedMm::kOn;
  FT_CHECK(name == "off", "moe.grouped_mm: '", name, "' is not auto, on or off");
  return GroupedMm::kOff;
}

void check_grouped_mm(GroupedMm mode, at::ScalarType dtype, const ModelConfig& config) {
  if (mode != GroupedMm::kOn || !config.moe.enabled()) return;
  const std::string misfit =
      grouped_mm_misfit(dtype, config.hidden_size, config.moe.expert_intermediate);
  FT_CHECK(misfit.empty(), grouped_mm_refusal(misfit));
}

int64_t ExpertFilePiece::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

std::vector<ExpertFilePiece> expert_file_pieces(const ModelConfig& c, const std::string& name) {
  const MoeStyle style = c.family().moe;
  const std::string mlp = ".mlp.";
  const auto at = name.find(mlp);
  if (style == MoeStyle::kNone || at == std::string::npos) return {};
  const std::string layer = name.substr(0, at + 1);  // "model.layers.i."
  const std::string rest = name.substr(at + mlp.size());
  const bool mixtral = style == MoeStyle::kMixtral;
  const std::string block = layer + (mixtral ? "block_sparse_moe." : "mlp.");
  if (rest == "gate.weight")
    return mixtral
               ? std::vector<ExpertFilePiece>{{block + rest, 0, {c.moe.num_experts, c.hidden_size}}}
               : std::vector<ExpertFilePiece>{};
  const bool gate_up = rest == "experts.gate_up_proj", down = rest == "experts.down_proj";
  if (!gate_up && !down) return {};
  const int64_t H = c.hidden_size, I = c.moe.expert_intermediate;
  const char* names[3] = {mixtral ? "w1" : "gate_proj", mixtral ? "w3" : "up_proj",
                          mixtral ? "w2" : "down_proj"};
  std::vector<ExpertFilePiece> out;
  for (int64_t e = 0; e < c.moe.num_experts; ++e) {
    const std::string expert = fmt::format("{}experts.{}.", block, e);
    if (gate_up) {
      out.push_back({expert + names[0] + ".weight", e * 2 * I * H, {I, H}});
      out.push_back({expert + names[1] + ".weight", e * 2 * I * H + I * H, {I, H}});
    } else {
      out.push_back({expert + names[2] + ".weight", e * H * I, {H, I}});
    }
  }
  return out;
}

at::Tensor merge_expert_lora(const at::Tensor& weight, const at::Tensor& a, const at::Tensor& b,
                             double scale) {
  FT_ASSERT(weight.dim() == 3 && a.dim() == 2 && b.dim() == 2, "merge_expert_lora: weight ",
            weight.sizes(), ", A ", a.sizes(), ", B ", b.sizes());
  const int64_t E = weight.size(0), out = weight.size(1), in = weight.size(2);
  const int64_t r = a.size(0) / E;
  FT_ASSERT(a.size(0) == E * r && a.size(1) == in && b.size(0) == out && b.size(1) == r * E,
            "merge_expert_lora: weight ", weight.sizes(), ", A ", a.sizes(), ", B ", b.sizes());
  at::NoGradGuard no_grad;
  const at::Tensor be = b.to(at::kFloat).reshape({out, r, E}).permute({2, 0, 1});
  const at::Tensor ae = a.to(at::kFloat).reshape({E, r, in});
  return weight.to(at::kFloat) + at::bmm(be, ae).mul_(scale);
}

double router_aux_loss(RouterAux& aux, int64_t num_experts, double grad_scale,
                       const at::Tensor& counts_total, int64_t tokens_total) {
  if (aux.counts.empty()) return 0;
  at::NoGradGuard no_grad;
  at::Tensor c = counts_total.defined() ? counts_total.to(at::kDouble)
                                        : at::stack(aux.counts).sum(0).to(at::kCPU).to(at::kDouble);
  const double layers = static_cast<double>(aux.counts.size());
  const double rows_c = layers * static_cast<double>(tokens_total ? tokens_total : aux.tokens);
  const double rows_p = layers * static_cast<double>(aux.tokens);
  const at::Tensor p = at::stack(aux.prob_sums).sum(0).to(at::kCPU).to(at::kDouble);
  const double e = static_cast<double>(num_experts);
  const double value = e * (c / rows_c * (p / rows_p)).sum().item<double>();
  if (grad_scale != 0) aux.grad_row = (c * (grad_scale * e / (rows_c * rows_p))).to(at::kFloat);
  return value;
}

at::Tensor moe_forward(const MoeWeights& w, const MoeConfig& config, const at::Tensor& x,
                       const MoeOptions& o) {
  const int64_t hidden = x.size(-1), k = config.experts_per_token, E = config.num_experts;
  const at::Tensor flat = x.reshape({-1, hidden});
  const int64_t n = flat.size(0);
  const at::Tensor logits = at::linear(flat, w.router);
  at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  if (o.aux && probs.requires_grad()) probs = AuxGradFn::apply(probs, o.aux);
  auto [top, picks] = at::topk(probs, k, -1);
  if (config.norm_topk_prob) top = top / top.sum(-1, true);
  if (o.weights_in_dtype) top = top.to(x.scalar_type());
  // (token, slot) rows sorted by expert; stable, so each expert sees its tokens in order.
  const at::Tensor flat_picks = picks.reshape({-1});
  const at::Tensor order = std::get<1>(at::sort(flat_picks, /*stable=*/true, 0, false));
  const at::Tensor token_of = at::div(order, k, "floor");
  std::vector<int64_t> counts = host_counts(flat_picks, E);
  if (o.aux && o.record) {
    at::NoGradGuard no_grad;
    o.aux->counts.push_back(at::tensor(counts, at::kLong));
    o.aux->prob_sums.push_back(probs.detach().sum(0));
    o.aux->picks.push_back(picks);
    o.aux->tokens = n;
  }
  at::Tensor rows = flat.index_select(0, token_of);
  at::Tensor out;
  if (o.exchange) {
    std::vector<int64_t> local_counts;
    const at::Tensor mine = o.exchange->dispatch(rows, counts, local_counts);
    out = o.exchange->combine(run_experts(w, config, mine, local_counts, o));
  } else {
    out = run_experts(w, config, rows, counts, o);
  }
  const at::Tensor weight = top.reshape({-1}).index_select(0, order).unsqueeze(1);
  const at::Tensor weighted = (out * weight).to(x.scalar_type());
  return at::zeros_like(flat).index_add(0, token_of, weighted).view_as(x);
}

}  // namespace ft::model

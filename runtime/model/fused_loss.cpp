#include "model/fused_loss.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/error.h"
#include "model/fused_ops.h"

namespace ft::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The summed loss of `rows` tokens, and, with `grads`, the gradients of that sum with respect to
// hidden and weight, accumulated in fp32 (fp64 for fp64 inputs).
struct ChunkResult {
  at::Tensor loss, grad_hidden, grad_weight;
};

// The family's map of the logits (in place), returning tanh(l / cap) for the chain rule when
// capped (undefined otherwise).
at::Tensor map_logits(at::Tensor& logits, const LogitMap& map) {
  if (map.divisor != 1) logits.div_(map.divisor);
  if (map.softcap <= 0) return {};
  at::Tensor t = logits.div(map.softcap).tanh_();
  logits.copy_(t).mul_(map.softcap);
  return t;
}

// d loss / d raw logits from d loss / d mapped logits `g` (in place).
void unmap_gradient(at::Tensor& g, const at::Tensor& capped, const LogitMap& map) {
  if (capped.defined()) g.mul_(capped.mul_(capped).neg_().add_(1));
  if (map.divisor != 1) g.div_(map.divisor);
}

ChunkResult run_chunks(const at::Tensor& h2, const at::Tensor& w, const at::Tensor& labels,
                       int64_t chunk_tokens, bool grad_hidden, bool grad_weight,
                       core::HostBlockCache* blocks, const LogitMap& map) {
  const bool grads = grad_hidden || grad_weight;
  const at::ScalarType acc = h2.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t N = h2.size(0);
  if (!h2.is_cpu()) blocks = nullptr;
  // Every element of these is written before it is read.
  const auto empty = [&](at::IntArrayRef sizes, at::ScalarType dtype) {
    return blocks ? blocks->empty(sizes, dtype) : at::empty(sizes, h2.options().dtype(dtype));
  };
  ChunkResult r;
  r.loss = at::zeros({}, h2.options().dtype(acc));
  // The fp32 CPU chunks' row losses come as fp64 sums (cross_entropy_rows); they are added here in
  // fp64 and rounded once at the end. Added chunk by chunk into the fp32 loss, each chunk's sum
  // had been rounded to the running total's ulp (2e-8 to 6e-8 of an evaluation's loss: issue 28).
  double host_sum = 0;
  bool on_host = false;
  if (grad_hidden) r.grad_hidden = empty(h2.sizes(), acc);
  if (grad_weight) r.grad_weight = empty(w.sizes(), acc);
  // fp32 on the CPU: one buffer for every chunk's logits. A chunk (128 MiB at the default size) is
  // above glibc's largest mmap threshold, so a fresh one per chunk would be mapped, faulted in page
  // by page (zeroed by the kernel) and unmapped again each time; the peak is the same either way.
  const bool one_buffer = acc == at::kFloat && h2.scalar_type() == at::kFloat &&
                          w.scalar_type() == at::kFloat && h2.is_cpu() &&
                          (N > chunk_tokens || blocks);
  const at::Tensor buffer =
      one_buffer ? empty({std::min(chunk_tokens, N), w.size(0)}, at::kFloat) : at::Tensor();
  for (int64_t s = 0; s < N; s += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, N - s);
    const at::Tensor h = h2.narrow(0, s, n);
    const at::Tensor y = labels.narrow(0, s, n);
    // As the unfused path: the logits in the compute dtype, upcast for the loss (in fp32 the same
    // tensor, which the gradient below then overwrites).
    at::Tensor logits;
    if (one_buffer) {
      logits = buffer.narrow(0, 0, n);
      at::mm_out(logits, h, w.t());
    } else {
      logits = at::linear(h, w).to(acc);
    }
    at::Tensor capped = map.identity() ? at::Tensor() : map_logits(logits, map);
    if (acc == at::kFloat && logits.is_cpu() && logits.is_contiguous()) {
      // fp32 on the CPU: the loss and d(sum loss)/d(logits) in three passes over each row
      // (model/fused_ops.h), in place of the logits.
      host_sum += cross_entropy_rows(logits, y, grads);
      on_host = true;
    } else {
      const at::Tensor valid = y.ne(kIgnoreIndex);
      const at::Tensor target = y.masked_fill(valid.logical_not(), 0);
      const at::Tensor lse = at::logsumexp(logits, {1});
      const at::Tensor picked = logits.gather(1, target.unsqueeze(1)).squeeze(1);
      r.loss.add_((lse - picked).masked_fill(valid.logical_not(), 0).sum());
      if (!grads) continue;
      // d(sum loss)/d(logits) = softmax - one-hot on the counted rows, 0 on the others, in place
      // of the logits.
      logits.sub_(lse.unsqueeze(1)).exp_();
      logits.scatter_add_(1, target.unsqueeze(1), at::full({n, 1}, -1.0, logits.options()));
      logits.mul_(valid.unsqueeze(1).to(acc));
    }
    if (!grads) continue;
    if (!map.identity()) unmap_gradient(logits, capped, map);
    // Cast to the compute dtype as the unfused path's upcast passes its gradient back.
    const at::Tensor& g = logits;
    const at::Tensor gc = g.to(h2.scalar_type());
    const bool same = gc.scalar_type() == acc;  // fp32 / fp64: accumulate in place
    if (grad_hidden) {
      at::Tensor rows = r.grad_hidden.narrow(0, s, n);
      if (same)
        at::mm_out(rows, gc, w);
      else
        rows.copy_(at::mm(gc, w));
    }
    if (grad_weight) {
      // The first chunk writes the accumulator (beta 0: its contents are ignored, so it needs no
      // zero-filled pass over the head's size first).
      if (same)
        r.grad_weight.addmm_(gc.t(), h, /*beta=*/s == 0 ? 0 : 1);
      else if (gc.is_cuda())
        // bf16 / fp16 on a GPU: the product accumulated into the fp32 gradient by the matrix
        // multiply itself (fp32 output, beta 1), with no compute-dtype product of the head's size
        // and no separate addition over it.
        at::addmm_out(r.grad_weight, r.grad_weight, gc.t(), h, acc, /*beta=*/s == 0 ? 0 : 1);
      else if (s == 0)
        r.grad_weight.copy_(at::mm(gc.t(), h));
      else
        r.grad_weight.add_(at::mm(gc.t(), h));
    }
  }
  if (grad_weight && N == 0) r.grad_weight.zero_();
  // Without gradients (evaluation) the sum stays fp64: nothing downstream needs it in fp32.
  if (on_host) r.loss = at::scalar_tensor(host_sum, h2.options().dtype(grads ? acc : at::kDouble));
  return r;
}

struct FusedLinearCrossEntropy : public torch::autograd::Function<FusedLinearCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h2, const at::Tensor& w,
                            const at::Tensor& labels, int64_t chunk_tokens,
                            core::HostBlockCache* blocks, UnitHooks* hooks, const LogitMap* map) {
    const bool gh = h2.requires_grad(), gw = w.requires_grad();
    ChunkResult r = run_chunks(h2, w, labels, chunk_tokens, gh, gw, blocks, *map);
    ctx->saved_data["gh"] = gh;
    ctx->saved_data["gw"] = gw;
    UnitHooks::GradSink sink;
    if (gw && hooks) sink = hooks->grad_sink(w);
    if (sink.into.defined() && sink.into.scalar_type() == r.grad_weight.scalar_type() &&
        sink.into.device() == r.grad_weight.device())
      save_grad_sink(ctx, hooks, sink);
    ctx->save_for_backward({gh ? r.grad_hidden : at::Tensor(), gw ? r.grad_weight : at::Tensor()});
    ctx->saved_data["hidden_dtype"] = static_cast<int64_t>(h2.scalar_type());
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(w.scalar_type());
    return r.loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& go = grad_out[0];
    at::Tensor gh, gw;
    // Scaled in place: the head's gradient is as large as the head (131 MB at 32k x 1024), and a
    // product of its own would be one more such buffer, mapped and faulted in every step. (A
    // second backward through this graph then fails on the saved tensors' version, loudly.)
    if (ctx->saved_data["gh"].toBool()) {
      at::Tensor t = saved[0];
      gh = t.mul_(go.to(t.scalar_type()))
               .to(static_cast<at::ScalarType>(ctx->saved_data["hidden_dtype"].toInt()));
    }
    const SavedGradSink sink = saved_grad_sink(ctx);
    if (ctx->saved_data["gw"].toBool() && sink.into.defined()) {
      // Into the strategy's accumulator: scaled and added in one pass on the host (the incoming
      // gradient is a host scalar there), else scaled in place and added.
      at::Tensor t = saved[1];
      if (sink.into.is_cpu())
        sink.into.view_as(t).add_(t, go.item<double>());
      else
        sink.into.view_as(t).add_(t.mul_(go.to(t.scalar_type())));
      sink.done();
    } else if (ctx->saved_data["gw"].toBool()) {
      at::Tensor t = saved[1];
      gw = t.mul_(go.to(t.scalar_type()))
               .to(static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt()));
    }
    return {gh, gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

LossSum chunked_lm_loss_sum(const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& labels, bool count_tokens, int64_t chunk_elements,
                            core::HostBlockCache* blocks, UnitHooks* hooks, LogitMap map) {
  FT_CHECK(hidden.dim() == 3 && labels.dim() == 2 && hidden.size(0) == labels.size(0) &&
               hidden.size(1) == labels.size(1) && weight.dim() == 2 &&
               weight.size(1) == hidden.size(2),
           "hidden ", hidden.sizes(), ", head ", weight.sizes(), " and labels ", labels.sizes(),
           " do not match");
  const int64_t V = weight.size(0);
  // The shift of causal_lm_loss_sum: position t predicts label t+1, the last predicts nothing.
  const at::Tensor shift_labels =
      at::cat({labels.slice(1, 1), at::full({labels.size(0), 1}, kIgnoreIndex, labels.options())},
              1)
          .reshape({-1});
  const at::Tensor h2 = hidden.reshape({-1, hidden.size(2)});
  const int64_t chunk_tokens = std::max<int64_t>(1, chunk_elements / std::max<int64_t>(V, 1));
  LossSum out;
  const bool grads = at::GradMode::is_enabled() && (h2.requires_grad() || weight.requires_grad());
  out.sum =
      grads ? FusedLinearCrossEntropy::apply(h2, weight, shift_labels, chunk_tokens, blocks, hooks,
                                             &map)
            : run_chunks(h2, weight, shift_labels, chunk_tokens, false, false, blocks, map).loss;
  if (count_tokens) out.tokens = shift_labels.ne(kIgnoreIndex).sum().item<int64_t>();
  return out;
}

}  // namespace ft::model

"""One MoE block's forward + backward on the CPU, in formulations of the expert products, to show
where ft's MoE step loses time and what a change in runtime/model/moe.cpp would buy (a prototype in
torch, the same ops ft's C++ calls through ATen). Each formulation takes the block's input [N, hidden],
the router [E, hidden] and transformers 5's fused expert parameters (gate_up [E, 2I, hidden], down
[E, hidden, I]), routes as ft does (fp32 softmax, top-k, renormalised, a stable sort by expert,
index_select of the rows, index_add of the weighted outputs), and differs only in how the rows go
through their experts:

  ft         ft's moe.cpp today: rows.narrow and gate_up[e] / down[e] per expert, at::linear, cat.
             Autograd's backward of gate_up[e] (SelectBackward) is a zero tensor of the whole
             [E, 2I, hidden] with expert e's slice filled, and the E of them are summed: E full-size
             zero fills and E - 1 full-size adds per weight per layer.
  unbind     the same products, the weights taken apart once with unbind(0) and the rows with
             split_with_sizes: one backward node each, which stacks / concatenates the experts'
             gradients once (a copy of the parameter's size).
  grouped_mm torch.nn.functional.grouped_mm over the rows with offsets (transformers' default on
             CPU; at::_grouped_mm in C++), its own backward.

Checks that every formulation gives the same output and gradients (within 1e-4 relative), then
prints the median forward+backward time of each at the shapes of bench/moe_step.sh:

    ~/.cache/ft/venv-torch-2.11.0/bin/python bench/moe_block.py [--threads 2] [--tokens 1024]
"""
import argparse
import time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--tokens", type=int, default=1024)
p.add_argument("--reps", type=int, default=7)
a = p.parse_args()
torch.set_num_threads(a.threads)


def route(x, router, k):
    probs = torch.softmax(x @ router.t(), -1, dtype=torch.float)
    top, picks = torch.topk(probs, k, -1)
    top = top / top.sum(-1, keepdim=True)
    flat = picks.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=router.size(0)).tolist()
    token_of = torch.div(order, k, rounding_mode="floor")
    return x.index_select(0, token_of), counts, top.reshape(-1).index_select(0, order), token_of


def swiglu(y):
    gate, up = y.chunk(2, -1)
    return F.silu(gate) * up


def experts_ft(rows, counts, gate_up, down):
    outs, at = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(F.linear(swiglu(F.linear(rows.narrow(0, at, n), gate_up[e])), down[e]))
            at += n
    return torch.cat(outs)


def experts_unbind(rows, counts, gate_up, down):
    gus, downs = gate_up.unbind(0), down.unbind(0)
    outs = [F.linear(swiglu(F.linear(r, gus[e])), downs[e])
            for e, r in enumerate(rows.split(counts)) if counts[e]]
    return torch.cat(outs)


def experts_grouped(rows, counts, gate_up, down):
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = F.grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
    return F.grouped_mm(swiglu(y), down.transpose(1, 2), offs=offs)


FORMS = {"ft": experts_ft, "unbind": experts_unbind, "grouped_mm": experts_grouped}


def block(form, x, router, gate_up, down, k):
    rows, counts, weight, token_of = route(x, router, k)
    out = FORMS[form](rows, counts, gate_up, down) * weight.unsqueeze(1)
    return torch.zeros_like(x).index_add(0, token_of, out)


def run(form, params, x, grad, k):
    for t in params:
        t.grad = None
    y = block(form, x, *params, k)
    y.backward(grad)
    return y


SHAPES = {"Mixtral-like (8 experts x 1024, top-2)": (8, 1024, 2),
          "Qwen3-MoE-like (32 experts x 256, top-4)": (32, 256, 4)}
H = 512
print(f"MoE block forward + backward, {a.tokens} tokens, hidden {H}, fp32, {a.threads} threads, "
      f"median of {a.reps} (ms)")
print("| block | " + " | ".join(FORMS) + " |")
print("|---" * (len(FORMS) + 1) + "|")
for label, (E, I, k) in SHAPES.items():
    g = torch.Generator().manual_seed(0)
    params = [(torch.randn(E, H, generator=g) * 0.5).requires_grad_(),
              (torch.randn(E, 2 * I, H, generator=g) * 0.02).requires_grad_(),
              (torch.randn(E, H, I, generator=g) * 0.02).requires_grad_()]
    x = torch.randn(a.tokens, H, generator=g).requires_grad_()
    grad = torch.randn(a.tokens, H, generator=g)
    ref = None
    for form in FORMS:
        y = run(form, params, x, grad, k)
        got = [y.detach()] + [t.grad.clone() for t in params] + [x.grad.clone()]
        x.grad = None
        if ref is None:
            ref = got
        for r, t in zip(ref, got):
            err = ((r - t).abs().max() / r.abs().max()).item()
            assert err < 1e-4, f"{form} differs from ft by {err:.1e} relative"
    times = {f: [] for f in FORMS}
    for _ in range(a.reps):
        for form in FORMS:  # interleaved: the machine's load falls on every formulation alike
            t0 = time.perf_counter()
            run(form, params, x, grad, k)
            times[form].append(time.perf_counter() - t0)
            x.grad = None
    med = {f: sorted(t)[len(t) // 2] * 1e3 for f, t in times.items()}
    print(f"| {label} | " + " | ".join(f"{med[f]:.1f}" for f in FORMS) + " |")

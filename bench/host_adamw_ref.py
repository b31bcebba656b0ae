"""The host optimizer step of the anchors (issue 32), on fp32 buffers of N parameters, for
bench/host_adamw.sh beside ft's (bench/host_adamw.cpp): torch.optim.AdamW(fused=True) and
DeepSpeed's DeepSpeedCPUAdam (PyPI deepspeed, its CPU op built on first use), each alone and with
the bf16 copy the device gets back (a separate copy_: DeepSpeed 0.19's CPU Adam no longer writes
one in its pass). One JSON line per variant: the median over the timed steps in ns per
parameter, and the bytes each variant moves per parameter (without the clip factor and the zeroing
of the gradients that ft's figures include: neither anchor does them in its pass).
    host_adamw_ref.py [--params N] [--steps S] [--warmup W] [--threads T]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--params", type=int, default=64 << 20)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
n = a.params


def median_ns(step):
    for _ in range(a.warmup):
        step()
    t = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e9 / n


def report(impl, ns, nbytes):
    print(json.dumps({"impl": impl, "ns_per_param": round(ns, 3), "bytes_per_param": nbytes,
                      "params": n, "threads": torch.get_num_threads()}), flush=True)


def fresh():
    w = torch.nn.Parameter(torch.randn(n) * 0.02)
    w.grad = torch.randn(n) * 1e-3
    return w


out = torch.empty(n, dtype=torch.bfloat16)
w = fresh()
opt = torch.optim.AdamW([w], lr=1e-4, weight_decay=0.01, fused=True)
report("torch AdamW(fused=True)", median_ns(opt.step), 28)


def torch_copy_out():
    opt.step()
    out.copy_(w.detach())


report("torch AdamW(fused=True) + bf16 copy_", median_ns(torch_copy_out), 34)


def torch_clipped():
    # What a user's loop does around it: clip_grad_norm_ scales the gradients in place (one
    # pass), zero_grad(set_to_none=True) frees them (free here: they are kept for the next step).
    torch._foreach_mul_([w.grad], 0.5)
    opt.step()


report("torch AdamW(fused=True) + the clip's scaling pass", median_ns(torch_clipped), 36)
del opt, w

try:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
except Exception as e:  # noqa: BLE001 - any import failure means the anchor is missing
    print(f"host_adamw_ref: DeepSpeedCPUAdam unavailable ({type(e).__name__}: {e}); "
          "pip install deepspeed into this venv", file=sys.stderr)
    sys.exit(3)
w = fresh()
ds = DeepSpeedCPUAdam([w], lr=1e-4, weight_decay=0.01, adamw_mode=True)
report("DeepSpeedCPUAdam", median_ns(ds.step), 28)


def ds_copy_out():
    ds.step()
    out.copy_(w.detach())


report("DeepSpeedCPUAdam + bf16 copy_", median_ns(ds_copy_out), 34)

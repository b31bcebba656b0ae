"""The host optimizer step of the anchors (issue 32), on fp32 buffers of N parameters, for
bench/host_adamw.sh beside ft's (bench/host_adamw.cpp): torch.optim.AdamW(fused=True) against
DeepSpeed's DeepSpeedCPUAdam (PyPI deepspeed, its CPU op built on first use) on the same parameter
and gradient, each alone and with the bf16 copy the device gets back (a separate copy_: DeepSpeed
0.19's CPU Adam no longer writes one in its pass).

As in host_adamw.cpp the variants are interleaved (each round runs every variant once, the order
rotated by one each round; this machine's memory speed moves by up to 2x from one minute to the
next) and each comparison is the median over the rounds of the round's own ratio. torch's fused
AdamW is the same kernel in both programs (at::_fused_adamw_), so host_adamw.sh joins ft's ratio to
torch's with torch's to DeepSpeed's. One JSON line per variant (the median over the rounds, in ns
per parameter, and the bytes it moves per parameter) and one per comparison.
    host_adamw_ref.py [--params N] [--rounds R] [--warmup W] [--threads T]
Exits with 3, after torch's rows, where DeepSpeed cannot be imported.
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
p.add_argument("--rounds", type=int, default=15)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
n = a.params


def run_rounds(variants):
    times = {name: [] for name, _, _ in variants}
    k = len(variants)
    for r in range(a.warmup + a.rounds):
        for j in range(k):
            name, _, step = variants[(j + r) % k]
            t0 = time.perf_counter()
            step()
            t = time.perf_counter() - t0
            if r >= a.warmup:
                times[name].append(t * 1e9 / n)
    return times


def report(variants, times):
    for name, nbytes, _ in variants:
        print(json.dumps({"impl": name, "ns_per_param": round(statistics.median(times[name]), 3),
                          "bytes_per_param": nbytes, "params": n,
                          "threads": torch.get_num_threads(), "rounds": len(times[name])}),
              flush=True)


def compare(times, of, to):
    r = [x / y for x, y in zip(times[of], times[to])]
    print(json.dumps({"ratio": f"{of} / {to}", "of": of, "to": to,
                      "value": round(statistics.median(r), 3), "min": round(min(r), 3),
                      "max": round(max(r), 3)}), flush=True)


w = torch.nn.Parameter(torch.randn(n) * 0.02)
w.grad = torch.randn(n) * 1e-3
out = torch.empty(n, dtype=torch.bfloat16)
opt = torch.optim.AdamW([w], lr=1e-4, weight_decay=0.01, fused=True)


def then_copy(step):
    def f():
        step()
        out.copy_(w.detach())
    return f


variants = [("torch AdamW(fused=True)", 28, opt.step),
            ("torch AdamW(fused=True) + bf16 copy_", 34, then_copy(opt.step))]
try:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
except Exception as e:  # noqa: BLE001 - any import failure means the anchor is missing
    print(f"host_adamw_ref: DeepSpeedCPUAdam unavailable ({type(e).__name__}: {e}); "
          "`make bench` installs it (FT_SETUP=bench scripts/setup.sh)", file=sys.stderr)
    times = run_rounds(variants)
    report(variants, times)
    sys.exit(3)
ds = DeepSpeedCPUAdam([w], lr=1e-4, weight_decay=0.01, adamw_mode=True)
variants += [("DeepSpeedCPUAdam", 28, ds.step),
             ("DeepSpeedCPUAdam + bf16 copy_", 34, then_copy(ds.step))]
times = run_rounds(variants)
report(variants, times)
compare(times, "torch AdamW(fused=True)", "DeepSpeedCPUAdam")
compare(times, "torch AdamW(fused=True) + bf16 copy_", "DeepSpeedCPUAdam + bf16 copy_")

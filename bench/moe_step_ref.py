"""The transformers side of bench/moe_step.sh: one fp32 training step of a mixture-of-experts model
(Mixtral or Qwen3-MoE, the model directory that ft trains too: the same weights), sdpa attention, the same pre-tokenized records as ft (a JSONL of {"input_ids": [...]}), forward with
labels (transformers adds router_aux_loss_coef x the load-balancing loss when the config's
output_router_logits is true), backward, global-norm clip 1.0, torch.optim.AdamW(fused=True), and
gradients set to none. --experts picks transformers' experts implementation (eager: its per-expert
loop over the experts that got tokens; grouped_mm: tokens sorted by expert and
torch.nn.functional.grouped_mm, transformers' default; batched_mm: each (token, expert) pair's
weights gathered and one bmm); --compile wraps the model in torch.compile. Prints one JSON line:
median and minimum step time after the warm-up steps, tokens/s, parameters, peak resident memory.
--profile N: N more steps under torch.profiler, and self CPU time per op per step on stderr."""
import argparse
import json
import resource
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--model", required=True, help="a model directory (config.json, weights)")
p.add_argument("--data", required=True, help="JSONL of {\"input_ids\": [...]}, one sequence each")
for name, default in [("batch", 2), ("steps", 10), ("warmup", 3), ("threads", 0), ("profile", 0)]:
    p.add_argument("--" + name, type=int, default=default)
p.add_argument("--experts", default="grouped_mm", choices=["eager", "grouped_mm", "batched_mm"])
p.add_argument("--compile", action="store_true")
a = p.parse_args()
# torch.compile was still compiling in the third step of a Qwen3-MoE-like model (a median of 14 s
# with 2 warm-up steps, 0.75 s with 3): its timed steps start after at least 3.
if a.compile:
    a.warmup = max(a.warmup, 3)
if a.threads > 0:
    torch.set_num_threads(a.threads)
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(a.model)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa",
                                             experts_implementation=a.experts).train()
used = model.config._experts_implementation
if used != a.experts:  # transformers falls back silently in some cases; a row must say what ran
    sys.exit(f"moe_step_ref: asked for experts_implementation={a.experts}, transformers chose {used}")
records = [torch.tensor(json.loads(line)["input_ids"]) for line in open(a.data)]
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
step_model = torch.compile(model) if a.compile else model
cursor = 0


def step():
    global cursor
    ids = torch.stack([records[(cursor + i) % len(records)] for i in range(a.batch)])
    cursor += a.batch
    t0 = time.perf_counter()
    out = step_model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, out.loss.item(), ids.numel()


times, losses, tokens = [], [], 0
for i in range(a.warmup + a.steps):
    dt, loss, tokens = step()
    losses.append(loss)
    if i >= a.warmup:
        times.append(dt)
if a.profile > 0:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.profile):
            step()
        wall = (time.perf_counter() - t0) / a.profile
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"self CPU time per step ({wall * 1e3:.1f} ms wall per profiled step):", file=sys.stderr)
    for e in rows[:30]:
        print(f"{e.self_cpu_time_total / a.profile / 1e3:9.2f} ms {e.count // a.profile:6d}  {e.key[:90]}",
              file=sys.stderr)
times.sort()
median = times[len(times) // 2]
print(json.dumps({"impl": "transformers", "experts": used, "compile": a.compile,
                  "step_time_s": {"median": round(median, 5), "min": round(times[0], 5)},
                  "tokens_per_s": round(tokens / median, 1), "tokens": tokens,
                  "first_loss": round(losses[0], 5), "last_loss": round(losses[-1], 5),
                  "aux_loss": bool(getattr(cfg, "output_router_logits", False)),
                  "threads": torch.get_num_threads(),
                  "params": sum(p.numel() for p in model.parameters()),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))

"""The plain PyTorch reference for bench/train_step.cpp: the same Llama model (Hugging Face
transformers' LlamaForCausalLM, sdpa attention), the same random-token batches and step (forward,
mean token loss, backward, global-norm clip 1.0, torch.optim.AdamW with its CPU default), the same
torch build and thread count. --variant: default (AdamW's CPU default, the foreach loop), fused
(AdamW(fused=True)), compile (torch.compile of the model + fused AdamW: the best a user writes by
hand). --config PATH: the model of that config.json (any family transformers builds with
AutoModelForCausalLM.from_config, sdpa attention), in place of the shape flags' Llama. Prints one
JSON line like the C++ benchmark. --profile N: after the timed steps, N more under
torch.profiler, and a table of self CPU time per op per step (to set beside ft's, docs/performance.md)."""
import argparse
import json
import resource
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
for name, default in [("hidden", 256), ("layers", 2), ("heads", 4), ("kv-heads", 0), ("inter", 688),
                      ("vocab", 32000), ("batch", 8), ("seq", 128), ("steps", 20), ("warmup", 3),
                      ("threads", 0)]:
    p.add_argument("--" + name, type=int, default=default)
p.add_argument("--precision", default="fp32")
p.add_argument("--config", help="a config.json, in place of the shape flags (a Llama)")
p.add_argument("--variant", default="default", choices=["default", "fused", "compile"])
p.add_argument("--profile", type=int, default=0, help="steps to profile after the timed ones")
a = p.parse_args()
if a.threads > 0:
    torch.set_num_threads(a.threads)
assert a.precision == "fp32", "the reference loop runs fp32 only"
torch.manual_seed(0)
if a.config:
    cfg = AutoConfig.from_pretrained(a.config)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
else:
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads or a.heads, max_position_embeddings=a.seq,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
model = model.float().train()
vocab = cfg.vocab_size
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                        fused=True if a.variant != "default" else None)
step_model = torch.compile(model) if a.variant == "compile" else model
gen = torch.Generator().manual_seed(1)


def step():
    ids = torch.randint(0, vocab, (a.batch, a.seq), generator=gen)
    t0 = time.perf_counter()
    loss = step_model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


times = []
for i in range(a.warmup + a.steps):
    dt = step()
    if i >= a.warmup:
        times.append(dt)
if a.profile > 0:
    import sys
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.profile):
            step()
        wall = (time.perf_counter() - t0) / a.profile
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"self CPU time per step ({wall * 1e3:.2f} ms wall per profiled step):", file=sys.stderr)
    for e in rows[:25]:
        print(f"{e.self_cpu_time_total / a.profile / 1e3:8.3f} ms {e.count // a.profile:5d}  {e.key[:90]}",
              file=sys.stderr)
times.sort()
median = times[len(times) // 2]
print(json.dumps({"impl": "pytorch", "variant": a.variant, "steps_per_s": round(1 / median, 4),
                  "step_time_s": {"median": round(median, 5), "min": round(times[0], 5)},
                  "threads": torch.get_num_threads(),
                  "params": sum(p.numel() for p in model.parameters()),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))

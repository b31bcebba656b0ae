"""The reference for bench/gpu_speed.sh: what a user would write with transformers (+ PEFT) on one GPU
for the same shapes and batches as ft. Full fine-tune: fp32 parameters under bf16 autocast (the
mixed precision of transformers' Trainer with bf16=True), sdpa attention, torch.optim.AdamW(fused=True),
global-norm clip 1.0. LoRA: bf16 base weights, PEFT adapters (fp32, PEFT's default) on every
projection, bf16 autocast, the same optimizer. Prints one JSON line: median step time, tokens/s, peak
allocated GPU memory, first loss. `--matmul-peak` prints the measured bf16 matrix-multiply rate."""
import argparse
import json
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["full", "lora"], default="full")
for name, default in [("vocab", 128256), ("hidden", 2048), ("inter", 8192), ("layers", 16),
                      ("heads", 32), ("kv-heads", 8), ("batch", 2), ("seq", 4096), ("steps", 10),
                      ("warmup", 3), ("rank", 16)]:
    p.add_argument("--" + name, type=int, default=default)
p.add_argument("--tie", type=int, default=1)
p.add_argument("--token-limit", type=int, default=1150, help="token ids drawn below this (as ft's data)")
p.add_argument("--compile", action="store_true", help="torch.compile the model")
p.add_argument("--matmul-peak", action="store_true")
p.add_argument("--profile", type=int, default=0, help="profile this many steps after the warm-up")
a = p.parse_args()

if a.matmul_peak:
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        x @ y
    end.record()
    torch.cuda.synchronize()
    s = start.elapsed_time(end) / 1000 / 20
    print(json.dumps({"matmul_bf16_tflops": round(2 * n ** 3 / s / 1e12, 1),
                      "gpu": torch.cuda.get_device_name(0)}))
    raise SystemExit

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                  num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq, rope_theta=500000.0,
                  attn_implementation="sdpa", tie_word_embeddings=bool(a.tie))
# Full: fp32 weights (autocast computes in bf16). LoRA: the base made in bf16 directly.
torch.set_default_dtype(torch.float32 if a.mode == "full" else torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
torch.set_default_dtype(torch.float32)
model.config.use_cache = False
if a.mode == "lora":
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(
        r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.05,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
model.train()
params = [q for q in model.parameters() if q.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
fwd = torch.compile(model) if a.compile else model
gen = torch.Generator(device="cuda").manual_seed(1)
times, first_loss = [], None
torch.cuda.reset_peak_memory_stats()
prof = None
for i in range(a.warmup + a.steps):
    if a.profile and i == a.warmup:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    if prof is not None and i == a.warmup + a.profile:
        prof.__exit__(None, None, None)
        import sys
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), file=sys.stderr)
        prof = None
    ids = torch.randint(0, a.token_limit, (a.batch, a.seq), generator=gen, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fwd(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if first_loss is None:
        first_loss = loss.item()
    if i >= a.warmup:
        times.append(dt)
times.sort()
median = times[len(times) // 2]
print(json.dumps({"impl": "transformers" + ("+peft" if a.mode == "lora" else "") +
                  ("+compile" if a.compile else ""),
                  "step_time_s": round(median, 5), "tokens_per_s": round(a.batch * a.seq / median, 1),
                  "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                  "first_loss": round(first_loss, 4),
                  "trained_params": sum(q.numel() for q in params),
                  "params": sum(q.numel() for q in model.parameters())}))

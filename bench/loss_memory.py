#!/usr/bin/env python3
"""Peak host memory of a training step with a large vocabulary: ft with the chunked LM head +
cross-entropy (train.fused_loss, the default), ft with the unfused path, and transformers with
fused AdamW (issue 16's memory target: at most half of transformers').

A random-init Llama with Llama 3's vocabulary (128256), hidden 256, 2 layers, one sequence of 4096
tokens per step, fp32 on the CPU, 3 optimizer steps. Each variant runs in its own process; the
figure is the process's peak resident set (VmHWM) and its growth over the resident set just before
the first step (what the step itself adds: logits, their softmax and gradients, activations).

    python bench/loss_memory.py [--ft build/bin/ft] [--threads N]
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time

VOCAB, HIDDEN, INTER, LAYERS, HEADS, SEQ = 128256, 256, 688, 2, 4, 4096


def status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def transformers_step(threads):
    """Runs in a child process: prints the peak and the growth over the pre-step RSS, bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(VOCAB, (1, SEQ))
    # The optimizer state exists after the first step: one step first, then measure the next two.
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = status_kb("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    peak = status_kb("VmHWM") * 1024
    print(json.dumps({"before": before, "peak": peak, "step_s": statistics.median(times)}))


def ft_run(ft, fused, threads, work):
    out = os.path.join(work, "fused" if fused else "unfused")
    sets = {"model.vocab_size": VOCAB, "model.hidden_size": HIDDEN,
            "model.intermediate_size": INTER, "model.num_layers": LAYERS,
            "model.num_heads": HEADS, "model.num_kv_heads": HEADS, "model.max_seq_len": SEQ,
            "model.tie_embeddings": "false", "data.seq_len": SEQ, "train.micro_batch": 1,
            "train.max_steps": 3, "precision.mode": "fp32",
            "train.fused_loss": "true" if fused else "false"}
    argv = [ft, "train", "--preset", "tiny-demo", "--output", out]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    load = json.load(open(os.path.join(out, "load.rank0.json")))
    # The peak of steps 2 and 3 (the optimizer state exists after step 1) and the resident set
    # after loading, as comparable as ft's records allow: the process peak after step 3.
    return {"peak": recs[-1]["memory"]["peak_rss_bytes"], "after_load": load["peak_rss_bytes"],
            "step_s": statistics.median(r["step_time_s"] for r in recs[1:])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ft", default="build/bin/ft")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        transformers_step(a.threads)
        return
    gib = lambda b: b / 2**30
    with tempfile.TemporaryDirectory() as work:
        rows = []
        for fused in (True, False):
            r = ft_run(os.path.abspath(a.ft), fused, a.threads, work)
            rows.append(("ft, train.fused_loss=%s" % ("true" if fused else "false"), r["peak"],
                         r["step_s"]))
        hf = json.loads(subprocess.run([sys.executable, __file__, "--child", "--threads",
                                        str(a.threads)], check=True, capture_output=True,
                                       text=True).stdout.strip().splitlines()[-1])
        rows.append(("transformers + fused AdamW", hf["peak"], hf["step_s"]))
    print(f"vocabulary {VOCAB}, {SEQ} tokens per step, hidden {HIDDEN}, {LAYERS} layers, fp32, "
          f"{a.threads} threads; peak resident set of the process:")
    print("| variant | peak RSS | against transformers | step (median of steps 2-3) |")
    print("|---|---|---|---|")
    for name, peak, step in rows:
        print(f"| {name} | {gib(peak):.2f} GiB | {peak / hf['peak']:.2f}x | {step:.2f} s |")


if __name__ == "__main__":
    main()

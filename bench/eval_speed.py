#!/usr/bin/env python3
"""ft eval against transformers' evaluation loop on the same model and records (issue 14).

A random-init Llama (hidden 512, 4 layers, vocabulary 8000; transformers' save_pretrained) and
pre-tokenized records of varied lengths (16 to 1024 tokens). transformers, same torch and threads,
fp32, no_grad: (a) one record per forward, no padding; (b) records sorted by length in batches of 8
with an attention mask (padding to the batch's longest). ft: `ft eval` (records sorted by length,
batched up to eval.batch_tokens, no padding to seq_len), wall time of the whole command (loading
included). Tokens/s counts the tokens that carry a loss; the losses must agree.

    python bench/eval_speed.py [--ft build/bin/ft] [--records 200] [--threads N]
"""
import argparse, json, os, random, subprocess, sys, tempfile, time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ft", default="build/bin/ft")
    ap.add_argument("--records", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    records = [[rng.randrange(1, 8000) for _ in range(rng.randint(16, 1024))]
               for _ in range(a.records)]
    scored = sum(len(r) - 1 for r in records)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d + "/model", safe_serialization=True)
        with open(d + "/data.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps({"input_ids": r}) + "\n")

        def loss_sum(ids, mask=None):
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            lp = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:],
                                                   reduction="none")
            if mask is not None:
                lp = lp * mask[:, 1:]
            return lp.sum().item()

        rows = []
        with torch.no_grad():
            t = time.perf_counter()
            total = sum(loss_sum(torch.tensor([r])) for r in records)
            rows.append(("transformers, 1 record per forward", time.perf_counter() - t, total / scored))
            t = time.perf_counter()
            total = 0.0
            order = sorted(records, key=len, reverse=True)
            for i in range(0, len(order), 8):
                batch = order[i:i + 8]
                T = len(batch[0])
                ids = torch.tensor([r + [0] * (T - len(r)) for r in batch])
                mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in batch])
                total += loss_sum(ids, mask)
            rows.append(("transformers, sorted batches of 8 (mask)", time.perf_counter() - t,
                         total / scored))
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        t = time.perf_counter()
        out = subprocess.run([a.ft, "eval", "--model", d + "/model", "--data", d + "/data.jsonl",
                              "--set", "data.format=tokenized", "--set", "data.seq_len=1024"],
                             capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t
        if out.returncode != 0:
            sys.exit(f"ft eval failed:\n{out.stderr}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        assert r["tokens"] == scored, (r["tokens"], scored)
        rows.append(("ft eval (whole command)", wall, r["loss"]))
    print(f"{a.records} records, {scored} scored tokens, {a.threads} threads, torch {torch.__version__}")
    print("| evaluator | seconds | tokens/s | loss |")
    print("|---|---|---|---|")
    for name, secs, loss in rows:
        print(f"| {name} | {secs:.2f} | {scored / secs:,.0f} | {loss:.6f} |")
    ref = rows[0][2]
    worst = max(abs(l - ref) / ref for _, _, l in rows)
    print(f"losses agree within {worst:.1e} relative")


if __name__ == "__main__":
    main()

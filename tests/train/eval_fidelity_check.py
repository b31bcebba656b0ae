"""`ft eval`'s loss against transformers' on a real-size config, with fp64 as the arbiter (issue 28).

SmolLM2-135M's shape (Llama: hidden 576, 9 heads, 3 key/value heads, intermediate 1536, vocabulary
49152, tied embeddings, rope_theta 100000) with 2 of its 30 layers, random init (seed 0), saved
by transformers in fp32, and pre-tokenized records of varied lengths (so ft batches them sorted
with padding). transformers scores each record in one forward in fp32 and in fp64 (the same
weights upcast: the exact answer to fp32's question within 1e-15); per-token losses are summed in
fp64. Checked:

  1. `ft eval` as it runs by default (eval.fused_kernels=false) runs transformers' op sequence:
     its loss equals transformers' fp32 loss within 1e-8 relative;
  2. `ft eval --set eval.fused_kernels=true` (train.fused_*'s CPU kernels): within 1e-7 of
     transformers' fp32 loss, and no further from the fp64 loss than 1e-7 (the fused RMSNorm sums
     its squares in another order than ATen's mean, so hidden states differ from transformers' by
     fp32 rounding, as far from fp64 as transformers' own: docs/training.md "Fidelity of ft
     eval").

Exit status: 0 pass, 1 mismatch or failure, 77 skipped (this Python lacks transformers).

    $FT_PYTHON tests/train/eval_fidelity_check.py --ft build/bin/ft [--layers 2]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

SKIP = 77
UNFUSED_RTOL = 1e-8
FUSED_RTOL = 1e-7

try:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:
    ci = os.environ.get("CI", "") not in ("", "0", "false")
    print(f"{'FAIL' if ci else 'SKIP'}: {sys.executable} cannot import {e.name or 'a module'} ({e})."
          " Install the reference libraries into it: scripts/setup.sh does (unless "
          "FT_WITH_REFERENCE=0)")
    sys.exit(1 if ci else SKIP)


def smollm2_shape(layers):
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, initializer_range=0.041666666666666664,
                       bos_token_id=1, eos_token_id=2)


def hf_loss(model, records):
    """Mean next-token loss, each record one forward, per-token losses summed in fp64."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids in records:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits
            lp = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none")
            total += lp.double().sum().item()
            tokens += len(ids) - 1
    return total / tokens, tokens


def ft_eval(ft, model_dir, data, sets):
    argv = [ft, "eval", "--model", model_dir, "--data", data, "--set", "data.format=tokenized",
            "--set", "data.seq_len=512"]
    for s in sets:
        argv += ["--set", s]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"FAIL: {' '.join(argv)} exited with {out.returncode}:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ft", required=True)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    records = [[rng.randrange(3, 49152) for _ in range(n)] for n in (160, 97, 64, 33, 130)]
    failures = []
    with tempfile.TemporaryDirectory() as d:
        model_dir = os.path.join(d, "model")
        LlamaForCausalLM(smollm2_shape(a.layers)).save_pretrained(model_dir)
        data = os.path.join(d, "records.jsonl")
        with open(data, "w") as f:
            for r in records:
                f.write(json.dumps({"input_ids": r}) + "\n")
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        l32, tokens = hf_loss(model, records)
        l64, _ = hf_loss(model.double(), records)
        unfused = ft_eval(a.ft, model_dir, data, [])
        fused = ft_eval(a.ft, model_dir, data, ["eval.fused_kernels=true"])
    print(f"{a.layers} layers, {len(records)} records, {tokens} tokens: transformers fp32 "
          f"{l32:.10f}, fp64 {l64:.10f} ({(l32 - l64) / l64:+.2e})")
    for name, r, rtol in (("unfused", unfused, UNFUSED_RTOL), ("fused", fused, FUSED_RTOL)):
        if r["tokens"] != tokens:
            failures.append(f"ft eval ({name}) scored {r['tokens']} tokens, transformers {tokens}")
        to32, to64 = (r["loss"] - l32) / l32, (r["loss"] - l64) / l64
        print(f"ft eval ({name}) {r['loss']:.10f}: {to32:+.2e} from transformers fp32, "
              f"{to64:+.2e} from fp64 (bound {rtol:.0e})")
        if abs(to32) > rtol:
            failures.append(f"ft eval ({name}) is {to32:+.2e} from transformers' fp32 loss, "
                            f"more than {rtol:.0e}")
        if abs(to64) > FUSED_RTOL:
            failures.append(f"ft eval ({name}) is {to64:+.2e} from the fp64 loss, more than "
                            f"{FUSED_RTOL:.0e}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

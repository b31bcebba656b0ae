#!/usr/bin/env python3
"""ft eval's loss against transformers' on a real-size model, with fp64 as the arbiter (issue 28).

A random-init model of SmolLM2-135M's shape (Llama: hidden 576, 30 layers, 9 heads, 3 key/value
heads, intermediate 1536, vocabulary 49152, tied embeddings, rope_theta 100000; seed 0; fp32
save_pretrained) and pre-tokenized records. transformers scores each record in one forward, in
fp32 and in fp64 (the same weights, upcast): the fp64 loss is the exact answer to within 1e-15,
so it says how far each fp32 evaluator is from it, not only from each other. Per-token losses are
summed in fp64 on the transformers side.

    python bench/eval_fidelity.py [--ft build/bin/ft] [--layers 30] [--records 8]
        [--min-len 64] [--max-len 512] [--init-range R] [--threads N] [--set k=v ...]
        [--data records.jsonl] [--model-dir DIR] [--layers-bin build/bin/ft_bench_eval_layers]

--layers-bin compares the hidden states after every layer instead (ft's from
ft_bench_eval_layers, each record alone), with --layers-arg passing its switches.
"""
import argparse, json, os, random, subprocess, sys, tempfile, time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def smollm2_config(layers, init_range):
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, initializer_range=init_range,
                       bos_token_id=1, eos_token_id=2)


def hf_losses(model, records):
    """Per-record (sum of token losses, tokens): one record per forward, no padding."""
    out = []
    with torch.no_grad():
        for ids in records:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits
            lp = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none")
            out.append((lp.double().sum().item(), len(ids) - 1))
    return out


def hf_layers(model, records):
    """Per record: transformers' hidden states (the embeddings, after each layer but the last,
    after the final norm) and the sum of token losses."""
    out = []
    with torch.no_grad():
        for ids in records:
            x = torch.tensor([ids])
            o = model(input_ids=x, output_hidden_states=True)
            lp = torch.nn.functional.cross_entropy(o.logits[0, :-1], x[0, 1:], reduction="none")
            out.append(([h.double() for h in o.hidden_states], lp.double().sum().item()))
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def compare_layers(a, model, records, d):
    """ft's forward layer by layer (ft_bench_eval_layers) against transformers' in fp32 and fp64."""
    from safetensors.torch import load_file
    data = os.path.join(d, "layers.jsonl")
    with open(data, "w") as f:
        for r in records:
            f.write(json.dumps({"input_ids": r}) + "\n")
    out = os.path.join(d, "layers.safetensors")
    argv = [a.layers_bin, "--model", a.model_dir, "--data", data, "--out", out] + a.layers_arg
    subprocess.run(argv, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)))
    ft = load_file(out)
    hf32 = hf_layers(model, records)
    hf64 = hf_layers(model.double(), records)
    L = len(hf32[0][0]) - 1
    print(f"relative RMS difference over {len(records)} records ({' '.join(a.layers_arg)}):")
    print("| after | ft32 vs hf64 | hf32 vs hf64 | ft32 vs hf32 |")
    print("|---|---|---|---|")
    for i in range(L + 1):
        name = "norm" if i == L else f"hidden.{i}"
        f = torch.cat([ft[f"{r}.{name}"].double().flatten() for r in range(len(records))])
        h32 = torch.cat([h[0][i].flatten() for h in hf32])
        h64 = torch.cat([h[0][i].flatten() for h in hf64])
        label = "final norm" if i == L else ("embedding" if i == 0 else f"layer {i - 1}")
        print(f"| {label} | {rel(f, h64):.2e} | {rel(h32, h64):.2e} | {rel(f, h32):.2e} |")
    tokens = sum(len(r) - 1 for r in records)
    l64 = sum(h[1] for h in hf64) / tokens
    l32 = sum(h[1] for h in hf32) / tokens
    print(f"loss: transformers fp32 {(l32 - l64) / l64:+.2e} from fp64 ({l64:.9f})")
    for path in ("fused", "aten"):
        l = sum(ft[f"{r}.loss_sum.{path}"].item() for r in range(len(records))) / tokens
        print(f"loss: ft {path} {(l - l64) / l64:+.2e} from fp64, {(l - l32) / l32:+.2e} from "
              f"transformers fp32")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ft", default="build/bin/ft")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--records", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--init-range", type=float, default=0.041666666666666664)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--set", action="append", default=[], help="passed to ft eval")
    ap.add_argument("--model-dir", help="keep the model here (made if absent)")
    ap.add_argument("--no-fp64", action="store_true")
    ap.add_argument("--data", help="pre-tokenized records (JSONL of input_ids) instead of random ones")
    ap.add_argument("--layers-bin", help="ft_bench_eval_layers: compare layer by layer instead")
    ap.add_argument("--layers-arg", action="append", default=[],
                    help="passed to ft_bench_eval_layers (--layers-arg=--flash --layers-arg=0)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = random.Random(0)
    records = [[rng.randrange(3, 49152) for _ in range(rng.randint(a.min_len, a.max_len))]
               for _ in range(a.records)]
    if a.data:
        with open(a.data) as f:
            records = [json.loads(line)["input_ids"] for line in f if line.strip()]
    with tempfile.TemporaryDirectory() as d:
        mdir = a.model_dir or os.path.join(d, "model")
        if not os.path.exists(os.path.join(mdir, "config.json")):
            torch.manual_seed(0)
            LlamaForCausalLM(smollm2_config(a.layers, a.init_range)).save_pretrained(mdir)
        model = LlamaForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
        if a.layers_bin:
            a.model_dir = mdir
            return compare_layers(a, model, records, d)
        data = os.path.join(d, "data.jsonl")
        with open(data, "w") as f:
            for r in records:
                f.write(json.dumps({"input_ids": r}) + "\n")
        t = time.perf_counter()
        hf32 = hf_losses(model, records)
        t32 = time.perf_counter() - t
        argv = [a.ft, "eval", "--model", mdir, "--data", data, "--set", "data.format=tokenized",
                "--set", f"data.seq_len={max(len(r) for r in records)}"]
        for s in a.set:
            argv += ["--set", s]
        t = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)))
        tft = time.perf_counter() - t
        if out.returncode != 0:
            sys.exit(f"ft eval failed:\n{out.stderr}")
        ft = json.loads(out.stdout.strip().splitlines()[-1])
        hf64 = None
        if not a.no_fp64:
            hf64 = hf_losses(model.double(), records)
    tokens = sum(n for _, n in hf32)
    assert ft["tokens"] == tokens, (ft["tokens"], tokens)
    l32 = sum(s for s, _ in hf32) / tokens
    print(f"{a.layers} layers, {len(records)} records, {tokens} scored tokens, {a.threads} threads, "
          f"torch {torch.__version__}; transformers fp32 {t32:.1f} s, ft eval {tft:.1f} s")
    print(f"transformers fp32 loss {l32:.9f}")
    print(f"ft eval loss           {ft['loss']:.9f}")
    print(f"ft vs transformers fp32: {(ft['loss'] - l32) / l32:+.2e} relative")
    if hf64:
        l64 = sum(s for s, _ in hf64) / tokens
        print(f"transformers fp64 loss {l64:.9f}")
        print(f"ft vs fp64: {(ft['loss'] - l64) / l64:+.2e}, transformers fp32 vs fp64: "
              f"{(l32 - l64) / l64:+.2e} relative")


if __name__ == "__main__":
    main()

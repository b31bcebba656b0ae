#!/usr/bin/env python3
"""Tokenizer throughput: ft's encoder (bench/tokenizer_speed.cpp) against HF tokenizers'
encode_batch, on the same lines, with 1 thread and with all cores (RAYON_NUM_THREADS for HF).

  ~/.cache/ft/venv-torch-2.11.0/bin/python bench/tokenizer_speed.py [--build build] [--mb 4]

The text is the multilingual fixture text (tests/tokenizer/fixtures/make_component_fixtures.py)
and the training corpus of make_fixtures.py, one line each, repeated to --mb megabytes. The
tokenizers: the Llama 3 fixture (regex Split + ByteLevel, ignore_merges) and the Qwen2 pipeline
of the component fixtures (NFC + regex Split + ByteLevel). Each figure is the best of --repeats (5)
passes over the whole text (the first also warms both word caches); HF is timed with encode_batch and
with encode_batch_fast (no offsets). Prints a Markdown table.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "tokenizer", "fixtures")

HF_RUN = r"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
repeats = int(sys.argv[3])
lines = open(sys.argv[2], encoding="utf-8", newline="").read().split("\n")
nbytes = sum(len(l.encode()) for l in lines)
out = {"impl": "hf", "bytes": nbytes}
# encode_batch, and encode_batch_fast (no offsets), the faster of HF's two batch calls.
for name in ["encode_batch", "encode_batch_fast"]:
    best = 1e30
    for _ in range(repeats):
        t = time.perf_counter()
        enc = getattr(tok, name)(lines, add_special_tokens=False)
        best = min(best, time.perf_counter() - t)
    out[name] = {"tokens": sum(len(e.ids) for e in enc), "seconds": best,
                 "mb_per_s": nbytes / best / 1e6}
print(json.dumps(out))
"""


def make_text(path, mb):
    sys.path.insert(0, FIXTURES)
    import make_component_fixtures as mcf
    import make_fixtures as mf
    lines = [t.replace("\n", " ") for t in mcf.TEXTS + mf.CORPUS if t.strip()]
    out = []
    size = 0
    i = 0
    while size < mb * 1e6:
        # A counter keeps lines from being byte-identical, as real documents are not.
        line = f"{lines[i % len(lines)]} {i}"
        out.append(line)
        size += len(line.encode()) + 1
        i += 1
    with open(path, "w", encoding="utf-8", newline="") as f:  # keep "\r" as it is
        f.write("\n".join(out))


def qwen2_tokenizer(path):
    with open(os.path.join(FIXTURES, "components", "bases.json"), encoding="utf-8") as f:
        bases = json.load(f)
    with open(os.path.join(FIXTURES, "components", "expected.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(l) for l in f]
    rec = next(r for r in recs if r.get("name") == "qwen2")
    spec = bases[rec["base"]]
    spec.update(rec["components"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=5, help="passes; the best one counts")
    args = ap.parse_args()
    ft_bin = os.path.join(args.build, "bin", "ft_bench_tokenizer")
    cores = os.cpu_count()
    tmp = tempfile.mkdtemp(prefix="ft_tok_bench_")
    text = os.path.join(tmp, "text.txt")
    make_text(text, args.mb)
    qwen = os.path.join(tmp, "qwen2.json")
    qwen2_tokenizer(qwen)
    tokenizers = {"llama3": os.path.join(FIXTURES, "llama3", "tokenizer.json"), "qwen2": qwen}
    import tokenizers as hf
    print(f"{os.path.getsize(text) / 1e6:.1f} MB of text, {cores} cores, "
          f"tokenizers {hf.__version__}\n")
    print("| tokenizer | threads | ft MB/s | HF encode_batch MB/s | HF encode_batch_fast MB/s | "
          "ft tokens/s | HF tokens/s (fast) | ft / HF fast |")
    print("|---|---|---|---|---|---|---|---|")
    for name, path in tokenizers.items():
        for threads in sorted({1, cores}):
            ft = json.loads(subprocess.check_output([ft_bin, path, text, str(threads),
                                                     str(args.repeats)]))
            env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
            ref = json.loads(subprocess.check_output([sys.executable, "-c", HF_RUN, path, text,
                                                      str(args.repeats)],
                                                     env=env))
            slow, fast = ref["encode_batch"], ref["encode_batch_fast"]
            if not ft["tokens"] == slow["tokens"] == fast["tokens"]:
                print(f"token counts differ for {name}: ft {ft['tokens']}, HF {slow['tokens']}",
                      file=sys.stderr)
                return 1
            print(f"| {name} | {threads} | {ft['mb_per_s']:.1f} | {slow['mb_per_s']:.1f} | "
                  f"{fast['mb_per_s']:.1f} | {ft['tokens_per_s']:,.0f} | "
                  f"{fast['tokens'] / fast['seconds']:,.0f} | "
                  f"{ft['mb_per_s'] / fast['mb_per_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

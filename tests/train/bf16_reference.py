"""Writes bf16_reference.json: what transformers (pinned 5.24.0, torch 2.11) computes in bf16 on each
model fixture of tests/model/fixtures, for train_test.cpp's check that ft's bf16 follows each family's
fp32 as transformers' does.

For every fixture with a model.safetensors: the model loaded in bfloat16 (eager attention for gemma2,
whose soft cap sdpa cannot apply, else sdpa; as make_family_fixtures.py made them), one forward and
backward on the fixture's input_ids and labels (expected.safetensors), and

  loss_bf16:           the bf16 model's loss;
  grad_rel_error_bf16: over every parameter, the largest max|g_bf16 - g_fp32| / max|g_fp32|, g_fp32
                       being the fixture's fp32 gradients (expected.safetensors).

    ~/.cache/ft/venv-torch-2.11.0/bin/python tests/train/bf16_reference.py           # write
    ~/.cache/ft/venv-torch-2.11.0/bin/python tests/train/bf16_reference.py --check   # compare
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "model", "fixtures")
OUT = os.path.join(HERE, "bf16_reference.json")


def measure(name):
    d = os.path.join(FIXTURES, name)
    ex = load_file(os.path.join(d, "expected.safetensors"))
    ids = ex["input_ids"]
    labels = ex.get("labels", ids)
    attn = "eager" if name.startswith("gemma2") else "sdpa"
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16,
                                                          attn_implementation=attn)
    loss = m(input_ids=ids, labels=labels).loss
    loss.backward()
    worst = 0.0
    for n, p in m.named_parameters():
        ref = ex["grad." + n].double()
        worst = max(worst, ((p.grad.double() - ref).abs().max() / ref.abs().max()).item())
    return {"loss_bf16": round(loss.item(), 8), "grad_rel_error_bf16": float(f"{worst:.4g}")}


def main(args):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    names = sorted(n for n in os.listdir(FIXTURES)
                   if os.path.exists(os.path.join(FIXTURES, n, "model.safetensors")))
    got = {n: measure(n) for n in names}
    got = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
           "fixtures": got}
    if "--check" in args:
        with open(OUT) as f:
            want = json.load(f)
        if want != got:
            print(json.dumps(got, indent=1))
            sys.exit(f"{OUT} differs from what this transformers computes (above)")
        print("bf16_reference.json: as committed")
        return
    with open(OUT, "w") as f:
        json.dump(got, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Hugging Face transformers and PEFT load what `ft train` writes, and compute what ft computes.

Builds a tiny Llama with transformers (save_pretrained) in a temporary directory, with the llama3
fixture tokenizer beside it, and a small text JSONL. Then:

  1. full fine-tune: `ft train --model BASE` (fp32, a few steps); transformers'
     AutoModelForCausalLM loads final/, and its mean token loss over pre-tokenized records equals
     `ft eval`'s on the same file within 1e-4 relative;
  2. LoRA: `ft train --preset tiny-lora --model BASE`; PeftModel.from_pretrained(BASE, final/)
     loads the adapter, and its loss equals `ft eval --adapter final/`'s the same way.

  3. `ft export` of each run's last checkpoint: transformers loads the exported model (also
     sharded, with its index), PEFT the exported adapter, and transformers the `--merge-lora`
     model; each gives the loss of the model `ft train` wrote, within the same tolerance.
  4. dtype="auto": a bf16 `--merge-lora` export and a bf16 run's final/ (over a base whose
     config.json transformers wrote with "dtype": "float32") load as bf16, the dtype their
     tensors have, with config.json's `dtype` and `torch_dtype` both "bfloat16".
  5. QLoRA (with bitsandbytes): a base of hidden size 64 saved quantized to NF4 by transformers +
     bitsandbytes (double quantization); ft eval of it equals transformers'; `ft train` LoRA on
     it, and on the fp32 base with lora.quantize_base=nf4 (the same adapter bytes: the same NF4
     weights); PEFT loads the adapter on the quantized model with ft eval's loss.

The untrained base is compared too, and each trained model must lower the loss by more than 10x
the tolerance, so a file that loads but is ignored fails. Exit status: 0 pass, 1 mismatch or failure, 77 skipped (this Python
lacks transformers or peft; CTest's SKIP_RETURN_CODE).

    $FT_PYTHON tests/train/interop_check.py --ft build/bin/ft [--keep DIR]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "tokenizer", "fixtures", "llama3", "tokenizer.json")
SKIP = 77
RTOL = 1e-4

try:
    import torch
    import transformers
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
except ImportError as e:
    missing = e.name or "a module"
    # CI installs them (scripts/setup.sh does by default), so there a missing one is a failure.
    ci = os.environ.get("CI", "") not in ("", "0", "false")
    print(f"{'FAIL' if ci else 'SKIP'}: {sys.executable} cannot import {missing} ({e}). Install the "
          f"reference libraries into it: scripts/setup.sh does (unless FT_WITH_REFERENCE=0)")
    sys.exit(1 if ci else SKIP)


def run(argv, log):
    """Runs argv with its output in `log`; on failure prints the log and stops the check."""
    with open(log, "w") as out:
        rc = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, "WORLD_SIZE": "1", "RANK": "0"})
    text = open(log).read()
    if rc != 0:
        print(text)
        raise SystemExit(f"FAIL: {' '.join(argv)} exited with {rc}")
    return text


def ft_eval(ft, work, model, eval_path, adapter=None):
    argv = [ft, "eval", "--model", model, "--data", eval_path, "--tokenizer", TOKENIZER,
            "--set", "data.format=tokenized", "--set", "data.seq_len=64"]
    if adapter:
        argv += ["--adapter", adapter]
    name = os.path.relpath(adapter or model, work).replace(os.sep, "-")
    text = run(argv, os.path.join(work, f"eval-{name}.log"))
    return json.loads(text.strip().splitlines()[-1])


def hf_loss(model, records):
    """Mean next-token loss over every record, each one sequence, as ft eval computes it."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids in records:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits[0, :-1], x[0, 1:], reduction="sum").item()
            tokens += len(ids) - 1
    return total / tokens, tokens


def check(what, ft_result, hf, hf_tokens, ref="ft eval"):
    rel = abs(ft_result["loss"] - hf) / abs(hf)
    ok = rel <= RTOL and ft_result["tokens"] == hf_tokens
    print(f"{'ok  ' if ok else 'FAIL'} {what}: {ref} loss {ft_result['loss']:.8f} over "
          f"{ft_result['tokens']} tokens, transformers {hf:.8f} over {hf_tokens} "
          f"(relative difference {rel:.2e}, tolerance {RTOL:.0e})")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ft", required=True, help="the ft binary")
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one)")
    args = ap.parse_args()
    print(f"transformers {transformers.__version__}, peft {__import__('peft').__version__}, "
          f"torch {torch.__version__}")
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    work = args.keep or tempfile.mkdtemp(prefix="ft_interop_")
    os.makedirs(work, exist_ok=True)
    try:
        ok = interop(os.path.abspath(args.ft), work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def interop(ft, work):
    # A tiny Llama 3 shape (GQA, tied embeddings) over the fixture tokenizer's 1150 ids.
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1152, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                         tie_word_embeddings=True)
    base = os.path.join(work, "base")
    LlamaForCausalLM(config).float().save_pretrained(base, safe_serialization=True)
    shutil.copy(TOKENIZER, os.path.join(base, "tokenizer.json"))

    train_path = os.path.join(work, "train.jsonl")
    with open(train_path, "w") as f:
        for i in range(24):
            f.write(json.dumps({"text": f"Record {i}: {i} plus {i} is {2 * i}."}) + "\n")
    # Pre-tokenized evaluation records, so ft and transformers see exactly the same ids: texts like
    # the training data (which training must visibly fit) and random ids.
    tok = Tokenizer.from_file(TOKENIZER)
    records = [tok.encode(f"Record {i}: {i} plus {i} is {2 * i}.").ids for i in (3, 11, 20)]
    gen = torch.Generator().manual_seed(5)
    records += [torch.randint(4, 1100, (int(n),), generator=gen).tolist()
                for n in torch.randint(8, 40, (3,), generator=gen)]
    eval_path = os.path.join(work, "eval.jsonl")
    with open(eval_path, "w") as f:
        for ids in records:
            f.write(json.dumps({"input_ids": ids}) + "\n")

    common = ["--model", base, "--data", train_path, "--set", "data.format=text",
              "--set", "data.template=none", "--set", "data.seq_len=64",
              "--set", "precision.mode=fp32", "--set", "train.max_steps=8",
              "--set", "train.warmup_steps=1", "--set", "train.micro_batch=2",
              "--set", "output.save_every=4"]
    full_out, lora_out = os.path.join(work, "full"), os.path.join(work, "lora")
    run([ft, "train", "--preset", "tiny-demo", "--output", full_out] + common,
        os.path.join(work, "train-full.log"))
    run([ft, "train", "--preset", "tiny-lora", "--output", lora_out, "--set", "train.lr=1e-2"]
        + common, os.path.join(work, "train-lora.log"))

    ok = True
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    base_hf, n = hf_loss(base_model, records)
    ok &= check("base model", ft_eval(ft, work, base, eval_path), base_hf, n)

    full_model = AutoModelForCausalLM.from_pretrained(
        os.path.join(full_out, "final"), dtype=torch.float32).eval()
    full_hf, n = hf_loss(full_model, records)
    ok &= check("full fine-tune (AutoModelForCausalLM)",
                ft_eval(ft, work, os.path.join(full_out, "final"), eval_path), full_hf, n)

    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        os.path.join(lora_out, "final")).eval()
    loaded = sum(1 for name, _ in peft_model.named_parameters() if "lora_" in name)
    lora_hf, n = hf_loss(peft_model, records)
    ok &= check(f"LoRA adapter (PeftModel, {loaded} adapter tensors)",
                ft_eval(ft, work, base, eval_path, adapter=os.path.join(lora_out, "final")),
                lora_hf, n)

    # ft export of the last checkpoints: what transformers and PEFT load is what ft train wrote.
    exported = os.path.join(work, "export-full")
    run([ft, "export", "--checkpoint", full_out, "--output", exported],
        os.path.join(work, "export-full.log"))
    sharded = os.path.join(work, "export-sharded")
    run([ft, "export", "--checkpoint", full_out, "--output", sharded, "--max-shard-size", "40000"],
        os.path.join(work, "export-sharded.log"))
    for what, path in (("exported full fine-tune", exported),
                       ("exported full fine-tune, sharded", sharded)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        loss, n = hf_loss(model, records)
        ok &= check(f"{what} (AutoModelForCausalLM)", ft_eval(ft, work, path, eval_path), loss, n)
        ok &= check(f"{what} against final/", {"loss": full_hf, "tokens": n}, loss, n,
                    ref="transformers on final/")
    if not os.path.exists(os.path.join(sharded, "model.safetensors.index.json")):
        print("FAIL the sharded export has no model.safetensors.index.json")
        ok = False
    if not os.path.exists(os.path.join(exported, "tokenizer.json")):
        print("FAIL the export lacks the base model's tokenizer.json")
        ok = False

    adapter = os.path.join(work, "export-adapter")
    run([ft, "export", "--checkpoint", lora_out, "--output", adapter],
        os.path.join(work, "export-adapter.log"))
    peft_export = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    loss, n = hf_loss(peft_export, records)
    ok &= check("exported LoRA adapter (PeftModel)",
                ft_eval(ft, work, base, eval_path, adapter=adapter), loss, n)
    ok &= check("exported LoRA adapter against final/", {"loss": lora_hf, "tokens": n}, loss, n,
                ref="PEFT on final/")
    merged = os.path.join(work, "export-merged")
    run([ft, "export", "--checkpoint", lora_out, "--output", merged, "--merge-lora"],
        os.path.join(work, "export-merged.log"))
    merged_model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    loss, n = hf_loss(merged_model, records)
    ok &= check("--merge-lora model (AutoModelForCausalLM)", ft_eval(ft, work, merged, eval_path),
                loss, n)
    ok &= check("--merge-lora model against the unmerged base + adapter",
                {"loss": lora_hf, "tokens": n}, loss, n, ref="PEFT on final/")

    # Training lowered the loss by far more than the tolerance: the trained files were really used.
    for what, loss in (("full fine-tune", full_hf), ("LoRA", lora_hf)):
        moved = (base_hf - loss) / base_hf
        print(f"     {what}: loss {base_hf:.6f} -> {loss:.6f} ({moved:.1e} lower)")
        if moved <= 10 * RTOL:
            print(f"FAIL {what}: loss {loss:.8f} is not 10x the tolerance below the base "
                  f"model's {base_hf:.8f}: were the trained weights loaded?")
            ok = False
    if loaded == 0:
        print("FAIL PeftModel holds no LoRA tensors")
        ok = False
    ok &= dtype_auto_interop(ft, work, base, lora_out, common)
    ok &= qlora_interop(ft, work, records, eval_path, train_path)
    print("interop: " + ("all checks passed" if ok else "FAILED") + f" ({work})")
    return ok


def dtype_auto_interop(ft, work, base, lora_out, common):
    """Step 4: what transformers loads with dtype="auto" is the dtype ft stored."""
    with open(os.path.join(base, "config.json")) as f:
        base_dtype = json.load(f).get("dtype")
    merged = os.path.join(work, "export-merged-bf16")
    run([ft, "export", "--checkpoint", lora_out, "--output", merged, "--merge-lora",
         "--dtype", "bf16"], os.path.join(work, "export-merged-bf16.log"))
    bf16_out = os.path.join(work, "full-bf16")
    run([ft, "train", "--preset", "tiny-demo", "--output", bf16_out] + common
        + ["--set", "precision.mode=bf16", "--set", "train.max_steps=2"],
        os.path.join(work, "train-full-bf16.log"))
    ok = True
    for what, path in (("--merge-lora --dtype bf16 export", merged),
                       ("bf16 run's final/", os.path.join(bf16_out, "final"))):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        good = (dtypes == ["torch.bfloat16"] and cfg.get("dtype") == "bfloat16"
                and cfg.get("torch_dtype") == "bfloat16")
        print(f"{'ok  ' if good else 'FAIL'} {what}: dtype=\"auto\" loads {', '.join(dtypes)} "
              f"(config.json dtype {cfg.get('dtype')!r}, torch_dtype {cfg.get('torch_dtype')!r}; "
              f"the base's dtype {base_dtype!r})")
        ok &= good
    return ok


def qlora_interop(ft, work, records, eval_path, train_path):
    """Step 5. The projections' last dimension is a multiple of 64: bitsandbytes 0.50.2's CPU
    dequantize kernel misplaces blocks otherwise (tests/model/fixtures/make_nf4_fixtures.py)."""
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError as e:
        ci = os.environ.get("CI", "") not in ("", "0", "false")
        print(f"{'FAIL' if ci else 'SKIP'} QLoRA: cannot import bitsandbytes ({e})")
        return not ci
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=1152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                         tie_word_embeddings=True)
    base = os.path.join(work, "qbase")
    LlamaForCausalLM(config).float().save_pretrained(base, safe_serialization=True)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)

    def quantized():
        return AutoModelForCausalLM.from_pretrained(base, quantization_config=bnb,
                                                    dtype=torch.float32, device_map="cpu").eval()

    nf4 = os.path.join(work, "qbase-nf4")
    quantized().save_pretrained(nf4)
    for d in (base, nf4):
        shutil.copy(TOKENIZER, os.path.join(d, "tokenizer.json"))
    ok = True
    nf4_model = AutoModelForCausalLM.from_pretrained(nf4, dtype=torch.float32,
                                                     device_map="cpu").eval()
    loss, n = hf_loss(nf4_model, records)
    ok &= check("NF4 base saved by bitsandbytes", ft_eval(ft, work, nf4, eval_path), loss, n)

    common = ["--data", train_path, "--set", "data.format=text", "--set", "data.template=none",
              "--set", "data.seq_len=64", "--set", "precision.mode=fp32",
              "--set", "train.max_steps=8", "--set", "train.warmup_steps=1",
              "--set", "train.micro_batch=2", "--set", "train.lr=1e-2"]
    saved_out, at_load_out = os.path.join(work, "qlora"), os.path.join(work, "qlora-at-load")
    run([ft, "train", "--preset", "tiny-lora", "--model", nf4, "--output", saved_out] + common,
        os.path.join(work, "train-qlora.log"))
    run([ft, "train", "--preset", "tiny-lora", "--model", base, "--output", at_load_out,
         "--set", "lora.quantize_base=nf4", "--set", "lora.double_quant=true"] + common,
        os.path.join(work, "train-qlora-at-load.log"))
    adapters = [open(os.path.join(d, "final", "adapter_model.safetensors"), "rb").read()
                for d in (saved_out, at_load_out)]
    same = adapters[0] == adapters[1]
    print(f"{'ok  ' if same else 'FAIL'} QLoRA adapters trained on the saved NF4 base and on the "
          f"base quantized at load are {'the same bytes' if same else 'different'}")
    ok &= same
    peft_model = PeftModel.from_pretrained(quantized(), os.path.join(saved_out, "final")).eval()
    qlora_hf, n = hf_loss(peft_model, records)
    ok &= check("QLoRA adapter (PeftModel on the bitsandbytes NF4 model)",
                ft_eval(ft, work, nf4, eval_path, adapter=os.path.join(saved_out, "final")),
                qlora_hf, n)
    moved = (loss - qlora_hf) / loss
    print(f"     QLoRA: loss {loss:.6f} -> {qlora_hf:.6f} ({moved:.1e} lower)")
    if moved <= 10 * RTOL:
        print("FAIL QLoRA: the adapter did not lower the loss: was it loaded?")
        ok = False
    return ok


if __name__ == "__main__":
    sys.exit(main())

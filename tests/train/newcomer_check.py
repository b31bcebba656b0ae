"""A new user's everyday path, end to end (issue 28): a chat model fine-tuned with LoRA on 2 ranks,
stopped by SIGTERM and resumed, then exported; the saved and exported models are served by
transformers as chat models that render exactly what training rendered.

Builds a tiny Llama with transformers in a temporary directory, with the llama3 fixture tokenizer
and a real chat template in chat_template.jinja (Llama 3.1 Instruct's, tests/template/fixtures),
and a chat JSONL. Then:

  1. `ft data show` gives the token ids transformers' apply_chat_template gives on the base model;
  2. `ft launch --nproc-per-node 2` trains LoRA under fsdp; SIGTERM after a few steps commits a
     checkpoint and exits 75; the same command resumes and finishes (no output.save_every: the only
     checkpoint is the SIGTERM one, the stale-export trap of the issue);
  3. `ft export --checkpoint RUN` takes final/ (the finished run, not the step-N checkpoint) and says
     so; `--merge-lora` merges final/'s adapter into the base; `--step N` takes the checkpoint;
  4. transformers' AutoTokenizer on final/, the exported adapter and the merged model renders the
     conversations with the same ids as training did, and the merged model loads with no missing
     or unexpected weights;
  5. the finished run given again: the same command has nothing to do; another LoRA rank, a changed
     learning rate or other data are refused with their diff (ft train and ft launch), and
     --resume-changed continues a longer run with a new learning rate; every refused command
     leaves the run directory byte for byte as it was;
  6. a run with a built-in template (data.template=llama3 over a model with its own template):
     final/ carries the built-in as chat_template.jinja, tokenizer_config.json no other template,
     and transformers renders the ids `ft data show` gives for that run's settings.

Exit status: 0 pass, 1 failure, 77 skipped (this Python lacks transformers; CTest's
SKIP_RETURN_CODE).

    $FT_PYTHON tests/train/newcomer_check.py --ft build/bin/ft [--keep DIR]
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..")
TOKENIZER = os.path.join(FIXTURES, "tokenizer", "fixtures", "llama3", "tokenizer.json")
TEMPLATE = os.path.join(FIXTURES, "template", "fixtures", "templates", "llama-3.1-instruct.jinja")
SKIP = 77

try:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers import PreTrainedTokenizerFast
except ImportError as e:
    ci = os.environ.get("CI", "") not in ("", "0", "false")
    print(f"{'FAIL' if ci else 'SKIP'}: {sys.executable} cannot import {e.name} ({e}); "
          f"scripts/setup.sh installs the reference libraries")
    sys.exit(1 if ci else SKIP)

CONVERSATIONS = [
    [{"role": "system", "content": "You count."},
     {"role": "user", "content": f"What comes after {i}?"},
     {"role": "assistant", "content": f"{i + 1} comes after {i}."},
     {"role": "user", "content": "And then?"},
     {"role": "assistant", "content": f"Then {i + 2}."}]
    for i in range(16)
]

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def run(argv, log, want=0, env=None):
    """Runs argv with its output in `log`; returns the output. A code other than `want` fails."""
    with open(log, "w") as out:
        rc = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})})
    text = open(log).read()
    if rc != want:
        print(text)
        raise SystemExit(f"FAIL: {' '.join(argv)} exited with {rc}, expected {want}")
    return text


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_base(work):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1152, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
                         tie_word_embeddings=True)
    base = os.path.join(work, "base")
    LlamaForCausalLM(config).float().save_pretrained(base, safe_serialization=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER, bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>")
    tok.save_pretrained(base)
    # The model keeps its template in its own file, as SmolLM2 and transformers 5 do.
    shutil.copy(TEMPLATE, os.path.join(base, "chat_template.jinja"))
    cfg = json.load(open(os.path.join(base, "tokenizer_config.json")))
    assert "chat_template" not in cfg, "the fixture model's template must be in its own file"
    return base


def ft_ids(ft, work, model, data, sets, name):
    """The ids of each record as `ft data show` prints them (what training trains on)."""
    argv = [ft, "data", "show", "--model", model, "--data", data, "-n", str(len(CONVERSATIONS)),
            "--no-color", "--set", "data.seq_len=256"]
    for s in sets:
        argv += ["--set", s]
    text = run(argv, os.path.join(work, f"show-{name}.log"))
    # Without colour the ids that carry the loss are bracketed: ⟦1 2 3⟧.
    rows = [line[len("ids:"):].replace("⟦", " ").replace("⟧", " ").split()
            for line in text.splitlines() if line.startswith("ids:")]
    return [[int(x) for x in row] for row in rows]


def hf_ids(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [list(tok.apply_chat_template(c, tokenize=True, add_generation_prompt=False,
                                         return_dict=False)) for c in CONVERSATIONS]


def train_preempt_resume(ft, work, base, data):
    out = os.path.join(work, "run")
    argv = [ft, "launch", "--nproc-per-node", "2", "--master-port", str(free_port()), "--", ft,
            "train", "--preset", "tiny-lora", "--model", base, "--data", data, "--output", out,
            "--set", "data.format=auto", "--set", "strategy.kind=fsdp", "--set", "data.seq_len=128",
            "--set", "train.max_steps=12", "--set", "train.warmup_steps=1"]
    log = os.path.join(work, "train-1.log")
    # Rank 0 sleeps 0.3 s a step, so that SIGTERM comes mid-run.
    env = {**os.environ, "FT_FAULT_STEP_DELAY": "0:0.3"}
    with open(log, "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 3:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    text = open(log).read()
    check(rc == 75, f"SIGTERM mid-run: the launcher exits 75 (got {rc})")
    steps = sorted(os.listdir(os.path.join(out, "checkpoints"))) if os.path.isdir(
        os.path.join(out, "checkpoints")) else []
    check(any(s.startswith("step-") for s in steps), f"SIGTERM committed a checkpoint ({steps})")
    if rc != 75:
        print(text)
    text = run(argv, os.path.join(work, "train-2.log"))
    check("from the checkpoint" in text or "resum" in text.lower(),
          "the same command resumes from the SIGTERM checkpoint")
    check(os.path.exists(os.path.join(out, "final", "adapter_config.json")), "the run finished")
    return out, [s for s in steps if s.startswith("step-")]


def snapshot(d):
    """Every file under d with its bytes: a directory equal before and after was not written."""
    out = {}
    for root, _, files in os.walk(d):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, d)] = f.read()
    return out


def rerun_finished(ft, work, base, data, out):
    """The finished run given again, unchanged and changed (issue 51), as ft launch's train
    options: each node's launcher checks before its workers start."""
    launch = [ft, "launch", "--nproc-per-node", "2", "--master-port", str(free_port()),
              "--preset", "tiny-lora", "--model", base, "--output", out,
              "--set", "data.format=auto", "--set", "strategy.kind=fsdp",
              "--set", "data.seq_len=128", "--set", "train.warmup_steps=1"]
    before = snapshot(out)
    text = run(launch + ["--data", data, "--set", "train.max_steps=12"],
               os.path.join(work, "again.log"))
    check("already finished at step 12" in text and "nothing to do" in text,
          "the same command on the finished run: already finished at step 12, exit 0")
    check(snapshot(out) == before, "... and nothing in the run directory changed")
    text = run(launch + ["--data", data, "--set", "train.max_steps=12", "--set", "lora.r=16"],
               os.path.join(work, "rank.log"), want=2)
    check("lora.r 8 -> 16" in text and "another --output" in text and "damaged" not in text,
          "another LoRA rank is refused with its diff, not taken for damage")
    half = os.path.join(work, "half.jsonl")
    with open(half, "w") as f:
        for c in CONVERSATIONS[:8]:
            f.write(json.dumps({"messages": c}) + "\n")
    text = run(launch + ["--data", half, "--set", "train.max_steps=14"],
               os.path.join(work, "data.log"), want=2)
    check("\n  data " in text and f"--data {data}" in text,
          "other data is refused, naming the --data that continues the run as it was")
    text = run(launch + ["--data", data, "--set", "train.max_steps=14", "--set", "train.lr=1e-3"],
               os.path.join(work, "launch-lr.log"), want=2)
    check("train.lr 0.002 -> 0.001" in text and "--resume-changed" in text,
          "a changed learning rate is refused before the workers start")
    # ft train alone on 1 rank: half the run's global batch of 2 ranks.
    text = run([ft, "train"] + launch[6:] + ["--data", data, "--set", "train.max_steps=12"],
               os.path.join(work, "one-rank.log"), want=2)
    check("global batch 8 x 1 x 2 = 16 -> 8 x 1 x 1 = 8" in text,
          "one rank instead of two halves the global batch and is refused")
    check(snapshot(out) == before, "every refused command left the run directory as it was")
    run(launch + ["--data", data, "--set", "train.max_steps=14", "--set", "train.lr=1e-3",
                  "--resume-changed"], os.path.join(work, "launch-forced.log"))
    events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl"))]
    changed = [e for e in events if e.get("event") == "settings_changed"]
    check(len(changed) == 1 and changed[0]["resume_changed"]
          and any(c["key"] == "train.lr" for c in changed[0]["changes"]),
          "--resume-changed continues the longer run and events.jsonl records the change")
    steps = [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))]
    check(steps == list(range(1, 15)), f"the run went on to step 14 ({steps[-3:]})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ft", required=True, help="the ft binary")
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one)")
    args = ap.parse_args()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    work = args.keep or tempfile.mkdtemp(prefix="ft_newcomer_")
    os.makedirs(work, exist_ok=True)
    try:
        newcomer(os.path.abspath(args.ft), work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(failures)} failure(s)" if failures else "all passed")
    return 1 if failures else 0


def newcomer(ft, work):
    base = make_base(work)
    data = os.path.join(work, "chat.jsonl")
    with open(data, "w") as f:
        for c in CONVERSATIONS:
            f.write(json.dumps({"messages": c}) + "\n")

    # 1. What training trains on is what transformers renders with the model's own template.
    trained = ft_ids(ft, work, base, data, [], "model-template")
    check(trained == hf_ids(base), "ft data show's ids equal apply_chat_template's on the base")

    # 2. LoRA on 2 ranks, SIGTERM, resume, finish.
    out, steps = train_preempt_resume(ft, work, base, data)

    # 3. Export takes the newest state: final/, not the SIGTERM checkpoint.
    text = run([ft, "export", "--checkpoint", out, "--output", os.path.join(work, "adapter")],
               os.path.join(work, "export-adapter.log"))
    check("final/ of the finished run (step 12)" in text,
          "ft export RUN takes final/ (step 12) and says so")
    check("step 12 of" in text, "the summary names step 12")
    text = run([ft, "export", "--checkpoint", out, "--output", os.path.join(work, "merged"),
                "--merge-lora"], os.path.join(work, "export-merged.log"))
    check("final/ of the finished run" in text and "merged model" in text,
          "--merge-lora of the run merges final/'s adapter")
    text = run([ft, "export", "--checkpoint", os.path.join(out, "final"), "--output",
                os.path.join(work, "merged-bf16"), "--merge-lora", "--dtype", "bf16"],
               os.path.join(work, "export-merged-bf16.log"))
    check("bfloat16" in text, "final/ itself exports merged in bf16")
    if steps:
        n = int(steps[-1][len("step-"):])
        text = run([ft, "export", "--checkpoint", out, "--step", str(n), "--output",
                    os.path.join(work, "older")], os.path.join(work, "export-older.log"))
        check(f"checkpoint step {n} (asked for with --step)" in text,
              f"--step {n} takes the older checkpoint")
    run([ft, "export", "--checkpoint", out, "--step", "999", "--output",
         os.path.join(work, "none")], os.path.join(work, "export-none.log"), want=2)
    check(not os.path.exists(os.path.join(work, "none")), "a --step with no checkpoint writes nothing")

    # 4. transformers serves the saved and exported models as chat models rendering what trained.
    for what in ("run/final", "adapter", "merged", "merged-bf16"):
        d = os.path.join(work, what)
        check(os.path.exists(os.path.join(d, "chat_template.jinja")),
              f"{what} carries chat_template.jinja")
        check(hf_ids(d) == trained, f"apply_chat_template on {what} gives the training ids")
    merged, info = AutoModelForCausalLM.from_pretrained(os.path.join(work, "merged"),
                                                        output_loading_info=True)
    check(not info["missing_keys"] and not info["unexpected_keys"],
          f"transformers loads the merged model whole ({info['missing_keys']}, "
          f"{info['unexpected_keys']})")

    # 5. The finished run given again (after the exports, which read it).
    rerun_finished(ft, work, base, data, out)

    # 6. A built-in template over a model with its own: the built-in is what the model carries.
    sets = ["data.template=llama3"]
    builtin_out = os.path.join(work, "builtin")
    run([ft, "train", "--preset", "tiny-lora", "--model", base, "--data", data, "--output",
         builtin_out, "--set", "data.format=auto", "--set", "data.seq_len=128",
         "--set", "train.max_steps=2"]
        + [x for s in sets for x in ("--set", s)], os.path.join(work, "train-builtin.log"))
    final = os.path.join(builtin_out, "final")
    cfg = json.load(open(os.path.join(final, "tokenizer_config.json")))
    check("chat_template" not in cfg, "final/'s tokenizer_config.json names no other template")
    builtin_ids = ft_ids(ft, work, base, data, sets, "builtin")
    check(builtin_ids != trained, "the built-in renders otherwise than the model's template")
    check(hf_ids(final) == builtin_ids,
          "apply_chat_template on final/ gives the ids the built-in template trained on")


if __name__ == "__main__":
    sys.exit(main())

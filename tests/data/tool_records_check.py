"""`ft data show` renders tool-call and ShareGPT records as transformers' apply_chat_template(tools=...).

For each real template that renders tools (Llama 3.1, Qwen2.5, Qwen3, Mistral v3; committed under
tests/template/fixtures/templates/) it makes a model directory (config.json, a fixture tokenizer,
tokenizer_config.json with the model's bos / eos, the template as chat_template.jinja), writes the
records of tests/data/fixtures/make_record_fixtures.py that the template renders (OpenAI messages
in one file, LLaMA-Factory ShareGPT in another), and runs

    ft data show --model DIR --data FILE -n N --no-color

Every record's token ids must equal tokenizer.apply_chat_template(messages, tools=tools,
tokenize=True) of the installed transformers, and its mask must follow the roles: each answer and
each tool call's name inside the trained tokens (between ⟦ and ⟧), each tool result, user and
system text outside them. A last run gives ShareGPT records without a tools column the tools of a
file (--set data.tools=FILE), which must render as transformers does with that list.

Mistral's template writes the tools before the last user message and the system message into the
last message, so a conversation with two user turns or a system message cannot be masked by
prefixes (ft refuses it by name; tests/data/records_test.cpp checks that): Mistral is given the
other records only.

Exit status: 0 pass, 1 mismatch, 77 skipped (no transformers here; a failure under CI=true).

    $FT_PYTHON tests/data/tool_records_check.py --ft build/bin/ft [--keep DIR]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
# Its import exits with 77 (skipped), or 1 under CI=true, when this Python lacks transformers.
import make_record_fixtures as fx  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

CHECKED = ["llama-3.1-instruct", "qwen2.5-instruct", "qwen3", "mistral-v3-instruct"]


def maskable(template, messages):
    """Mistral's templates rewrite earlier turns when a system message or a second user turn
    is there (see above)."""
    if not template.startswith("mistral"):
        return True
    roles = [m["role"] for m in messages]
    return "system" not in roles and roles.count("user") == 1


def model_dir(root, name):
    kind = fx.TOOL_TEMPLATES[name]
    bos, eos = fx.template_fixtures.SPECIAL_TOKENS[name]
    d = os.path.join(root, name)
    os.makedirs(d)
    tok_src = os.path.join(fx.TOKENIZERS, kind, "tokenizer.json")
    shutil.copy(tok_src, os.path.join(d, "tokenizer.json"))
    vocab = len(json.load(open(tok_src, encoding="utf-8"))["model"]["vocab"]) + 256
    LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2).save_pretrained(d)
    config = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v}
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(fx.TEMPLATES, name + ".jinja"), os.path.join(d, "chat_template.jinja"))
    return d


def ft_show(ft, model, data, n, sets=()):
    cmd = [ft, "data", "show", "--model", model, "--data", data, "-n", str(n), "--no-color",
           "--set", "data.seq_len=4096"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    # Each record: "--- FILE:LINE (format): ...\ntext: TEXT\nids:  IDS\n"
    shown = re.findall(r"^--- .*?:(\d+) \(\w+\): .*?\ntext: (.*?)\nids:  (.*?)\n", p.stdout,
                       re.S | re.M)
    if len(shown) != n:
        raise AssertionError(f"expected {n} records in ft data show's output:\n{p.stdout}")
    return [(text, [int(i) for i in ids.replace("⟦", " ").replace("⟧", " ").split()])
            for _, text, ids in shown]


def check_mask(label, text, messages):
    trained = "\x1f".join(re.findall(r"⟦(.*?)⟧", text, re.S))
    untrained = "\x1f".join(re.split(r"⟦.*?⟧", text, flags=re.S))
    problems = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant":
            if content and content not in trained:
                problems.append(f"answer {content!r} is not trained")
            for c in m.get("tool_calls") or []:
                if c["function"]["name"] not in trained:
                    problems.append(f"the call of {c['function']['name']} is not trained")
        elif content:
            # Llama 3.1 writes a tool result as JSON text (tojson of the string).
            forms = (content, json.dumps(content, ensure_ascii=False))
            if any(f in trained for f in forms):
                problems.append(f"{m['role']} text {content!r} is trained")
            if not any(f in untrained for f in forms):
                problems.append(f"{m['role']} text {content!r} is not in the rendering")
    for p in problems:
        print(f"FAIL: {label}: {p}\n  ft data show: {text}")
    return len(problems)


def check_template(ft, root, name):
    tok = fx.tokenizer_for(name)
    model = model_dir(root, name)
    failures = 0
    for fmt in ("chat", "sharegpt"):
        picked = []
        for rname, record in fx.RECORDS.items():
            f, messages, tools = fx.conversation(record)
            if f != fmt or not maskable(name, messages):
                continue
            try:
                ids = tok.apply_chat_template(messages, tools=tools, tokenize=True)
            except Exception:  # the template refuses it (jinja2 errors of several kinds)
                continue
            picked.append((rname, record, messages, ids["input_ids"] if not isinstance(ids, list) else ids))
        if not picked:
            continue
        data = os.path.join(model, fmt + ".jsonl")
        with open(data, "w", encoding="utf-8") as f:
            for _, record, _, _ in picked:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        for (rname, _, messages, want), (text, got) in zip(picked, ft_show(ft, model, data, len(picked))):
            label = f"{name} / {rname}"
            if got != list(want):
                print(f"FAIL: {label}: ft's ids differ from transformers'\n  ft:           {got}\n"
                      f"  transformers: {list(want)}")
                failures += 1
            failures += check_mask(label, text, messages)
        print(f"{name}: {len(picked)} {fmt} records as transformers renders them")
    return failures


def check_tools_file(ft, root):
    """data.tools gives ShareGPT records without a tools column the file's list."""
    name = "qwen2.5-instruct"
    tok = fx.tokenizer_for(name)
    model = os.path.join(root, name)
    tools_file = os.path.join(root, "tools.json")
    with open(tools_file, "w", encoding="utf-8") as f:
        json.dump([fx.WEATHER], f)
    record = dict(fx.RECORDS["sharegpt_function_call"])
    del record["tools"]
    data = os.path.join(root, "no_tools.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    _, messages, _ = fx.conversation(record)
    want = tok.apply_chat_template(messages, tools=[fx.WEATHER], tokenize=True)
    want = list(want["input_ids"] if not isinstance(want, list) else want)
    [(text, got)] = ft_show(ft, model, data, 1, [f"data.tools={tools_file}"])
    if got != want or "get_weather" not in text:
        print(f"FAIL: data.tools: ft's ids differ from transformers' with tools=[WEATHER]\n"
              f"  ft:           {got}\n  transformers: {want}")
        return 1
    print("data.tools: a ShareGPT record without tools rendered with the file's list")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ft", required=True, help="the ft binary")
    ap.add_argument("--keep", help="make the model directories here and keep them")
    args = ap.parse_args()
    root = args.keep or tempfile.mkdtemp(prefix="ft_tool_records_")
    os.makedirs(root, exist_ok=True)
    try:
        failures = sum(check_template(args.ft, root, name) for name in CHECKED)
        failures += check_tools_file(args.ft, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

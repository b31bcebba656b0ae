"""ft reads the files users bring as it reads JSONL: Parquet, an Arrow folder (datasets'
save_to_disk), gzip and zstd JSONL, written here by datasets and pyarrow.

1. The same records: `ft data show` of chat records (lists of structs in Parquet and Arrow) and of
   pre-tokenized records prints the same rendered text, ids and statistics for every file as for
   the JSONL (only the records' origins differ: "FILE: row 3" instead of "FILE:4").
2. The same training: `ft train --preset tiny-demo` on each (and a Parquet + gzip mixture) gives
   the same losses in metrics.jsonl as on the JSONL. The compressed files have no random access: the first run
   tokenizes them into the cache (said on stderr) and a second run reads that cache; two ranks
   under `ft launch` on a fresh copy tokenize it once between them (an flock), with the same
   losses as the JSONL under two ranks.
3. Bad files are refused with a FormatError naming the file and the row or line, never a crash:
   a truncated Parquet file, a column of the wrong type, a missing column, corrupt and truncated
   gzip, a CSV file.

Exit status: 0 pass, 1 failure, 77 skipped (this Python lacks datasets or pyarrow; a failure
under CI). Takes about 40 s on two cores (eleven short ft train runs of a tiny model).

    $FT_PYTHON tests/data/files_check.py --ft build/bin/ft
"""
import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "tokenizer", "fixtures", "llama3", "tokenizer.json")

try:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError as e:
    ci = os.environ.get("CI", "") not in ("", "0", "false")
    print(f"{'FAIL' if ci else 'SKIP'}: {sys.executable} cannot import datasets/pyarrow ({e}). "
          f"scripts/setup.sh installs them into the reference venv (unless FT_WITH_REFERENCE=0)")
    sys.exit(1 if ci else SKIP)
datasets.disable_progress_bars()


def fail(msg):
    raise SystemExit(f"FAIL: {msg}")


def run(argv, expect=0, env=None):
    p = subprocess.run(argv, capture_output=True, text=True, env=env)
    if expect is not None and p.returncode != expect:
        fail(f"{' '.join(argv)} exited with {p.returncode}, expected {expect}\n{p.stdout}\n{p.stderr}")
    return p


def chat_records():
    out = []
    for i in range(23):
        msgs = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                {"role": "assistant", "content": f"It is {2 * i}." + " Indeed." * (i % 4)}]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "Answer briefly."})
        out.append({"messages": msgs})
    return out


def token_records():
    # Below tiny-demo's vocabulary of 320; lengths vary so that packing differs by order.
    return [{"input_ids": [1 + (i * 7 + t) % 300 for t in range(5 + (i * 13) % 40)]}
            for i in range(48)]


def write_all(records, base):
    """The same records as JSONL, Parquet (datasets, and pyarrow with small row groups), an Arrow
    folder (datasets save_to_disk, two shards), a folder of two Parquet shards, gzip JSONL and
    zstd JSONL."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    files = {"jsonl": base + ".jsonl"}
    with open(files["jsonl"], "w") as f:
        f.write(text)
    ds = datasets.Dataset.from_list(records)
    files["parquet"] = base + ".parquet"
    ds.to_parquet(files["parquet"])
    files["parquet_groups"] = base + "_groups.parquet"
    pq.write_table(pa.Table.from_pylist(records), files["parquet_groups"], row_group_size=5)
    files["shards"] = base + "_shards"  # as the Hugging Face hub lays out Parquet shards
    os.makedirs(files["shards"])
    for k in range(2):
        ds.shard(2, k, contiguous=True).to_parquet(
            os.path.join(files["shards"], f"train-{k:05d}-of-00002.parquet"))
    files["arrow"] = base + "_arrow"
    ds.save_to_disk(files["arrow"], num_shards=2)
    files["gz"] = base + ".jsonl.gz"
    with gzip.open(files["gz"], "wt") as f:
        f.write(text)
    files["zst"] = base + ".jsonl.zst"
    with pa.CompressedOutputStream(files["zst"], "zstd") as f:
        f.write(text.encode())
    return files


def normalized_show(ft, path, extra):
    """`ft data show` of every record, with the file's name and the records' origins taken out."""
    p = run([ft, "data", "show", "--data", path, "-n", "100", "--no-color"] + extra)
    out = p.stdout.replace(path, "DATA")
    out = re.sub(r"^--- DATA(/train-\d+-of-\d+\.parquet)?(:\d+|: row \d+) ", "--- RECORD ", out,
                 flags=re.M)
    return out


def check_same_records(ft, files, extra, what):
    want = normalized_show(ft, files["jsonl"], extra)
    if want.count("--- RECORD") < 20:
        fail(f"{what}: ft data show printed too few records:\n{want}")
    for kind, path in files.items():
        got = normalized_show(ft, path, extra)
        if got != want:
            fail(f"{what}: ft data show of {kind} ({path}) differs from the JSONL's:\n"
                 f"--- JSONL:\n{want}\n--- {kind}:\n{got}")
    print(f"ok: {what}: ft data show gives the same records and statistics for {sorted(files)}")


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


TRAIN_SETS = ["data.format=auto", "train.max_steps=3", "data.seq_len=64", "train.micro_batch=2"]


def train(ft, data, out):
    """ft train on `data`: a path, or a list of --data values (a mixture)."""
    argv = [ft, "train", "--preset", "tiny-demo", "--output", out]
    for d in [data] if isinstance(data, str) else data:
        argv += ["--data", d]
    for kv in TRAIN_SETS:
        argv += ["--set", kv]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    return run(argv, env=env)


def launch(ft, data, out):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [ft, "launch", "--nproc-per-node", "2", "--master-port", str(port), "--", ft, "train",
            "--preset", "tiny-demo", "--data", data, "--output", out]
    for kv in TRAIN_SETS:
        argv += ["--set", kv]
    return run(argv)


def check_same_training(ft, files, tmp):
    train(ft, files["jsonl"], os.path.join(tmp, "run_jsonl"))
    want = losses(os.path.join(tmp, "run_jsonl"))
    if len(want) != 3:
        fail(f"the JSONL run wrote {len(want)} steps, expected 3")
    for kind, path in files.items():
        if kind == "jsonl":
            continue
        out = os.path.join(tmp, "run_" + kind)
        p = train(ft, path, out)
        tokenized = "tokenizing" in p.stderr
        if tokenized != (kind in ("gz", "zst")):
            fail(f"{kind}: the run {'tokenized' if tokenized else 'did not tokenize'} the data into "
                 f"the cache first (only compressed files should):\n{p.stderr}")
        losses_of = losses(out)
        if losses_of != want:
            fail(f"{kind}: losses {losses_of} differ from the JSONL's {want}")
        if kind in ("gz", "zst"):
            again = train(ft, path, out + "_again")
            if "tokenizing" in again.stderr or "tokenized cache" not in again.stderr:
                fail(f"{kind}: a second run did not read the cache the first one made:\n"
                     f"{again.stderr}")
            if losses(out + "_again") != want:
                fail(f"{kind}: the run from the cache has other losses than the JSONL's")
    print(f"ok: ft train on every file gives the JSONL's losses {want}")

    # Two ranks on a fresh copy of the zstd file: tokenized once (the flock), same losses.
    launch(ft, files["jsonl"], os.path.join(tmp, "launch_jsonl"))
    fresh = os.path.join(tmp, "fresh.jsonl.zst")
    shutil.copy(files["zst"], fresh)
    p = launch(ft, fresh, os.path.join(tmp, "launch_zst"))
    said = (p.stdout + p.stderr).count("tokenizing " + fresh)
    if said != 1:
        fail(f"two ranks said 'tokenizing' {said} times, expected once:\n{p.stdout}\n{p.stderr}")
    two = losses(os.path.join(tmp, "launch_jsonl"))
    if losses(os.path.join(tmp, "launch_zst")) != two:
        fail("two ranks on zstd JSONL give other losses than on the JSONL")
    print("ok: two ranks tokenize a zstd file once between them, with the JSONL's losses")

    # A 70/30 mixture of a Parquet and a gzip file draws and trains as the same mixture of two
    # JSONL files holding their records (the draws depend on the seed and the weights alone).
    copy = os.path.join(tmp, "copy.jsonl")
    shutil.copy(files["jsonl"], copy)
    train(ft, [files["jsonl"] + ":0.7", copy + ":0.3"], os.path.join(tmp, "mix_jsonl"))
    train(ft, [files["parquet"] + ":0.7", files["gz"] + ":0.3"], os.path.join(tmp, "mix_files"))
    want = losses(os.path.join(tmp, "mix_jsonl"))
    if len(want) != 3 or losses(os.path.join(tmp, "mix_files")) != want:
        fail(f"a Parquet + gzip mixture gives losses {losses(os.path.join(tmp, 'mix_files'))}, "
             f"the JSONL mixture {want}")
    print("ok: a 70/30 mixture of a Parquet and a gzip file trains as its JSONL mixture")


def check_bad_files(ft, files, tmp):
    tok = ["--tokenizer", TOKENIZER, "--set", "model.vocab_size=128256"]

    def refused(path, *needles, extra=()):
        p = run([ft, "data", "show", "--data", path, "-n", "1", "--no-color"] + list(extra),
                expect=None)
        if p.returncode != 2:
            fail(f"ft data show --data {path} exited with {p.returncode}, expected 2 (a clear "
                 f"refusal):\n{p.stdout}\n{p.stderr}")
        for n in needles:
            if n not in p.stderr:
                fail(f"ft data show --data {path}: the error does not say '{n}':\n{p.stderr}")
        print(f"ok: refused: {p.stderr.strip().splitlines()[-1][:160]}")

    data = open(files["parquet"], "rb").read()
    cut = os.path.join(tmp, "cut.parquet")
    open(cut, "wb").write(data[: len(data) // 2])
    refused(cut, cut)

    wrong = os.path.join(tmp, "wrong.parquet")
    pq.write_table(pa.table({"text": [1, 2, 3]}), wrong)
    refused(wrong, wrong + ": row 0", "text", extra=tok)

    wrong_ids = os.path.join(tmp, "wrong_ids.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2], None]}), wrong_ids)  # a null: absent
    refused(wrong_ids, wrong_ids + ": row 1", "input_ids")

    missing = os.path.join(tmp, "missing.parquet")
    pq.write_table(pa.table({"content": ["hello", "world"]}), missing)
    refused(missing, missing + ": row 0", extra=tok)

    binary = os.path.join(tmp, "binary.parquet")
    pq.write_table(pa.table({"text": pa.array([b"\x00\x01"], pa.binary())}), binary)
    refused(binary, binary + ": row 0", "column 'text'", extra=tok)

    raw = open(files["gz"], "rb").read()
    corrupt = os.path.join(tmp, "corrupt.jsonl.gz")
    open(corrupt, "wb").write(raw[:20] + bytes(b ^ 0x5A for b in raw[20:60]) + raw[60:])
    refused(corrupt, corrupt, "gzip")
    short = os.path.join(tmp, "short.jsonl.gz")
    open(short, "wb").write(raw[: len(raw) - 30])
    refused(short, short, "ends early")

    csv = os.path.join(tmp, "train.csv")
    open(csv, "w").write("text\nhello\n")
    refused(csv, csv, "Parquet", ".jsonl.gz")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ft", required=True)
    args = ap.parse_args()
    ft = os.path.abspath(args.ft)
    tmp = tempfile.mkdtemp(prefix="ft-files-")
    try:
        chat = write_all(chat_records(), os.path.join(tmp, "chat"))
        check_same_records(ft, chat, ["--tokenizer", TOKENIZER, "--set", "model.vocab_size=128256",
                                      "--set", "data.template=llama3"], "chat records")
        tokens = write_all(token_records(), os.path.join(tmp, "ids"))
        check_same_records(ft, tokens, ["--preset", "tiny-demo", "--set", "data.format=auto"],
                           "pre-tokenized records")
        check_same_training(ft, tokens, tmp)
        check_bad_files(ft, tokens, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("PASS")


if __name__ == "__main__":
    main()

"""TensorBoard's own reader loads the event files `ft train` writes with output.tensorboard=true
and finds the same scalars as metrics.jsonl.

Runs `ft train --preset tiny-demo` for a few steps with output.tensorboard=true, then reads
<output>/tensorboard/ with tensorboard.backend.event_processing.event_accumulator.EventAccumulator
and compares every step's loss, lr, grad_norm, tokens_per_s, mfu and step_time_s with
metrics.jsonl (TensorBoard keeps simple_value as a 32-bit float: within 1e-6 relative). Then a
run killed with SIGKILL after its step-3 checkpoint and resumed: its two event files read as each
step once (the resumed process's session start purges the steps it redid). Exit
status: 0 pass, 1 mismatch or failure, 77 skipped (this Python lacks tensorboard; under CI a
missing library is a failure).

    $FT_PYTHON tests/report/tensorboard_check.py --ft build/bin/ft
"""
import argparse
import json
import os
import subprocess
import sys
import signal
import tempfile
import time

SKIP = 77
STEPS = 7
KEYS = ["loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s"]

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:
    ci = os.environ.get("CI", "") not in ("", "0", "false")
    print(f"{'FAIL' if ci else 'SKIP'}: {sys.executable} cannot import tensorboard ({e}). "
          f"scripts/setup.sh installs it into the reference venv (unless FT_WITH_REFERENCE=0)")
    sys.exit(1 if ci else SKIP)


def train(ft, out, steps, sets=(), env_extra=None, background=False):
    argv = [ft, "train", "--preset", "tiny-demo", "--output", out,
            "--set", f"train.max_steps={steps}", "--set", "output.tensorboard=true"]
    for kv in sets:
        argv += ["--set", kv]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(env_extra or {})
    if background:
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout, p.stderr)
        raise SystemExit(f"FAIL: {' '.join(argv)} exited with {p.returncode}")
    return p


def compare(out, steps, files_expected):
    """TensorBoard's scalars of `out` against its metrics.jsonl: each step once, equal values."""
    tb_dir = os.path.join(out, "tensorboard")
    files = [f for f in os.listdir(tb_dir) if f.startswith("events.out.tfevents.")]
    if len(files) != files_expected:
        raise SystemExit(f"FAIL: expected {files_expected} events.out.tfevents.* file(s) in "
                         f"{tb_dir}, got {files}")
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    if len(metrics) != steps:
        raise SystemExit(f"FAIL: metrics.jsonl has {len(metrics)} records, expected {steps}")
    checked = 0
    for key in KEYS:
        if key not in tags:
            raise SystemExit(f"FAIL: TensorBoard finds no scalar '{key}' (tags: {sorted(tags)})")
        events = acc.Scalars(key)
        got = {e.step: e.value for e in events}
        if len(events) != steps or sorted(got) != [m["step"] for m in metrics]:
            raise SystemExit(f"FAIL: '{key}': steps {[e.step for e in events]} in TensorBoard, "
                             f"{[m['step'] for m in metrics]} in metrics.jsonl")
        for m in metrics:
            want, have = float(m[key]), got[m["step"]]
            if abs(have - want) > 1e-6 * max(abs(want), 1e-30):
                raise SystemExit(f"FAIL: '{key}' at step {m['step']}: TensorBoard reads {have!r}, "
                                 f"metrics.jsonl has {want!r}")
            checked += 1
    if acc.file_version != 2:
        raise SystemExit(f"FAIL: TensorBoard read file_version {acc.file_version}, expected 2")
    if "memory/peak_rss_bytes" not in tags:
        raise SystemExit(f"FAIL: no memory scalar (tags: {sorted(tags)})")
    return checked, tags


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ft", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ft-tb-") as work:
        out = os.path.join(work, "run")
        train(args.ft, out, STEPS)
        checked, tags = compare(out, STEPS, 1)
        print(f"ok: TensorBoard read {checked} scalars of {STEPS} steps equal to metrics.jsonl "
              f"({len(tags)} tags: {', '.join(sorted(tags))})")

        # Killed after the checkpoint of step 3 and resumed: the steps after it are written twice, in
        # two files; the second file's session start makes TensorBoard keep only the later ones.
        out = os.path.join(work, "resumed")
        sets = ["output.save_every=3", "output.async_save=false"]
        p = train(args.ft, out, 9, sets, {"FT_FAULT_STEP_DELAY": "0:0.15"}, background=True)
        deadline = time.time() + 120
        metrics = os.path.join(out, "metrics.jsonl")
        while time.time() < deadline and p.poll() is None:
            if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 5:
                break
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
        p.wait()
        resumed = train(args.ft, out, 9, sets)
        if "resuming from" not in resumed.stdout:
            print(resumed.stdout)
            raise SystemExit("FAIL: the second run did not resume from a checkpoint")
        checked, _ = compare(out, 9, 2)
        print(f"PASS: and after a kill and a resume, each of 9 steps once ({checked} scalars)")


if __name__ == "__main__":
    main()

"""TensorBoard's own reader loads the event files `ft train` writes with output.tensorboard=true
and finds the same scalars as metrics.jsonl.

Runs `ft train --preset tiny-demo` for a few steps with output.tensorboard=true, then reads
<output>/tensorboard/ with tensorboard.backend.event_processing.event_accumulator.EventAccumulator
and compares every step's loss, lr, grad_norm, tokens_per_s, mfu and step_time_s with
metrics.jsonl (TensorBoard keeps simple_value as a 32-bit float: within 1e-6 relative). Exit
status: 0 pass, 1 mismatch or failure, 77 skipped (this Python lacks tensorboard; under CI a
missing library is a failure).

    $FT_PYTHON tests/report/tensorboard_check.py --ft build/bin/ft
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ft", required=True)
    args = ap.parse_args()
    out = os.path.join(tempfile.mkdtemp(prefix="ft-tb-"), "run")
    argv = [args.ft, "train", "--preset", "tiny-demo", "--output", out,
            "--set", f"train.max_steps={STEPS}", "--set", "output.tensorboard=true"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout, p.stderr)
        raise SystemExit(f"FAIL: {' '.join(argv)} exited with {p.returncode}")
    tb_dir = os.path.join(out, "tensorboard")
    files = [f for f in os.listdir(tb_dir) if f.startswith("events.out.tfevents.")]
    if len(files) != 1:
        raise SystemExit(f"FAIL: expected one events.out.tfevents.* file in {tb_dir}, got {files}")
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    if len(metrics) != STEPS:
        raise SystemExit(f"FAIL: metrics.jsonl has {len(metrics)} records, expected {STEPS}")
    checked = 0
    for key in KEYS:
        if key not in tags:
            raise SystemExit(f"FAIL: TensorBoard finds no scalar '{key}' (tags: {sorted(tags)})")
        events = acc.Scalars(key)
        got = {e.step: e.value for e in events}
        if len(events) != STEPS or sorted(got) != [m["step"] for m in metrics]:
            raise SystemExit(f"FAIL: '{key}': steps {sorted(got)} in TensorBoard, "
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
    print(f"PASS: TensorBoard read {checked} scalars of {STEPS} steps "
          f"equal to metrics.jsonl ({len(tags)} tags: {', '.join(sorted(tags))})")


if __name__ == "__main__":
    main()

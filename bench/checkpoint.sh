#!/usr/bin/env bash
# Checkpoint cost: the training stall of a synchronous save against that of an async save of the
# same state, and the time a resumed run takes to its first step against a fresh start.
#   bench/checkpoint.sh [BUILD]     BENCH_DIR (default: a temporary folder; the checkpoints go there)
# One ft train process, CPU, fp32; the model is sized so a checkpoint is ~1.6 GB (masters + two
# Adam moments). Saves every 4 steps, 12 steps: the async writes finish between saves.
set -euo pipefail
build=${1:-build}
ft="$build/bin/ft"
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"
common=(--preset tiny-demo --set precision.mode=fp32 --set model.hidden_size=1024
        --set model.intermediate_size=2816 --set model.num_layers=8 --set model.num_heads=16
        --set model.num_kv_heads=16 --set model.vocab_size=32000 --set data.seq_len=64
        --set train.micro_batch=1 --set train.log_every=1000 --set output.save_every=4
        --set output.keep_last=1)
run() {  # run NAME EXTRA... : ft train into $work/NAME, quietly
  local name=$1; shift
  rm -rf "${work:?}/$name"
  "$ft" train "${common[@]}" --output "$work/$name" "$@" > "$work/$name.log" 2>&1 ||
    { cat "$work/$name.log" >&2; exit 1; }
}
# Seconds from starting ft train until its first step is in metrics.jsonl.
time_to_first_step() {  # NAME EXTRA...
  local name=$1; shift
  local t0 t1
  t0=$(date +%s.%N)
  "$ft" train "${common[@]}" --output "$work/$name" "$@" > "$work/$name.log" 2>&1 &
  local pid=$!
  while [[ ! -s "$work/$name/metrics.jsonl" || $(wc -l < "$work/$name/metrics.jsonl") -le ${START_LINES:-0} ]]; do
    sleep 0.01
    kill -0 "$pid" 2>/dev/null || { cat "$work/$name.log" >&2; exit 1; }
  done
  t1=$(date +%s.%N)
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
  python3 -c "print(f'{$t1 - $t0:.3f}')"
}
run sync --set train.max_steps=12 --set output.async_save=false
run async --set train.max_steps=12 --set output.async_save=true
rm -rf "$work/fresh"
fresh=$(time_to_first_step fresh --set train.max_steps=13)
rm -rf "$work/resumed"; cp -r "$work/sync" "$work/resumed"; rm -rf "$work/resumed/final"
resumed=$(START_LINES=12 time_to_first_step resumed --set train.max_steps=13 --set output.async_save=false)
ckpt_bytes=$(du -sb "$work/sync/checkpoints" | cut -f1)
python3 - "$work" "$fresh" "$resumed" "$ckpt_bytes" <<'PY'
import json, statistics, sys
work, fresh, resumed, size = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
def saves(name):
    rows = [json.loads(l) for l in open(f"{work}/{name}/checkpoints.jsonl")]
    return [r for r in rows if "stall_s" in r], rows
sync, _ = saves("sync")
asyn, arows = saves("async")
steps = [json.loads(l)["step_time_s"] for l in open(f"{work}/sync/metrics.jsonl")]
sync_stall = statistics.median(r["stall_s"] for r in sync)
async_stall = statistics.median(r["stall_s"] for r in asyn)
writes = [r["previous_write_s"] for r in asyn[1:]] + [arows[-1]["last_write_s"]]
print(f"checkpoint size {size / 1e9:.2f} GB (one step directory); median step {statistics.median(steps):.3f} s")
print()
print("| what | seconds |")
print("|---|---|")
print(f"| synchronous save: training stall (median of {len(sync)}) | {sync_stall:.3f} |")
print(f"| async save: training stall (median of {len(asyn)}) | {async_stall:.3f} |")
print(f"| async save: background write (median) | {statistics.median(writes):.3f} |")
print(f"| async stall / synchronous save | {async_stall / sync_stall:.3f} |")
print(f"| fresh start to first step | {fresh:.3f} |")
print(f"| resume (verify + load checkpoint) to first step | {resumed:.3f} |")
PY

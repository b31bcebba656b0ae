#!/usr/bin/env bash
# Expert parallelism's token exchange in a real job, against ft doctor's prediction of it:
# `ft launch --nproc-per-node W` of a mixture-of-experts benchmark model (bench/moe_models.py)
# with strategy.expert_parallel set to each of BENCH_EP. For each job: the median step, the time
# rank 0's step spent in the exchange (its dispatch and combine, metrics.jsonl's moe.exchange:
# all-to-alls plus the waits for the slowest rank's rows) and its share of the step, the part of it
# spent in the row-count exchanges that open each dispatch (a few bytes: mostly waiting for the
# other ranks to reach the layer), the bytes rank 0 sent; beside them `ft doctor`'s prediction for the same job and layout (its all-to-all
# part: the plan's bytes at the all-to-all curve it measures, and its step).
#   bench/moe_ep.sh [BUILD]   BUILD/bin/ft is the ft that runs (default build)
#     BENCH_WORLD (default 4) ranks on this machine, BENCH_EP (default "1 2 4"; 1: no exchange)
#     BENCH_CONFIG (default qwen3moe; or mixtral), BENCH_STRATEGY (default ddp)
#     BENCH_THREADS (default 1) per rank, BENCH_BATCH (default 1) x BENCH_SEQ (default 512) tokens
#       per rank and step, BENCH_STEPS (default 5) timed steps after BENCH_WARMUP (default 2)
#     BENCH_KEEP=DIR: keep the model, the runs and the doctor's JSON there
# Needs transformers in the venv ft builds against (scripts/setup.sh installs it).
set -euo pipefail
build=${1:-build} me=moe_ep
# shellcheck source=bench/moe_common.sh
source "$(dirname "$0")/moe_common.sh"
world=${BENCH_WORLD:-4} eps=${BENCH_EP:-1 2 4} config=${BENCH_CONFIG:-qwen3moe}
strategy=${BENCH_STRATEGY:-ddp} threads=${BENCH_THREADS:-1} batch=${BENCH_BATCH:-1}
seq=${BENCH_SEQ:-512} steps=${BENCH_STEPS:-5} warmup=${BENCH_WARMUP:-2}
moe_models on "$seq" "$((world * batch * (warmup + steps)))" "$config"
free_port() {
  "$FT_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
export OMP_NUM_THREADS=$threads
echo "| expert_parallel | step (median) | exchange: dispatch + combine | its share of the step | of it, row-count exchanges (waiting) | sent by rank 0 per step | doctor: all-to-all per step | doctor: step |"
echo "|---|---|---|---|---|---|---|---|"
for ep in $eps; do
  sets=(--set precision.mode=fp32 --set "strategy.kind=$strategy"
    --set train.activation_checkpointing=none --set data.format=tokenized
    --set "data.seq_len=$seq" --set "train.micro_batch=$batch" --set train.grad_accum=1
    --set train.warmup_ratio=0 --set moe.aux_loss=on --set train.log_every=1000
    --set "strategy.expert_parallel=$ep")
  out=$work/ep$ep
  rm -rf "$out"
  "$ft" launch --nproc-per-node "$world" --master-port "$(free_port)" -- \
    "$ft" train --preset full --model "$work/$config" --data "$work/records.jsonl" \
    --tokenizer "$tokenizer" --output "$out" \
    "${sets[@]}" --set "train.max_steps=$((warmup + steps))" >"$out.log" 2>&1 ||
    { echo "moe_ep: the EP $ep job failed:" >&2; tail -30 "$out.log" >&2; exit 1; }
  "$ft" launch --nproc-per-node "$world" --master-port "$(free_port)" -- \
    "$ft" doctor --preset full --model "$work/$config" "${sets[@]}" --max-size 16MiB \
    --json "$work/doctor$ep.json" >"$work/doctor$ep.log" 2>&1 ||
    { echo "moe_ep: ft doctor for EP $ep failed:" >&2; tail -30 "$work/doctor$ep.log" >&2; exit 1; }
  python3 - "$ep" "$out/metrics.jsonl" "$work/doctor$ep.json" "$warmup" <<'PY'
import json, sys
ep, metrics, doctor, warmup = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
recs = [json.loads(l) for l in open(metrics) if '"step_time_s"' in l][warmup:]
def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]
step = median([r["step_time_s"] for r in recs])
ex = [r["moe"].get("exchange") for r in recs]
if all(ex):
    t = median([e["dispatch_s"] + e["combine_s"] for e in ex])
    waits = median([e["counts_s"] for e in ex])
    sent = median([e["bytes_sent"] for e in ex])
    exchange, share, sent = f"{t * 1000:.0f} ms", f"{t / step:.1%}", f"{sent / 2**20:.1f} MiB"
    waits = f"{waits * 1000:.0f} ms"
else:
    exchange, share, sent, waits = "none", "0", "0", "-"
p = json.load(open(doctor)).get("prediction", {})
a2a = [c for c in p.get("comm", []) if c["op"] == "all-to-all"]
predicted = (f"{sum(c['seconds'] for c in a2a) * 1000:.0f} ms ({a2a[0]['calls']} calls of "
             f"{a2a[0]['bytes_per_call'] / 2**10:.0f} KiB, {a2a[0]['group']})") if a2a else "none"
print(f"| {ep} | {step * 1000:.0f} ms | {exchange} | {share} | {waits} | {sent} | {predicted} | "
      f"{p.get('step_s', 0) * 1000:.0f} ms |")
PY
done
echo
echo "Command: \`BENCH_WORLD=$world BENCH_EP=\"$eps\" BENCH_CONFIG=$config BENCH_STRATEGY=$strategy BENCH_THREADS=$threads BENCH_BATCH=$batch BENCH_SEQ=$seq BENCH_STEPS=$steps BENCH_WARMUP=$warmup bench/moe_ep.sh $build\`; $world ranks x $threads thread(s) on $(nproc --all) cores, fp32, $batch x $seq tokens per rank and step; load average $(cut -d' ' -f1-3 /proc/loadavg)."

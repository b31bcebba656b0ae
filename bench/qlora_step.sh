#!/usr/bin/env bash
# The QLoRA training step on the CPU, side by side in one run (issue 33): `ft train` with
# lora.quantize_base=nf4 against transformers + PEFT + bitsandbytes (its CPU backend) training the
# same model (bench/qlora_step_ref.py), without and with torch.compile. The same fp32 base (a
# random-init Llama shape written by qlora_step_ref.py --make), quantized to NF4 by each side as it
# loads (the same bytes: tests/model/qlora_test.cpp), computing in fp32; LoRA r 16, alpha 32, no
# dropout on every projection; the same pre-tokenized records, threads (OMP_NUM_THREADS for ft,
# torch.set_num_threads for transformers), global-norm clip 1.0 and AdamW (fused on their side).
# ft's step times come from its metrics.jsonl (step_time_s), the warm-up steps skipped; both sides
# give the median step, tokens/s and peak resident memory.
#   bench/qlora_step.sh [BUILD]   BUILD/bin/ft is the ft that runs (default build)
#     BENCH_STEPS (default 5) timed steps after BENCH_WARMUP (default 2), BENCH_THREADS (default 2)
#     BENCH_BATCH (default 2) x BENCH_SEQ (default 512) tokens a step
#     BENCH_SHAPE (default "1024 8 2816 8000"): hidden, layers, intermediate, vocabulary
#     BENCH_VARIANTS (default "eager compile"): transformers without and with torch.compile
#     BENCH_DOUBLE_QUANT (default 0): 1 quantizes the absmax too, on both sides
#     BENCH_KEEP=DIR: keep the model, data and ft's output there
# Needs transformers, peft and bitsandbytes in the venv ft builds against (scripts/setup.sh).
set -euo pipefail
build=${1:-build} me=qlora_step
# shellcheck source=bench/moe_common.sh
source "$(dirname "$0")/moe_common.sh"
"$FT_PYTHON" -c "import peft, bitsandbytes" 2>/dev/null ||
  { echo "$me: '$FT_PYTHON' lacks peft or bitsandbytes: run scripts/setup.sh" >&2; exit 1; }
steps=${BENCH_STEPS:-5} warmup=${BENCH_WARMUP:-2} threads=${BENCH_THREADS:-2}
batch=${BENCH_BATCH:-2} seq=${BENCH_SEQ:-512} dq=${BENCH_DOUBLE_QUANT:-0}
read -r hidden layers inter vocab <<<"${BENCH_SHAPE:-1024 8 2816 8000}"
export OMP_NUM_THREADS=$threads
"$FT_PYTHON" "$here/bench/qlora_step_ref.py" --make "$work" --seq "$seq" \
  --records $((batch * (warmup + steps))) --hidden "$hidden" --layers "$layers" --inter "$inter" \
  --vocab "$vocab" >"$work/make.log" 2>&1 ||
  { echo "$me: making the model failed:" >&2; cat "$work/make.log" >&2; exit 1; }
dq_flag=() dq_set=false
[[ $dq == 1 ]] && dq_flag=(--double-quant) dq_set=true

out=$work/ft
"$ft" train --preset lora --model "$work/base" --data "$work/records.jsonl" --tokenizer "$tokenizer" \
  --output "$out" --set precision.mode=fp32 --set strategy.kind=ddp \
  --set lora.quantize_base=nf4 --set lora.double_quant=$dq_set --set lora.r=16 \
  --set lora.alpha=32 --set lora.dropout=0 --set train.activation_checkpointing=none \
  --set data.format=tokenized --set data.seq_len="$seq" --set train.micro_batch="$batch" \
  --set train.grad_accum=1 --set train.max_steps=$((warmup + steps)) --set train.grad_clip=1.0 \
  --set train.warmup_ratio=0 --set train.log_every=1000 >"$out.log" 2>&1 ||
  { echo "$me: ft train failed, its output:" >&2; cat "$out.log" >&2; exit 1; }
results=("$(python3 - "$out/metrics.jsonl" "$warmup" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"step_time_s"' in l]
timed = recs[int(sys.argv[2]):]
times = sorted(r["step_time_s"] for r in timed)
median = times[len(times) // 2]
tokens = timed[0]["input_tokens"]
print(json.dumps({"impl": "ft", "step_time_s": {"median": median, "min": times[0]},
                  "tokens_per_s": round(tokens / median, 1), "tokens": tokens,
                  "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"],
                  "peak_rss_mib": round(max(r["memory"]["peak_rss_bytes"] for r in recs) / 2**20, 1)}))
PY
)")
for v in ${BENCH_VARIANTS:-eager compile}; do
  flags=("${dq_flag[@]}")
  [[ $v == compile ]] && flags+=(--compile)
  line=$("$FT_PYTHON" "$here/bench/qlora_step_ref.py" --model "$work/base" --data "$work/records.jsonl" \
    --batch "$batch" --seq "$seq" --steps "$steps" --warmup "$warmup" --threads "$threads" \
    "${flags[@]}" 2>"$work/ref-$v.log" | tail -n 1) ||
    { echo "$me: qlora_step_ref.py failed:" >&2; tail -20 "$work/ref-$v.log" >&2; exit 1; }
  results+=("$line")
done
python3 - "hidden $hidden, $layers layers, inter $inter, vocab $vocab" "${results[@]}" <<'PY'
import json, sys
label, rows = sys.argv[1], [json.loads(r) for r in sys.argv[2:]]
print(f"QLoRA step on the CPU ({label}; {rows[0]['tokens']} tokens a step)")
print("| implementation | step (median) | tokens/s | first -> last loss | peak RSS |")
print("|---|---|---|---|---|")
for r in rows:
    print(f"| {r['impl']} | {r['step_time_s']['median'] * 1000:.0f} ms | {r['tokens_per_s']:.0f} | "
          f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} | {r['peak_rss_mib']:.0f} MiB |")
best = min(r["step_time_s"]["median"] for r in rows[1:])
print(f"ft / best transformers: {best / rows[0]['step_time_s']['median']:.2f}x")
PY

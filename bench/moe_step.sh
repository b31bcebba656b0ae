#!/usr/bin/env bash
# The mixture-of-experts training step on the CPU, side by side in one run: `ft train` of a
# config.json directory written here with transformers' MixtralConfig / Qwen3MoeConfig, against
# transformers training the same directory (bench/moe_step_ref.py) with each of its experts
# implementations (eager, grouped_mm, batched_mm where its gathered weights fit), each with and
# without torch.compile, always with AdamW(fused=True) and a global-norm clip of 1.0. fp32, full
# fine-tune, the same random pre-tokenized records (a JSONL both read), the same thread count
# (OMP_NUM_THREADS for ft, torch.set_num_threads for transformers), the router's load-balancing loss
# on in both or off in both (BENCH_AUX: the config's output_router_logits and ft's moe.aux_loss).
# ft's step times come from its metrics.jsonl (step_time_s), the warm-up steps skipped; both sides
# give the median step and tokens/s.
#   bench/moe_step.sh [BUILD]   BUILD/bin/ft is the ft that runs (default build)
#     BENCH_STEPS (default 8) timed steps after BENCH_WARMUP (default 3)
#     BENCH_THREADS (default 2), BENCH_BATCH (default 2) x BENCH_SEQ (default 512) tokens a step
#     BENCH_CONFIGS (default "mixtral qwen3moe"), BENCH_AUX (on | off, default on)
#     BENCH_VARIANTS (default "eager grouped_mm batched_mm eager+compile grouped_mm+compile")
#     BENCH_BATCHED_MAX_GB (default 2): batched_mm gathers every (token, expert) pair's weights,
#       tokens x top-k x 3 x expert_intermediate x hidden floats; a model past this is not run with it
#     BENCH_REPEATS (default 1): each variant that many times, interleaved, its best median kept
#     BENCH_KEEP=DIR: keep the model directories, data and ft's outputs there
#     BENCH_FT_SET: more arguments for ft train, split on spaces, e.g. "--set output.profile_steps=2"
#       (ft's profile.txt is then in BENCH_KEEP/ft-MODEL-0/)
# Needs transformers in the venv ft builds against (scripts/setup.sh installs it).
set -euo pipefail
build=${1:-build} me=moe_step
# shellcheck source=bench/moe_common.sh
source "$(dirname "$0")/moe_common.sh"
steps=${BENCH_STEPS:-8} warmup=${BENCH_WARMUP:-3} threads=${BENCH_THREADS:-2}
batch=${BENCH_BATCH:-2} seq=${BENCH_SEQ:-512} aux=${BENCH_AUX:-on}
[[ $aux == on || $aux == off ]] || { echo "moe_step: BENCH_AUX is on or off, not '$aux'" >&2; exit 2; }
variants=${BENCH_VARIANTS:-eager grouped_mm batched_mm eager+compile grouped_mm+compile}
export OMP_NUM_THREADS=$threads
# The models and records (bench/moe_models.py: random init, saved by save_pretrained, so both sides
# load the same weights).
moe_models "$aux" "$seq" "$((batch * (warmup + steps)))"
declare -A labels=(
  [mixtral]="Mixtral-like: d=512, 4 layers, 8 experts x 1024, top-2"
  [qwen3moe]="Qwen3-MoE-like: d=512, 4 layers, 32 experts x 256, top-4"
)

# One ft train run; prints the JSON line the Python side prints (median of the timed steps).
run_ft() {
  local model=$1 out=$work/ft-$1-$2
  rm -rf "$out"
  # shellcheck disable=SC2086 # BENCH_FT_SET is split into its arguments on purpose
  "$ft" train --preset full --model "$work/$model" --data "$work/records.jsonl" \
    --tokenizer "$tokenizer" --output "$out" \
    --set precision.mode=fp32 --set strategy.kind=ddp --set train.activation_checkpointing=none \
    --set data.format=tokenized --set data.seq_len="$seq" --set train.micro_batch="$batch" \
    --set train.grad_accum=1 --set train.max_steps=$((warmup + steps)) --set train.grad_clip=1.0 \
    --set train.warmup_ratio=0 --set moe.aux_loss="$aux" --set train.log_every=1000 \
    ${BENCH_FT_SET:-} >"$out.log" 2>&1 ||
    { echo "moe_step: ft train failed, its output:" >&2; cat "$out.log" >&2; exit 1; }
  python3 - "$out/metrics.jsonl" "$warmup" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"step_time_s"' in l]
if not any("moe" in r for r in recs):
    sys.exit("moe_step: ft's metrics.jsonl has no \"moe\" record: did it train an MoE model?")
timed = recs[int(sys.argv[2]):]
times = sorted(r["step_time_s"] for r in timed)
median = times[len(times) // 2]
tokens = timed[0]["input_tokens"] if "input_tokens" in timed[0] else None
print(json.dumps({"impl": "ft", "step_time_s": {"median": median, "min": times[0]},
                  "tokens_per_s": round(tokens / median, 1) if tokens else None, "tokens": tokens,
                  "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"],
                  "aux_loss": recs[0]["moe"]["aux_loss"],
                  "peak_rss_mib": round(max(r["memory"]["peak_rss_bytes"] for r in recs) / 2**20, 1)}))
PY
}

# batched_mm's gathered expert weights for one layer, forward only, in GB.
batched_gb() {
  "$FT_PYTHON" -c "
import json; c = json.load(open('$work/$1/config.json'))
inter = c.get('moe_intermediate_size') or c['intermediate_size']
print($batch * $seq * c['num_experts_per_tok'] * 3 * inter * c['hidden_size'] * 4 / 1e9)"
}

header="| model | ft"
for v in $variants; do header+=" | transformers ${v/+compile/ + torch.compile}"; done
echo "$header | ft / best |"
echo "|---$(for _ in $variants; do printf '|---'; done)|---|---|"
for key in ${BENCH_CONFIGS:-mixtral qwen3moe}; do
  [[ -v labels[$key] ]] || { echo "moe_step: BENCH_CONFIGS names '$key'; known: ${!labels[*]}" >&2; exit 2; }
  results=()
  for ((rep = 0; rep < ${BENCH_REPEATS:-1}; rep++)); do
    results+=("0 $(run_ft "$key" "$rep")")
    i=1
    for v in $variants; do
      experts=${v%+compile} flags=()
      [[ $v == *+compile ]] && flags=(--compile)
      gb=$(batched_gb "$key")
      if [[ $experts == batched_mm ]] &&
        "$FT_PYTHON" -c "import sys; sys.exit(not $gb > ${BENCH_BATCHED_MAX_GB:-2})"; then
        results+=("$i {\"skipped\": \"gathers $(printf %.1f "$gb") GB of weights per layer\"}")
      else
        line=$("$FT_PYTHON" bench/moe_step_ref.py --model "$work/$key" --data "$work/records.jsonl" \
          --batch "$batch" --steps "$steps" --warmup "$warmup" --threads "$threads" \
          --experts "$experts" "${flags[@]}" 2>"$work/ref-$key-$v.log" | tail -n 1) ||
          { echo "moe_step: moe_step_ref.py failed:" >&2; tail -20 "$work/ref-$key-$v.log" >&2; exit 1; }
        results+=("$i $line")
      fi
      i=$((i + 1))
    done
  done
  python3 - "${labels[$key]}" "${results[@]}" <<'PY'
import json, sys
label, best_of = sys.argv[1], {}
for arg in sys.argv[2:]:
    k, r = arg.split(" ", 1)
    k, r = int(k), json.loads(r)
    old = best_of.get(k)
    if old is None or ("step_time_s" in r and ("step_time_s" not in old or
                                               r["step_time_s"]["median"] < old["step_time_s"]["median"])):
        best_of[k] = r
rows = [best_of[k] for k in sorted(best_of)]
def cell(r):
    if "skipped" in r:
        return "not run: " + r["skipped"]
    return f"{r['step_time_s']['median'] * 1000:.0f} ms, {r['tokens_per_s']:.0f} tok/s"
timed = [r for r in rows[1:] if "step_time_s" in r]
best = min(r["step_time_s"]["median"] for r in timed)
print(f"| {label} | " + " | ".join(cell(r) for r in rows) +
      f" | {best / rows[0]['step_time_s']['median']:.2f}x |")
details = "; ".join(f"{r.get('impl')}{'/' + r['experts'] if 'experts' in r else ''}"
                    f"{'+compile' if r.get('compile') else ''}: loss {r['first_loss']:.3f} -> "
                    f"{r['last_loss']:.3f}, peak RSS {r['peak_rss_mib']:.0f} MiB"
                    + (f", {r['params']} parameters" if 'params' in r else "")
                    for r in rows if "step_time_s" in r)
print(f"<!-- {label}: {details} -->", file=sys.stderr)
PY
done
echo
echo "Command: \`BENCH_STEPS=$steps BENCH_WARMUP=$warmup BENCH_THREADS=$threads BENCH_BATCH=$batch BENCH_SEQ=$seq BENCH_AUX=$aux BENCH_REPEATS=${BENCH_REPEATS:-1} bench/moe_step.sh $build\`; $batch x $seq tokens a step, fp32, aux loss $aux; $(nproc --all) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); torch $("$FT_PYTHON" -c 'import torch; print(torch.__version__)'), transformers $("$FT_PYTHON" -c 'import transformers; print(transformers.__version__)')."

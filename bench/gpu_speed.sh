#!/usr/bin/env bash
# Speed and memory on one GPU, ft side by side with what a user would write (issue 18), in one run:
#   full-1b  full fine-tune of a Llama-3.2-1B-shaped model (random init), bf16 with fp32 masters,
#            seq 4096, micro-batch FULL_MB (default 2), ddp at world size 1 (an NCCL group)
#   lora-8b  LoRA r=16 on every projection of a Llama-3-8B-shaped model, bf16 base, seq 4096,
#            micro-batch 1
#   offload-1b  full-1b under zero3 with offload_optimizer (masters, gradients and AdamW on the
#            host): ft only, its step time against full-1b's
# against bench/gpu_speed_ref.py (transformers, + PEFT for LoRA, fused AdamW, bf16 autocast).
# Data: pre-tokenized rows of exactly seq_len random ids (below 1150, the fixture tokenizer's
# vocabulary; the model's vocabulary is 128256, so the cost is a real 128k-vocabulary step).
# MFU: model FLOPs per token over the GPU's dense bf16 peak and over its measured matmul rate.
# Full: 6 N + 12 L h T (N: matmul parameters, the LM head included; T: sequence length).
# LoRA: 4 N (frozen weights need only input gradients) + 6 N_lora + 12 L h T.
# Also: ft plan's GPU prediction (its figures less the assumed overhead) against the CUDA
# allocator's peak.
#   bench/gpu_speed.sh [BUILD] [full-1b] [lora-8b]   BENCH_STEPS (10), BENCH_WARMUP (3),
#   FULL_MB (2), FT_SETS (more KEY=VALUE settings for ft's runs, space- or comma-separated), BENCH_REF (0: ft
#   only; 1), REF_COMPILE (1: the reference under torch.compile; 0), BENCH_PROFILE (steps to profile in ft and the reference; 0), GPU_PEAK_TFLOPS (989.4, H100 SXM dense bf16), OUT_DIR (kept runs; default a temp dir)
set -euo pipefail
build=${1:-build}
shift || true
what=("$@")
((${#what[@]})) || what=(full-1b lora-8b)
py=${FT_PYTHON:-python3}
ft=$build/bin/ft
steps=${BENCH_STEPS:-10}
warm=${BENCH_WARMUP:-3}
full_mb=${FULL_MB:-2}
profile=${BENCH_PROFILE:-0}
ft_sets=()
ft_sets_text=${FT_SETS:-}
for kv in ${ft_sets_text//,/ }; do ft_sets+=(--set "$kv"); done
ref_compile=()
[[ ${REF_COMPILE:-0} == 1 ]] && ref_compile=(--compile)
peak=${GPU_PEAK_TFLOPS:-989.4}
out=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$out"
seq=4096
tok=tests/tokenizer/fixtures/llama3/tokenizer.json
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

"$py" - "$out/tokens.jsonl" "$seq" <<'PY'
import json, random, sys
random.seed(0)
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        f.write(json.dumps({"input_ids": [random.randrange(1150) for _ in range(int(sys.argv[2]))]}) + "\n")
PY
"$py" bench/gpu_speed_ref.py --matmul-peak | tee "$out/matmul.json"

common=(--set data.format=tokenized --set data.seq_len="$seq" --set data.pack=false
        --set data.template=none --set model.max_seq_len="$seq" --set model.vocab_size=128256
        --set model.num_heads=32 --set model.num_kv_heads=8 --set model.rope_theta=500000
        --set train.max_steps=$((warm + steps)) --set train.log_every=1 --set train.grad_accum=1
        --set train.warmup_steps=1 --set precision.mode=bf16 --set hardware.device=cuda
        --set strategy.kind=ddp --set output.profile_steps="$profile")
shape_full=(--set model.hidden_size=2048 --set model.intermediate_size=8192 --set model.num_layers=16
            --set model.tie_embeddings=true --set train.micro_batch="$full_mb" --set train.lr=2e-5)
shape_lora=(--set model.hidden_size=4096 --set model.intermediate_size=14336
            --set model.num_layers=32 --set model.tie_embeddings=false --set train.micro_batch=1
            --set lora.enabled=true --set lora.r=16 --set lora.alpha=32 --set lora.dropout=0.05
            --set train.lr=2e-4)

run_case() {
  local name=$1 mode=$2 mb=$3
  shift 3
  local sets=("$@" "${ft_sets[@]}") ref=${BENCH_REF:-1}
  [[ $mode == none ]] && ref=0
  echo "== $name: ft plan"
  "$ft" plan --preset tiny-demo "${common[@]}" "${sets[@]}" --gpu-memory 80GiB --host-memory 120GiB \
    --json > "$out/$name-plan.json" || true
  echo "== $name: ft train"
  rm -rf "$out/$name-ft"
  "$ft" train --preset tiny-demo --output "$out/$name-ft" --data "$out/tokens.jsonl" --tokenizer "$tok" \
    "${common[@]}" "${sets[@]}" 2>&1 | tee "$out/$name-ft.log" | grep -v '^ft train: step' || true
  ((ref)) || return 0
  echo "== $name: reference"
  local h inter layers tie
  h=$(grep -o 'model.hidden_size=[0-9]*' <<<"${sets[*]}" | cut -d= -f2)
  inter=$(grep -o 'model.intermediate_size=[0-9]*' <<<"${sets[*]}" | cut -d= -f2)
  layers=$(grep -o 'model.num_layers=[0-9]*' <<<"${sets[*]}" | cut -d= -f2)
  tie=$([[ ${sets[*]} == *tie_embeddings=true* ]] && echo 1 || echo 0)
  "$py" bench/gpu_speed_ref.py --mode "$mode" --hidden "$h" --inter "$inter" --layers "$layers" \
    --tie "$tie" --batch "$mb" --seq $seq --steps "$steps" --warmup "$warm" --profile "$profile" \
    "${ref_compile[@]}" 2>"$out/$name-ref.err" | tee "$out/$name-ref.json" || tail -n 20 "$out/$name-ref.err"
}

for w in "${what[@]}"; do
  case $w in
    full-1b) run_case full-1b full "$full_mb" "${shape_full[@]}" ;;
    lora-8b) run_case lora-8b lora 1 "${shape_lora[@]}" ;;
    offload-1b) run_case offload-1b none "$full_mb" "${shape_full[@]}" --set strategy.kind=zero3 \
                  --set strategy.zero3.offload_optimizer=true ;;
    *) echo "gpu_speed: unknown case '$w' (full-1b, lora-8b, offload-1b)" >&2; exit 2 ;;
  esac
done

"$py" - "$out" "$warm" "$peak" "${what[@]}" <<'PY'
import json, os, statistics, sys
out, warm, peak = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
measured = json.load(open(os.path.join(out, "matmul.json")))["matmul_bf16_tflops"]
shapes = {"full-1b": dict(h=2048, inter=8192, L=16, tie=True, lora=False),
          "offload-1b": dict(h=2048, inter=8192, L=16, tie=True, lora=False),
          "lora-8b": dict(h=4096, inter=14336, L=32, tie=False, lora=True)}
V, T, hd, kv, r = 128256, 4096, 128, 8, 16
def flops(s):
    h, i, L = s["h"], s["inter"], s["L"]
    per_layer = h * h * 2 + h * kv * hd * 2 + 3 * h * i          # q,o + k,v + mlp
    n = L * per_layer + V * h                                     # + the LM head
    attn = 12 * L * h * T
    if not s["lora"]:
        return 6 * n + attn
    n_lora = L * r * ((h + h) * 2 + (h + kv * hd) * 2 + (h + i) * 3)
    return 4 * n + 6 * n_lora + attn
def find(d, key):
    if isinstance(d, dict):
        if key in d: return d[key]
        for v in d.values():
            x = find(v, key)
            if x is not None: return x
    return None
rows = []
for name in sys.argv[4:]:
    f = flops(shapes[name])
    lines = [json.loads(l) for l in open(os.path.join(out, name + "-ft", "metrics.jsonl")) if l.strip()]
    steps = [l for l in lines if "step_time_s" in l and l.get("step", 0) > warm]
    if not steps:
        print(f"{name}: ft wrote no step after the first {warm}"); continue
    st = statistics.median(l["step_time_s"] for l in steps)
    tok = statistics.median(l["input_tokens"] for l in steps)
    ft_peak = max((find(l, "cuda_peak_allocated_bytes") or 0) for l in lines)
    tps = tok / st
    row = {"case": name, "impl": "ft", "step_s": st, "tokens_per_s": tps,
           "mfu": tps * f / (peak * 1e12), "mfu_measured": tps * f / (measured * 1e12),
           "peak_gib": ft_peak / 2**30, "first_loss": lines[0].get("loss")}
    try:
        plan = json.load(open(os.path.join(out, name + "-plan.json")))["rank"]
        over = sum(i["bytes"] for i in plan["items"] if i["key"] == "overhead")
        row["plan_gib"] = (plan["step_peak_bytes"] - over) / 2**30
    except Exception as e:  # noqa: BLE001
        row["plan_gib"] = float("nan")
    rows.append(row)
    try:
        ref = json.loads(open(os.path.join(out, name + "-ref.json")).read().strip().splitlines()[-1])
        rows.append({"case": name, "impl": ref["impl"], "step_s": ref["step_time_s"],
                     "tokens_per_s": ref["tokens_per_s"],
                     "mfu": ref["tokens_per_s"] * f / (peak * 1e12),
                     "mfu_measured": ref["tokens_per_s"] * f / (measured * 1e12),
                     "peak_gib": ref["peak_allocated_bytes"] / 2**30, "first_loss": ref["first_loss"],
                     "plan_gib": float("nan")})
    except Exception as e:  # noqa: BLE001
        print(f"{name}: no reference result ({e})")
json.dump({"matmul_tflops": measured, "peak_tflops": peak, "rows": rows},
          open(os.path.join(out, "summary.json"), "w"), indent=1)
print(f"\nmeasured bf16 matmul {measured} TFLOP/s; dense peak taken as {peak} TFLOP/s")
print(f"{'case':8} {'impl':22} {'step s':>8} {'tokens/s':>9} {'MFU':>6} {'MFU/meas':>8} {'peak GiB':>9} {'plan GiB':>9} {'loss@1':>7}")
for r in rows:
    print(f"{r['case']:8} {r['impl']:22} {r['step_s']:8.4f} {r['tokens_per_s']:9.0f} {r['mfu']*100:5.1f}% "
          f"{r['mfu_measured']*100:7.1f}% {r['peak_gib']:9.2f} {r['plan_gib']:9.2f} {r['first_loss'] or 0:7.3f}")
PY
echo "runs kept in $out"

#!/usr/bin/env bash
# One training step, side by side in one run: ft's loop (bench/train_step.cpp, with its fused CPU
# kernels and without) against the best a user writes in PyTorch (bench/train_step_ref.py:
# transformers' LlamaForCausalLM with torch AdamW as it comes, with AdamW(fused=True), and with
# fused AdamW + torch.compile), same torch build (the venv ft builds against), same threads, CPU,
# fp32, random-token batches. Median step and the process's peak resident memory.
#   bench/train_step.sh [BUILD]   BENCH_STEPS (default 20), BENCH_THREADS (default nproc),
#                                 BENCH_CONFIGS (default all: overhead, mid, gemm),
#                                 BENCH_REPEATS (default 1): each variant that many times,
#                                 interleaved, and its best median kept (2 OpenMP threads on a
#                                 2-core machine swing by 40% from one process to the next)
# Needs transformers in that venv (scripts/setup.sh installs it).
set -euo pipefail
build=${1:-build}
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}
# shellcheck disable=SC1091
source "$FT_CACHE/env.sh"
steps=${BENCH_STEPS:-20}
threads=${BENCH_THREADS:-$(nproc)}
"$FT_PYTHON" -c "import transformers" 2>/dev/null ||
  { echo "train_step: '$FT_PYTHON' lacks transformers: run scripts/setup.sh" >&2; exit 1; }
export OMP_NUM_THREADS=$threads
# The 2-layer d=256 model is overhead-bound only when the work per step is small: with 64 tokens per
# step framework overhead dominates; with 1024 tokens the same model is already mostly GEMMs.
declare -A configs=(
  [overhead]="overhead-bound (d=256, 2 layers, 64 tokens)|--hidden 256 --layers 2 --heads 4 --inter 688 --vocab 512 --batch 1 --seq 64"
  [mid]="d=256, 2 layers, 1024 tokens|--hidden 256 --layers 2 --heads 4 --inter 688 --vocab 512 --batch 8 --seq 128"
  [gemm]="GEMM-bound (d=1024, 2 layers, vocab 32000, 1024 tokens)|--hidden 1024 --layers 2 --heads 16 --inter 2752 --vocab 32000 --batch 4 --seq 256"
)
echo "| model | ft | ft, unfused kernels | transformers + AdamW | + AdamW(fused=True) | + fused AdamW + torch.compile | ft / best |"
echo "|---|---|---|---|---|---|---|"
for key in ${BENCH_CONFIGS:-overhead mid gemm}; do
  entry=${configs[$key]}
  label=${entry%%|*}
  read -r -a args <<<"${entry#*|}"
  common=("${args[@]}" --steps "$steps" --warmup 3 --threads "$threads")
  results=()
  for ((rep = 0; rep < ${BENCH_REPEATS:-1}; rep++)); do
    results+=("0 $("$build/bin/ft_bench_train_step" "${common[@]}")")
    results+=("1 $("$build/bin/ft_bench_train_step" "${common[@]}" --fused-kernels 0)")
    i=2
    for variant in default fused compile; do
      results+=("$i $("$FT_PYTHON" bench/train_step_ref.py "${common[@]}" --variant "$variant" 2>/dev/null | tail -n 1)")
      i=$((i + 1))
    done
  done
  python3 - "$label" "${results[@]}" <<'PY'
import json, sys
label, best_of = sys.argv[1], {}
for arg in sys.argv[2:]:
    k, r = arg.split(" ", 1)
    r = json.loads(r)
    if int(k) not in best_of or r["step_time_s"]["median"] < best_of[int(k)]["step_time_s"]["median"]:
        best_of[int(k)] = r
rows = [best_of[k] for k in sorted(best_of)]
cell = lambda r: f"{r['step_time_s']['median'] * 1000:.1f} ms, {r['peak_rss_mib']:.0f} MiB"
best = min(r["step_time_s"]["median"] for r in rows[2:])
print(f"| {label} | " + " | ".join(cell(r) for r in rows) +
      f" | {best / rows[0]['step_time_s']['median']:.2f}x |")
PY
done
echo
echo "Command: \`BENCH_STEPS=$steps BENCH_THREADS=$threads BENCH_REPEATS=${BENCH_REPEATS:-1} bench/train_step.sh $build\`; $(nproc --all) cores; torch $("$FT_PYTHON" -c 'import torch; print(torch.__version__)')."

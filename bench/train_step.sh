#!/usr/bin/env bash
# Optimizer steps per second: ft's training loop (bench/train_step.cpp) against a plain PyTorch
# loop of the same model (bench/train_step_ref.py, transformers' LlamaForCausalLM + torch AdamW),
# same torch build (the venv ft builds against), same threads, CPU, fp32, random-token batches.
#   bench/train_step.sh [BUILD]         BENCH_STEPS (default 20), BENCH_THREADS (default nproc)
# Needs transformers in that venv: $FT_PYTHON -m pip install transformers
set -euo pipefail
build=${1:-build}
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}
# shellcheck disable=SC1091
source "$FT_CACHE/env.sh"
steps=${BENCH_STEPS:-20}
threads=${BENCH_THREADS:-$(nproc)}
"$FT_PYTHON" -c "import transformers" 2>/dev/null ||
  { echo "train_step: '$FT_PYTHON' lacks transformers: $FT_PYTHON -m pip install transformers" >&2; exit 1; }
export OMP_NUM_THREADS=$threads
# The 2-layer d=256 model is overhead-bound only when the work per step is small: with 64 tokens per
# step framework overhead dominates; with 1024 tokens the same model is already mostly GEMMs.
configs=(
  "overhead-bound|--hidden 256 --layers 2 --heads 4 --inter 688 --vocab 512 --batch 1 --seq 64"
  "d=256, 1024 tokens|--hidden 256 --layers 2 --heads 4 --inter 688 --vocab 512 --batch 8 --seq 128"
  "GEMM-bound|--hidden 1024 --layers 2 --heads 16 --inter 2752 --vocab 32000 --batch 4 --seq 256"
)
echo "| model | ft steps/s | PyTorch steps/s | ft / PyTorch | ft median step (s) | PyTorch median step (s) |"
echo "|---|---|---|---|---|---|"
for entry in "${configs[@]}"; do
  label=${entry%%|*}
  read -r -a args <<<"${entry#*|}"
  common=("${args[@]}" --steps "$steps" --warmup 3 --threads "$threads")
  ft=$("$build/bin/ft_bench_train_step" "${common[@]}")
  ref=$("$FT_PYTHON" bench/train_step_ref.py "${common[@]}" 2>/dev/null | tail -n 1)
  python3 - "$label" "$ft" "$ref" "${args[*]}" <<'PY'
import json, sys
label, ft, ref, args = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
print(f"| {label} ({args}) | {ft['steps_per_s']:.2f} | {ref['steps_per_s']:.2f} | "
      f"{ft['steps_per_s'] / ref['steps_per_s']:.2f} | {ft['step_time_s']['median']:.4f} | "
      f"{ref['step_time_s']['median']:.4f} |")
PY
done
echo
echo "Command: \`BENCH_STEPS=$steps BENCH_THREADS=$threads bench/train_step.sh $build\`; $(nproc) cores; torch $("$FT_PYTHON" -c 'import torch; print(torch.__version__)')."

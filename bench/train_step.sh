#!/usr/bin/env bash
# One training step, side by side in one run: ft's loop (bench/train_step.cpp, with its fused CPU
# kernels and without) against the best a user writes in PyTorch (bench/train_step_ref.py:
# transformers' LlamaForCausalLM with torch AdamW as it comes, with AdamW(fused=True), and with
# fused AdamW + torch.compile), same torch build (the venv ft builds against), same threads, CPU,
# fp32, random-token batches. Median step and the process's peak resident memory. The qwen3-* and
# gemma3-* rows are the overhead and gemm shapes in those families: a config.json written here with
# transformers' config class, read by both sides (--config), so the two build the same model.
#   bench/train_step.sh [BUILD]   BENCH_STEPS (default 20), BENCH_THREADS (default nproc),
#                                 BENCH_CONFIGS (default all: overhead, mid, gemm, qwen3-overhead,
#                                 qwen3-gemm, gemma3-overhead, gemma3-gemm),
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
overhead_shape="--batch 1 --seq 64" gemm_shape="--batch 4 --seq 256"
declare -A configs=(
  [overhead]="overhead-bound (d=256, 2 layers, 64 tokens)|--hidden 256 --layers 2 --heads 4 --inter 688 --vocab 512 $overhead_shape"
  [mid]="d=256, 2 layers, 1024 tokens|--hidden 256 --layers 2 --heads 4 --inter 688 --vocab 512 --batch 8 --seq 128"
  [gemm]="GEMM-bound (d=1024, 2 layers, vocab 32000, 1024 tokens)|--hidden 1024 --layers 2 --heads 16 --inter 2752 --vocab 32000 $gemm_shape"
)
# Qwen3 and Gemma 3 at the overhead and GEMM shapes, GQA (kv heads = heads / 2), head_dim 64.
# Gemma 3: layers [sliding, full] with a 512-token window, longer than the sequence (not active),
# its own default tying (tied head), query_pre_attn_scalar = head_dim.
models=$(mktemp -d)
trap 'rm -rf "$models"' EXIT
"$FT_PYTHON" - "$models" <<'PY'
import sys
from transformers import Gemma3TextConfig, Qwen3Config
out = sys.argv[1]
shapes = {"overhead": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=688, vocab_size=512),
          "gemm": dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                       intermediate_size=2752, vocab_size=32000)}
for name, shape in shapes.items():
    common = dict(num_hidden_layers=2, head_dim=64, max_position_embeddings=4096, **shape)
    Qwen3Config(**common).save_pretrained(f"{out}/qwen3-{name}")
    Gemma3TextConfig(**common, sliding_window=512, query_pre_attn_scalar=64,
                     layer_types=["sliding_attention", "full_attention"]).save_pretrained(
                         f"{out}/gemma3-{name}")
PY
for family in qwen3 gemma3; do
  what=Qwen3
  [[ $family == gemma3 ]] && what="Gemma 3 (window 512 > seq: not active, tied head)"
  configs[$family-overhead]="$what overhead-bound (d=256, 2 layers, kv 2, 64 tokens)|--config $models/$family-overhead/config.json $overhead_shape"
  configs[$family-gemm]="$what GEMM-bound (d=1024, 2 layers, kv 8, vocab 32000, 1024 tokens)|--config $models/$family-gemm/config.json $gemm_shape"
done
echo "| model | ft | ft, unfused kernels | transformers + AdamW | + AdamW(fused=True) | + fused AdamW + torch.compile | ft / best |"
echo "|---|---|---|---|---|---|---|"
for key in ${BENCH_CONFIGS:-overhead mid gemm qwen3-overhead qwen3-gemm gemma3-overhead gemma3-gemm}; do
  [[ -v configs[$key] ]] ||
    { echo "train_step: BENCH_CONFIGS names '$key'; known: ${!configs[*]}" >&2; exit 2; }
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

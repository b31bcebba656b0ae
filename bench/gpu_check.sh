#!/usr/bin/env bash
# For a machine with NVIDIA GPUs: builds ft there, runs the gpu test (NCCL collectives on one GPU,
# a bf16 `ft train` on cuda:0), then times `ft train` on a small synthetic model in bf16 on one GPU
# (world size 1) and, when there are at least 2 GPUs, under `ft launch --nproc-per-node 2` (NCCL)
# with ddp and fsdp. Prints the median step time and tokens/s of each run (steps after the first
# BENCH_SKIP are counted). Nothing here has been run by this script's author: no GPU was available
# when it was written; treat its first run as its test.
#   bench/gpu_check.sh [BUILD]      BENCH_STEPS (default 30), BENCH_SKIP (default 5)
# Needs scripts/setup.sh to have run (the LibTorch venv with CUDA, $FT_CACHE/env.sh) and nvcc.
set -euo pipefail
build=${1:-build}
steps=${BENCH_STEPS:-30}
skip=${BENCH_SKIP:-5}
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}

command -v nvidia-smi >/dev/null || { echo "gpu_check: nvidia-smi not found: no NVIDIA driver here" >&2; exit 1; }
gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
((gpus > 0)) || { echo "gpu_check: nvidia-smi lists no GPU" >&2; exit 1; }
nvidia-smi -L

FT_WITH_CUDA=ON bash scripts/build.sh "$build"
ft=$build/bin/ft
[[ -f $build/lib/libft_cuda.so ]] || { echo "gpu_check: $build/lib/libft_cuda.so was not built" >&2; exit 1; }
"$ft" --version

echo "== gpu test (ctest -L gpu)"
(cd "$build" && ctest -L gpu --output-on-failure)

# A ~110M-parameter Llama shape: large enough that a step is GPU work rather than launch overhead,
# small enough for any GPU.
model=(--set model.vocab_size=32000 --set model.hidden_size=1024 --set model.intermediate_size=2816
       --set model.num_layers=8 --set model.num_heads=16 --set model.num_kv_heads=8
       --set model.max_seq_len=1024 --set data.seq_len=1024 --set train.micro_batch=8
       --set train.max_steps="$steps" --set train.log_every=10 --set precision.mode=bf16
       --set hardware.device=cuda --set train.lr=3e-4 --set train.warmup_steps=5)

# Median step time, tokens/s and peak GPU memory of metrics.jsonl after the first $skip steps.
report() {
  local label=$1 metrics=$2 ranks=$3 body median
  body=$(tail -n +"$((skip + 1))" "$metrics")
  [[ -n $body ]] || { echo "$label: metrics.jsonl has no step after the first $skip" >&2; return 1; }
  median=$(grep -o '"step_time_s":[0-9.eE+-]*' <<<"$body" | cut -d: -f2 | sort -g |
           awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }')
  awk -v label="$label" -v ranks="$ranks" -v median="$median" '
    { match($0, /"step_time_s":[0-9.eE+-]+/); sum += substr($0, RSTART + 14, RLENGTH - 14)
      match($0, /"input_tokens":[0-9]+/); tok += substr($0, RSTART + 15, RLENGTH - 15)
      if (match($0, /"cuda_peak_allocated_bytes":[0-9]+/)) {
        m = substr($0, RSTART + 28, RLENGTH - 28) + 0; if (m > peak) peak = m } }
    END { printf "%-32s median step %.4f s, %.0f tokens/s per rank, %.0f tokens/s in all, peak GPU memory %.2f GiB (rank 0)\n",
                 label, median, tok / sum, tok / sum * ranks, peak / 1073741824 }' <<<"$body"
}

out=$(mktemp -d)
echo "== ft train, 1 GPU (world size 1), bf16 -> $out/one"
"$ft" train --preset tiny-demo --output "$out/one" "${model[@]}" | tail -n 3
report "1 GPU, ddp (no communication)" "$out/one/metrics.jsonl" 1

# ZeRO-Offload on one GPU: masters, gradients and Adam moments in host memory, AdamW on the CPU.
echo "== ft train, 1 GPU, zero3 with offload_optimizer -> $out/one-offload"
"$ft" train --preset tiny-demo --output "$out/one-offload" "${model[@]}" \
  --set strategy.kind=zero3 --set strategy.zero3.offload_optimizer=true | tail -n 3
report "1 GPU, zero3, offload_optimizer" "$out/one-offload/metrics.jsonl" 1

if ((gpus >= 2)); then
  echo "== ft launch --nproc-per-node 2, fsdp cpu_offload over NCCL -> $out/two-offload"
  "$ft" launch --nproc-per-node 2 -- "$ft" train --preset tiny-demo --output "$out/two-offload" \
    "${model[@]}" --set strategy.kind=fsdp --set strategy.fsdp.cpu_offload=true | tail -n 3
  report "2 GPUs, fsdp cpu_offload, NCCL" "$out/two-offload/metrics.jsonl" 2
  for kind in ddp fsdp; do
    echo "== ft launch --nproc-per-node 2, $kind over NCCL, bf16 -> $out/two-$kind"
    "$ft" launch --nproc-per-node 2 -- "$ft" train --preset tiny-demo --output "$out/two-$kind" \
      "${model[@]}" --set strategy.kind="$kind" | tail -n 3
    report "2 GPUs, $kind, NCCL" "$out/two-$kind/metrics.jsonl" 2
  done
else
  echo "== 1 GPU only: the 2-rank NCCL runs need 2 GPUs"
fi
echo "runs kept in $out"

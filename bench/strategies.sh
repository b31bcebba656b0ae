#!/usr/bin/env bash
# Step time of the distributed strategies on CPU (Gloo on loopback): one rank against two ranks of
# ddp, zero3, fsdp FULL_SHARD and fsdp SHARD_GRAD_OP at the same global batch, with the share of
# the step each rank spends blocked on communication and the share of the communication that
# overlap hides.
#
# Method: every configuration is one `ft launch --standalone` job of `ft train` (preset tiny-demo,
# synthetic task, fp32, a model made bigger with --set model.*), BENCH_WARMUP untimed steps then
# BENCH_STEPS timed ones, read back from metrics.jsonl / metrics.rank<k>.jsonl. Step time is the
# median over the timed steps of the slowest rank's step_time_s; exposed communication is the
# median of comm.wait_s (the ranks' mean) over the median step. Each 2-rank configuration runs a
# second time with strategy.overlap_comm=false, where every collective is waited for as soon as it
# is issued, so that comm.wait_s is the whole communication time; hidden by overlap =
# 1 - wait (overlapped) / wait (not overlapped).
#
#   bench/strategies.sh [BUILD]   BUILD is the build folder holding bin/ft (default build)
#   BENCH_STEPS=N                 timed steps per run (default 6)
#   BENCH_WARMUP=N                untimed steps first (default 2)
#   BENCH_BATCH=N                 global batch in sequences of 128 tokens (default 8; even)
#   BENCH_THREADS=N               intra-op threads of each of the 2 ranks (default nproc / 2)
set -euo pipefail

build=${1:-build}
steps=${BENCH_STEPS:-6}
warmup=${BENCH_WARMUP:-2}
batch=${BENCH_BATCH:-8}
cores=$(nproc)
rank_threads=${BENCH_THREADS:-$((cores / 2 > 0 ? cores / 2 : 1))}
ft_bin="$build/bin/ft"

die() { printf 'strategies: error: %s\n' "$*" >&2; exit 1; }

[[ $steps =~ ^[1-9][0-9]*$ ]] || die "BENCH_STEPS must be a positive integer, got '$steps'"
[[ $warmup =~ ^[0-9]+$ ]] || die "BENCH_WARMUP must be a non-negative integer, got '$warmup'"
[[ $batch =~ ^[1-9][0-9]*$ && $((batch % 2)) == 0 ]] || die "BENCH_BATCH must be even, got '$batch'"
[[ $rank_threads =~ ^[1-9][0-9]*$ ]] || die "BENCH_THREADS must be a positive integer, got '$rank_threads'"
[[ -x $ft_bin ]] || die "$ft_bin not found or not executable: build first (make build), or pass the build folder as \$1"
command -v python3 >/dev/null || die "python3 is needed to read the metrics"

# Launch settings must come from this script, not from the caller's environment.
for v in $(compgen -e); do
  case $v in
    PET_* | SLURM_* | TORCHELASTIC_* | FT_* | MASTER_ADDR | MASTER_PORT | NNODES | NODE_RANK | \
      NPROC_PER_NODE | WORLD_SIZE | RANK | LOCAL_RANK) unset "$v" ;;
  esac
done

work=$(mktemp -d "${TMPDIR:-/tmp}/ft-bench-strategies.XXXXXX")
trap 'rm -rf "$work"' EXIT

# About 31 M parameters (125 MB in fp32): 4 layers of hidden 768, a 4096-symbol vocabulary (tied).
# Communication per step grows with the parameters and compute with parameters x tokens, so the
# share of communication depends on the tokens per rank; the size only sets how long the bench runs.
model=(model.hidden_size=768 model.intermediate_size=2048 model.num_layers=4 model.num_heads=12
       model.num_kv_heads=12 model.vocab_size=4096 model.max_seq_len=128)
common=(precision.mode=fp32 data.seq_len=128 train.max_steps=$((warmup + steps))
        train.log_every=1000 "${model[@]}")

# label|ranks|threads per rank|sequences per rank|settings. The half-batch row is one rank's share
# of a 2-rank step computed alone, with no communication: what a 2-rank step would take if
# communication were free and the two ranks did not slow each other down.
half="1 rank x $rank_threads thread(s), half batch"
configs=(
  "1 rank x 1 thread|1|1|$batch|strategy.kind=ddp"
  "1 rank x $((2 * rank_threads)) threads|1|$((2 * rank_threads))|$batch|strategy.kind=ddp"
  "$half|1|$rank_threads|$((batch / 2))|strategy.kind=ddp"
  "ddp|2|$rank_threads|$((batch / 2))|strategy.kind=ddp"
  "zero3|2|$rank_threads|$((batch / 2))|strategy.kind=zero3"
  "fsdp FULL_SHARD|2|$rank_threads|$((batch / 2))|strategy.kind=fsdp strategy.fsdp.sharding_strategy=FULL_SHARD"
  "fsdp SHARD_GRAD_OP|2|$rank_threads|$((batch / 2))|strategy.kind=fsdp strategy.fsdp.sharding_strategy=SHARD_GRAD_OP"
)

# Sets `cmd` to the command line of one job: make_cmd RANKS MICRO_BATCH SETTINGS OUTPUT
make_cmd() {
  local ranks=$1 micro=$2 sets=$3 out=$4 s
  cmd=("$ft_bin" launch --standalone --nproc-per-node "$ranks" --
       "$ft_bin" train --preset tiny-demo --output "$out")
  # shellcheck disable=SC2086  # $sets is a list of settings
  for s in "${common[@]}" train.micro_batch="$micro" $sets; do cmd+=(--set "$s"); done
}

# Runs one job; prints "median_step_s median_wait_s comm_bytes_per_rank_step parameters".
run_job() {
  local ranks=$1 threads=$2 micro=$3 sets=$4 tag=$5
  local out="$work/$tag"
  make_cmd "$ranks" "$micro" "$sets" "$out"
  if ! OMP_NUM_THREADS=$threads timeout -k 10 1200 "${cmd[@]}" >"$work/$tag.log" 2>&1; then
    { echo "strategies: $tag failed: OMP_NUM_THREADS=$threads ${cmd[*]}"; tail -n 30 "$work/$tag.log"; } >&2
    return 1
  fi
  python3 - "$out" "$ranks" "$warmup" "$work/$tag.log" <<'PY'
import json, re, statistics, sys
out, ranks, warmup, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
files = [f"{out}/metrics.jsonl"] if ranks == 1 else [f"{out}/metrics.rank{r}.jsonl" for r in range(ranks)]
recs = [[json.loads(l) for l in open(f) if l.strip()][warmup:] for f in files]
steps = [max(r[i]["step_time_s"] for r in recs) for i in range(len(recs[0]))]
waits = [sum(r[i]["comm"]["wait_s"] for r in recs) / ranks for i in range(len(recs[0]))]
c = recs[0][-1]["comm"]
comm_bytes = c["all_gather_bytes"] + c["reduce_scatter_bytes"] + c["all_reduce_bytes"]
params = re.search(r"ft train: (\d+) parameters", open(log).read()).group(1)
print(f"{statistics.median(steps):.4f} {statistics.median(waits):.4f} {comm_bytes} {params}")
PY
  rm -rf "$out"
}

echo "strategies: $warmup warm-up + $steps timed step(s) per run, global batch $batch x 128 tokens" >&2
# Other work on the machine shows in the numbers: the load average before and after is reported.
load_before=$(cut -d ' ' -f 1 /proc/loadavg)
declare -A step waits bytes step_serial waits_serial
params=0
n=0
for entry in "${configs[@]}"; do
  IFS='|' read -r label ranks threads micro sets <<<"$entry"
  n=$((n + 1))
  res=$(run_job "$ranks" "$threads" "$micro" "$sets" "run-$n")
  read -r s w b params <<<"$res"
  step[$label]=$s waits[$label]=$w bytes[$label]=$b
  printf 'strategies: %-22s step %s s, wait %s s (load %s)\n' "$label" "$s" "$w" "$(cut -d ' ' -f 1 /proc/loadavg)" >&2
  if ((ranks > 1)); then
    res=$(run_job "$ranks" "$threads" "$micro" "$sets strategy.overlap_comm=false" "serial-$n")
    read -r s w _ _ <<<"$res"
    step_serial[$label]=$s waits_serial[$label]=$w
    printf 'strategies: %-22s without overlap: step %s s, wait %s s\n' "$label" "$s" "$w" >&2
  fi
done

load_after=$(cut -d ' ' -f 1 /proc/loadavg)
one1="1 rank x 1 thread"
oneN="1 rank x $((2 * rank_threads)) threads"
ft_version=$("$ft_bin" --version | head -n 1)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
torch_lib=$(ldd "$ft_bin" 2>/dev/null | sed -n 's/.*=> \(.*libtorch_cpu.so\) .*/\1/p' | head -n 1)

echo "## Strategies on CPU: step time at 1 and 2 ranks, same global batch"
echo
echo "$ft_version; $cores CPU core(s) (${cpu:-unknown CPU}); $(uname -sr); $(date -u +%Y-%m-%d); libtorch: ${torch_lib:-unknown}."
echo "Model: $params parameters ($(awk -v p="$params" 'BEGIN { printf "%.0f", p * 4 / 1e6 }') MB in fp32), fp32; global batch $batch x 128 tokens; median of $steps step(s) after $warmup warm-up step(s); 2-rank runs use $rank_threads thread(s) per rank; load average (1 min) $load_before before, $load_after after."
echo "Exposed comm = comm.wait_s (mean of the ranks); without overlap = the same job with strategy.overlap_comm=false; hidden = 1 - exposed / comm without overlap."
echo "Collective MB = the metrics' all_gather_bytes (gathered) + reduce_scatter_bytes (input) + all_reduce_bytes; \"$half\" = one rank's share of a 2-rank step, alone, with no communication."
echo
echo "| configuration | median step (s) | speed-up vs $oneN | vs 1 rank x 1 thread | collective MB per rank per step | exposed comm (s) | exposed / step | comm without overlap (s) | step without overlap (s) | hidden by overlap |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for entry in "${configs[@]}"; do
  IFS='|' read -r label ranks _ _ _ <<<"$entry"
  awk -v l="$label" -v s="${step[$label]}" -v w="${waits[$label]}" -v b="${bytes[$label]}" \
    -v sn="${step[$oneN]}" -v s1="${step[$one1]}" -v ws="${waits_serial[$label]:-}" \
    -v ss="${step_serial[$label]:-}" -v half="$half" 'BEGIN {
      if (l == half) {
        printf "| %s | %.3f | - | - | - | - | - | - | - | - |\n", l, s
      } else if (ws == "") {
        printf "| %s | %.3f | %.2f | %.2f | - | - | - | - | - | - |\n", l, s, sn / s, s1 / s
      } else {
        hidden = ws > 0 ? 1 - w / ws : 0
        printf "| %s (2 ranks) | %.3f | %.2f | %.2f | %.0f | %.3f | %.0f%% | %.3f | %.3f | %.0f%% |\n",
          l, s, sn / s, s1 / s, b / 1e6, w, 100 * w / s, ws, ss, 100 * hidden
      }
    }'
done
echo
awk -v w="${waits[ddp]}" -v s="${step[ddp]}" 'BEGIN {
  f = 100 * w / s
  printf "Target (ddp exposed communication <= 20%% of the step): %.0f%%, %s.\n", f, f <= 20 ? "met" : "not met"
}'
echo
echo "Command: \`BENCH_STEPS=$steps BENCH_WARMUP=$warmup BENCH_BATCH=$batch BENCH_THREADS=$rank_threads bench/strategies.sh $build\`. Each job runs as (OMP_NUM_THREADS set per row):"
echo
echo '```'
make_cmd 2 $((batch / 2)) "strategy.kind=ddp" OUT
echo "${cmd[*]}"
echo '```'

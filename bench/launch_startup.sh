#!/usr/bin/env bash
# Launcher start-up time: from starting the launch to every worker running a trivial program, for
# `ft launch` against torchrun from the same torch install, on loopback:
#   1 node x 4 workers  (ft --standalone, torchrun --standalone)
#   2 nodes x 2 workers (two launchers on 127.0.0.1, node ranks 0 and 1, a fixed free port)
#
# Method: each worker runs `sh -c 'date +%s.%N >> STAMPS'`. The time of one run is
# max(worker stamps) - the wall clock read just before the first launcher is started. Runs of ft and
# torchrun alternate; each configuration runs BENCH_REPS times (default 10) after one untimed warm-up
# run per launcher, and the script prints the median and the minimum as a Markdown table.
#
#   bench/launch_startup.sh [BUILD]      BUILD is the build folder holding bin/ft (default build)
#   BENCH_REPS=N                         timed runs per configuration (default 10)
#   BENCH_TORCHRUN="cmd ..."             torchrun command to use (default: torchrun next to FT_PYTHON,
#                                        or FT_PYTHON -m torch.distributed.run when that cannot run)
#   FT_PYTHON=/path/to/python            the Python whose torch provides torchrun (default: from
#                                        $FT_CACHE/env.sh, written by scripts/setup.sh)
set -euo pipefail

build=${1:-build}
reps=${BENCH_REPS:-10}
ft_bin="$build/bin/ft"
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}

die() { printf 'launch_startup: error: %s\n' "$*" >&2; exit 1; }

[[ $reps =~ ^[1-9][0-9]*$ ]] || die "BENCH_REPS must be a positive integer, got '$reps'"
[[ -x $ft_bin ]] || die "$ft_bin not found or not executable: build first (make build), or pass the build folder as \$1"
ft_bin=$(cd "$(dirname "$ft_bin")" && pwd)/ft

user_python=${FT_PYTHON:-}
if [[ -f $FT_CACHE/env.sh ]]; then
  # shellcheck disable=SC1091
  source "$FT_CACHE/env.sh"
fi
FT_PYTHON=${user_python:-${FT_PYTHON:-}}
[[ -n $FT_PYTHON ]] || die "FT_PYTHON is not set and $FT_CACHE/env.sh is missing: run scripts/setup.sh (make deps)"
"$FT_PYTHON" -c 'import torch.distributed.run' 2>/dev/null ||
  die "'$FT_PYTHON' cannot import torch.distributed.run"

# torchrun from the same install. The console script's #! line names the Python it was installed
# with; when that Python is gone (a moved venv), run the same entry point through FT_PYTHON.
if [[ -n ${BENCH_TORCHRUN:-} ]]; then
  read -r -a torchrun <<<"$BENCH_TORCHRUN"
else
  script="$(dirname "$FT_PYTHON")/torchrun"
  interp=""
  [[ -f $script ]] && interp=$(head -n 1 "$script" | sed -n 's/^#!\([^ ]*\).*/\1/p')
  if [[ -x $script && -n $interp && -x $interp ]]; then
    torchrun=("$script")
  else
    torchrun=("$FT_PYTHON" -m torch.distributed.run)
  fi
fi

# A launch configuration must not be changed by the caller's environment (ft and torchrun read
# PET_*, plain NNODES/MASTER_* and SLURM_* variables).
for v in $(compgen -e); do
  case $v in
    PET_* | SLURM_* | NNODES | NODE_RANK | MASTER_ADDR | MASTER_PORT | NPROC_PER_NODE | WORLD_SIZE | RANK | \
      LOCAL_RANK | FT_NNODES | FT_NPROC_PER_NODE | FT_NODE_RANK | FT_MASTER_ADDR | FT_MASTER_PORT | \
      FT_RDZV_* | FT_STANDALONE | FT_MAX_RESTARTS | FT_MONITOR_INTERVAL | FT_LOG_DIR | \
      FT_ADVERTISE_ADDR | FT_TERM_GRACE | FT_ROLE | FT_DRY_RUN | TORCHELASTIC_*)
      unset "$v" ;;
  esac
done

work=$(mktemp -d "${TMPDIR:-/tmp}/ft-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT

free_port() {
  "$FT_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Reads the wall clock as seconds with microseconds (bash 5: no fork).
now() {
  if [[ -n ${EPOCHREALTIME:-} ]]; then printf '%s\n' "${EPOCHREALTIME/,/.}"; else date +%s.%N; fi
}

# shellcheck disable=SC2016  # expanded by the worker's sh, not here
worker=(sh -c 'date +%s.%N >> "$FT_BENCH_STAMPS"')
export FT_BENCH_STAMPS

# Sets `cmd` to the command line of one launcher: make_cmd LAUNCHER CONFIG NODE_RANK PORT
make_cmd() {
  local launcher=$1 config=$2 node=$3 port=$4
  case $launcher/$config in
    ft/1x4) cmd=("$ft_bin" launch --standalone --nproc-per-node 4 --) ;;
    ft/2x2) cmd=("$ft_bin" launch --nnodes 2 --node-rank "$node" --nproc-per-node 2
                 --master-addr 127.0.0.1 --master-port "$port" --) ;;
    torchrun/1x4) cmd=("${torchrun[@]}" --standalone --nproc-per-node 4 --no-python) ;;
    torchrun/2x2) cmd=("${torchrun[@]}" --nnodes 2 --node-rank "$node" --nproc-per-node 2
                       --master-addr 127.0.0.1 --master-port "$port" --no-python) ;;
  esac
}

# Runs one launch of LAUNCHER in CONFIG; prints the seconds until the last worker ran.
run_once() {
  local launcher=$1 config=$2 tag=$3
  local nodes=1 workers=4 port=0
  [[ $config == 2x2 ]] && nodes=2 && port=$(free_port)
  FT_BENCH_STAMPS="$work/$tag.stamps"
  : >"$FT_BENCH_STAMPS"
  local -a pids=() cmd
  local start node
  start=$(now)
  for ((node = 0; node < nodes; ++node)); do
    make_cmd "$launcher" "$config" "$node" "$port"
    timeout -k 10 120 "${cmd[@]}" "${worker[@]}" >"$work/$tag.node$node.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  local got
  got=$(wc -l <"$FT_BENCH_STAMPS")
  if ((rc != 0 || got != workers)); then
    {
      echo "launch_startup: $launcher $config failed (exit $rc, $got of $workers workers ran)"
      for ((node = 0; node < nodes; ++node)); do
        make_cmd "$launcher" "$config" "$node" "$port"
        echo "--- node $node: ${cmd[*]} ${worker[*]}"
        tail -n 30 "$work/$tag.node$node.log"
      done
    } >&2
    return 1
  fi
  awk -v start="$start" 'BEGIN { m = 0 } { if ($1 > m) m = $1 } END { printf "%.4f\n", m - start }' \
    "$FT_BENCH_STAMPS"
}

# Median and minimum of the numbers in a file, as "median min".
stats() {
  sort -g "$1" | awk '{ v[NR] = $1 } END {
    med = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf "%.3f %.3f\n", med, v[1] }'
}

configs=(1x4 2x2)
launchers=(ft torchrun)
echo "launch_startup: warm-up, then $reps timed run(s) per configuration" >&2
for l in "${launchers[@]}"; do run_once "$l" 1x4 "warmup-$l" >/dev/null; done
for c in "${configs[@]}"; do
  for l in "${launchers[@]}"; do : >"$work/$l-$c.times"; done
  for ((i = 1; i <= reps; ++i)); do
    for l in "${launchers[@]}"; do
      t=$(run_once "$l" "$c" "$l-$c-$i")
      echo "$t" >>"$work/$l-$c.times"
      printf 'launch_startup: %-8s %s run %d/%d: %s s\n' "$l" "$c" "$i" "$reps" "$t" >&2
    done
  done
done

ft_version=$("$ft_bin" --version | head -n 1)
torch_version=$("$FT_PYTHON" -c 'import torch; print(torch.__version__)')
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)

echo "## Launcher start-up: time from starting the launch to every worker running"
echo
echo "$ft_version; torchrun from torch $torch_version; $(nproc) CPU core(s) (${cpu:-unknown CPU}); $(uname -sr); $(date -u +%Y-%m-%d)."
echo "Median and minimum of $reps run(s) each, in seconds; ratio = ft median / torchrun median."
echo
echo "| configuration | ft median (s) | ft min (s) | torchrun median (s) | torchrun min (s) | ft / torchrun |"
echo "|---|---|---|---|---|---|"
for c in "${configs[@]}"; do
  read -r ft_med ft_min < <(stats "$work/ft-$c.times")
  read -r tr_med tr_min < <(stats "$work/torchrun-$c.times")
  ratio=$(awk -v a="$ft_med" -v b="$tr_med" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
  label="1 node x 4 workers"
  [[ $c == 2x2 ]] && label="2 nodes x 2 workers (loopback)"
  echo "| $label | $ft_med | $ft_min | $tr_med | $tr_min | $ratio |"
done
echo
echo "Command: \`BENCH_REPS=$reps bench/launch_startup.sh $build\`. Each worker runs \`${worker[*]:0:2} '${worker[2]}'\`; the launchers run as:"
echo
echo '```'
for c in "${configs[@]}"; do
  for l in "${launchers[@]}"; do
    if [[ $c == 2x2 ]]; then
      for node in 0 1; do make_cmd "$l" "$c" "$node" PORT && echo "${cmd[*]} sh -c ..."; done
    else
      make_cmd "$l" "$c" 0 0 && echo "${cmd[*]} sh -c ..."
    fi
  done
done
echo '```'

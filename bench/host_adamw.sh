#!/usr/bin/env bash
# The host optimizer step (issue 32), side by side in one run on fp32 buffers of the same size and
# the same threads: ft's AdamW (bench/host_adamw.cpp: alone, with the clip's factor and the
# gradients' zeroing in its pass as the trainer runs it, and with the bf16 copy-out as a separate
# pass or inside the update's pass) against torch.optim.AdamW(fused=True) and DeepSpeed's
# DeepSpeedCPUAdam (bench/host_adamw_ref.py). Prints one table: ns per parameter (median of the
# timed steps), the bytes each variant moves per parameter, and ft's against the faster anchor.
#   bench/host_adamw.sh [BUILD]   BENCH_PARAMS (default 67108864), BENCH_STEPS (10),
#                                 BENCH_THREADS (2), BENCH_REPEATS (1: each side that many
#                                 times, interleaved, the best median of each variant kept)
# Needs deepspeed in the reference venv (pip install deepspeed==0.19.8; its CPU Adam op builds on
# first use, about half a minute): without it DeepSpeed's rows are missing and the script says so.
set -euo pipefail
build=${1:-build}
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}
# shellcheck disable=SC1091
source "$FT_CACHE/env.sh"
n=${BENCH_PARAMS:-67108864}
steps=${BENCH_STEPS:-10}
threads=${BENCH_THREADS:-2}
repeats=${BENCH_REPEATS:-1}
[[ -x $build/bin/ft_bench_host_adamw ]] ||
  { echo "host_adamw: $build/bin/ft_bench_host_adamw is not built (bash scripts/build.sh $build ft_bench_host_adamw)" >&2; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
export OMP_NUM_THREADS=$threads
for ((r = 0; r < repeats; r++)); do
  "$build/bin/ft_bench_host_adamw" --params "$n" --steps "$steps" >> "$out"
  "$FT_PYTHON" bench/host_adamw_ref.py --params "$n" --steps "$steps" --threads "$threads" \
    2> >(grep -v 'real_accelerator\|cpp_extension' >&2) >> "$out" ||
    echo "host_adamw: the reference stopped early (exit $?); its remaining rows are missing" >&2
done
"$FT_PYTHON" - "$out" <<'PY'
import json, sys
best = {}
for line in open(sys.argv[1]):
    if not line.startswith('{"impl"'):
        continue  # (DeepSpeed logs to stdout)
    r = json.loads(line)
    if r["impl"] not in best or r["ns_per_param"] < best[r["impl"]]["ns_per_param"]:
        best[r["impl"]] = r
rows = list(best.values())
print(f"{rows[0]['params']} parameters, fp32, {rows[0]['threads']} threads; ns per parameter (best median)")
print(f"{'implementation':<62} {'ns/param':>9} {'B/param':>8} {'GB/s':>6}")
for r in rows:
    print(f"{r['impl']:<62} {r['ns_per_param']:>9.3f} {r['bytes_per_param']:>8} "
          f"{r['bytes_per_param'] / r['ns_per_param']:>6.1f}")
def ns(name):
    return best[name]["ns_per_param"] if name in best else None
anchors = [x for x in (ns("torch AdamW(fused=True)"), ns("DeepSpeedCPUAdam")) if x]
if anchors and ns("ft AdamW alone (as the anchors: no clip factor, no zeroing)"):
    a = ns("ft AdamW alone (as the anchors: no clip factor, no zeroing)") / min(anchors)
    print(f"ft alone / the faster anchor alone: {a:.2f}x (target at most 1.0x, goal 0.8x)")
clip = ns("torch AdamW(fused=True) + the clip's scaling pass")
if clip and ns("ft AdamW (clip factor and zeroing in the pass)"):
    print(f"ft as the trainer runs it / torch fused + the clip's pass: "
          f"{ns('ft AdamW (clip factor and zeroing in the pass)') / clip:.2f}x")
PY

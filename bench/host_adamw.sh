#!/usr/bin/env bash
# The host optimizer step (issue 32), side by side on fp32 buffers of the same size and the same
# threads: ft's AdamW (bench/host_adamw.cpp: alone, with the clip's factor and the gradients'
# zeroing in its pass as the trainer runs it, and with the bf16 copy-out as a separate pass or
# inside the update's pass) against torch.optim.AdamW(fused=True) on the same buffers in the same
# process, and torch's fused AdamW against DeepSpeed's DeepSpeedCPUAdam on the same buffers in
# another (bench/host_adamw_ref.py). Both programs interleave their variants round by round, since
# this machine's memory speed moves by up to 2x from one minute to the next, and compare them
# within each round. Prints one table (ns per parameter, the median over the rounds, and the
# bytes each variant moves per parameter), the ratios, and ft's against the faster anchor: to
# torch's directly, to DeepSpeed's through torch's (ft / torch x torch / DeepSpeed).
#   bench/host_adamw.sh [BUILD]   BENCH_PARAMS (default 67108864), BENCH_ROUNDS (15),
#                                 BENCH_THREADS (2), BENCH_REPEATS (1: each program that many
#                                 times, the median of each ratio over them kept)
# DeepSpeed comes from the reference venv, where `make bench` installs it (FT_SETUP=bench
# scripts/setup.sh; its CPU Adam op builds on first use, about half a minute): without it
# DeepSpeed's rows are missing and the script says so.
set -euo pipefail
build=${1:-build}
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}
# shellcheck disable=SC1091
source "$FT_CACHE/env.sh"
n=${BENCH_PARAMS:-67108864}
rounds=${BENCH_ROUNDS:-15}
threads=${BENCH_THREADS:-2}
repeats=${BENCH_REPEATS:-1}
[[ -x $build/bin/ft_bench_host_adamw ]] ||
  { echo "host_adamw: $build/bin/ft_bench_host_adamw is not built (bash scripts/build.sh $build ft_bench_host_adamw)" >&2; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
export OMP_NUM_THREADS=$threads
for ((r = 0; r < repeats; r++)); do
  "$build/bin/ft_bench_host_adamw" --params "$n" --rounds "$rounds" | sed 's/^{/{"program": "ft", /' >> "$out"
  "$FT_PYTHON" bench/host_adamw_ref.py --params "$n" --rounds "$rounds" --threads "$threads" \
    2> >(grep -v 'real_accelerator\|cpp_extension' >&2) | sed 's/^{/{"program": "ref", /' >> "$out" ||
    echo "host_adamw: the reference stopped early (exit $?); its remaining rows are missing" >&2
done
"$FT_PYTHON" - "$out" <<'PY'
import json, statistics, sys
rows, ratios = {}, {}
for line in open(sys.argv[1]):
    if not line.startswith('{"program"'):
        continue  # (DeepSpeed logs to stdout)
    r = json.loads(line)
    if "impl" in r:
        rows.setdefault((r["program"], r["impl"]), []).append(r)
    else:
        ratios.setdefault(r["ratio"], []).append(r)
first = next(iter(rows.values()))[0]
print(f"{first['params']} parameters, fp32, {first['threads']} threads, {first['rounds']} rounds; "
      "ns per parameter: the median over the rounds (over the repeats, the median of those)")
print(f"{'implementation':<62} {'ns/param':>9} {'B/param':>8} {'GB/s':>6}  program")
for (prog, impl), rs in rows.items():
    ns = statistics.median(r["ns_per_param"] for r in rs)
    b = rs[0]["bytes_per_param"]
    where = "ft_bench_host_adamw" if prog == "ft" else "host_adamw_ref.py"
    print(f"{impl:<62} {ns:>9.3f} {b:>8} {b / ns:>6.1f}  {where}")
print("ratios within each round (median over the rounds; its range over the rounds):")
value = {}
for name, rs in ratios.items():
    value[name] = statistics.median(r["value"] for r in rs)
    lo, hi = min(r["min"] for r in rs), max(r["max"] for r in rs)
    print(f"  {name}: {value[name]:.3f} ({lo:.2f}-{hi:.2f})")
ALONE = "ft AdamW alone (as the anchors: no clip factor, no zeroing)"
TORCH, DS = "torch AdamW(fused=True)", "DeepSpeedCPUAdam"
ft_torch = value.get(f"{ALONE} / {TORCH}")
torch_ds = value.get(f"{TORCH} / {DS}")
if ft_torch is not None:
    worst = ft_torch
    if torch_ds is not None:
        ft_ds = ft_torch * torch_ds
        worst = max(ft_torch, ft_ds)
        print(f"ft alone / DeepSpeedCPUAdam, through torch's: {ft_ds:.3f}")
    print(f"ft alone / the faster anchor alone: {worst:.2f}x (target at most 1.0x, goal 0.8x)")
PY

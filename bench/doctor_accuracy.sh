#!/usr/bin/env bash
# The step-time model of `ft doctor --preset` against the step time `ft train` measures, for ddp,
# zero3 and fsdp, on one node (2 ranks) and on two nodes (1 rank each) joined by a link limited to
# 200 Mbit/s (tc's token bucket) and by the same link unlimited. The two nodes are network
# namespaces on one bridge, as in tests/doctor/doctor_netns_test.cpp; needs root and iproute2. Each
# rank computes on one thread (OMP_NUM_THREADS=1, what `ft launch --nproc-per-node 2` gives its
# workers too), so that the two "nodes" of this one machine do not oversubscribe its cores.
#   bench/doctor_accuracy.sh [BUILD_DIR]
# Prints one Markdown row per case: predicted and measured step (median of steps 3..12), the error,
# the predicted efficiency, and the cross-node bus bandwidth the doctor measured.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
ft=$(realpath "$build/bin/ft")
[[ $EUID == 0 ]] || { echo "bench/doctor_accuracy.sh: needs root (ip netns, tc)" >&2; exit 2; }
work=$(mktemp -d)
tag=ftb$$
cleanup() {
  for i in 0 1; do ip netns del "${tag}n$i" 2>/dev/null || true; done
  ip netns del "${tag}sw" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "${tag}sw"
ip -n "${tag}sw" link set lo up
ip -n "${tag}sw" link add br0 type bridge
ip -n "${tag}sw" link set br0 up
for i in 0 1; do
  ip netns add "${tag}n$i"
  ip link add "${tag}e$i" netns "${tag}n$i" type veth peer name "${tag}p$i" netns "${tag}sw"
  ip -n "${tag}sw" link set "${tag}p$i" master br0 up
  ip -n "${tag}n$i" addr add "10.78.0.$((i + 1))/24" dev "${tag}e$i"
  ip -n "${tag}n$i" link set "${tag}e$i" up
  ip -n "${tag}n$i" link set lo up
done
limit() {  # limit RATE | limit ""
  for i in 0 1; do
    if [[ -z $1 ]]; then
      ip netns exec "${tag}n$i" tc qdisc del dev "${tag}e$i" root 2>/dev/null || true
    else
      ip netns exec "${tag}n$i" tc qdisc replace dev "${tag}e$i" root tbf rate "$1" burst 256kb latency 200ms
    fi
  done
}
# Runs `ft launch` with the program after the layout: "1x2" on this host, "2x1" on both namespaces.
launch() {
  local layout=$1 log=$2
  shift 2
  if [[ $layout == 1x2 ]]; then
    "$ft" launch --nproc-per-node 2 --master-port 29731 -- "$@" >"$log" 2>&1
  else
    for i in 0 1; do
      OMP_NUM_THREADS=1 ip netns exec "${tag}n$i" "$ft" launch --nnodes 2 --nproc-per-node 1 --master-addr 10.78.0.1 \
        --master-port 29500 --rdzv-timeout 60 -- "$@" >"$log.$i" 2>&1 &
    done
    wait
  fi
}

echo "| strategy | layout | link | predicted step | measured step | error | predicted compute + optimizer / exposed comm | measured compute + optimizer / exposed comm | predicted efficiency | cross-node bus bandwidth |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for strategy in ddp zero3 fsdp; do
  sets=(--set "strategy.kind=$strategy")
  [[ $strategy == zero3 ]] && sets+=(--set strategy.zero3.param_persistence_threshold=0)
  for case in 1x2 2x1-200mbit 2x1-unlimited; do
    layout=${case%%-*}
    link=${case#*-}
    [[ $case == 1x2 ]] && link="-"
    if [[ $link == 200mbit ]]; then limit 200mbit; else limit ""; fi
    name=$strategy-$case
    launch "$layout" "$work/$name.doctor.log" "$ft" doctor --preset tiny-demo "${sets[@]}" \
      --max-size 4MiB --json "$work/$name.json"
    launch "$layout" "$work/$name.train.log" "$ft" train --preset tiny-demo "${sets[@]}" \
      --set train.max_steps=12 --set train.log_every=12 --output "$work/$name-run"
    python3 - "$work/$name.json" "$work/$name-run/metrics.jsonl" "$strategy" "$layout" "$link" <<'PY'
import json, statistics, sys
doc, metrics, strategy, layout, link = sys.argv[1:]
d = json.load(open(doc))
p = d["prediction"]
recs = [json.loads(l) for l in open(metrics)][2:]
measured = statistics.median(r["step_time_s"] for r in recs)
mc = statistics.median(r["time"]["compute_s"] + r["time"]["optimizer_s"] for r in recs)
mx = statistics.median(r["time"]["comm_s"] for r in recs)
bw = "-"
if layout == "2x1":
    bw = "%.1f MB/s" % (d["collectives"]["world"]["all-reduce"][-1]["busbw_bytes_per_s"] / 1e6)
print("| %s | %s | %s | %.1f ms | %.1f ms | %+.0f%% | %.1f / %.1f ms | %.1f / %.1f ms | %.0f%% | %s |" % (
    strategy, layout.replace("x", " node x ") + " rank(s)", link, p["step_s"] * 1e3,
    measured * 1e3, 100 * (p["step_s"] - measured) / measured,
    (p["compute_s"] + p["optimizer_s"]) * 1e3, p["exposed_s"] * 1e3, mc * 1e3, mx * 1e3,
    100 * p["efficiency"], bw))
PY
  done
done

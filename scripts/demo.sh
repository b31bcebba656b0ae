#!/usr/bin/env bash
# `make demo`: a real multi-node launch on this machine. Two launchers (node ranks 0 and 1) rendezvous
# over TCP on loopback, each starts 2 workers, and all 4 do a Gloo all-reduce (`ft comm-check`).
# The training runtime replaces this with a fine-tune when it lands.
set -euo pipefail
build=${1:-build}
ft="$build/bin/ft"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "== ft demo: 2 nodes x 2 workers on 127.0.0.1:$port, Gloo all-reduce across all 4 =="
common=(--nnodes 2 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" --rdzv-timeout 60)
"$ft" launch "${common[@]}" --node-rank 1 -- "$ft" comm-check &
node1=$!
"$ft" launch "${common[@]}" --node-rank 0 -- "$ft" comm-check
wait "$node1"
echo "== demo finished: every rank printed sum = 10 (1+2+3+4) =="

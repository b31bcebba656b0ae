#!/usr/bin/env bash
# `make demo`: a real fine-tune on this machine's CPU. `ft launch` starts one worker that runs
# `ft train --preset tiny-demo`: a 2-layer Llama-shaped model, randomly initialised, learns ft's
# built-in synthetic instruction task (map each prompt symbol through a secret permutation).
# The demo passes when the mean token loss of the last 10 steps is below 1.0 (it starts near 5.8,
# ln of the vocabulary).
set -euo pipefail
build=${1:-build}
ft="$build/bin/ft"
out="$build/demo/run-$(date +%Y%m%d-%H%M%S)"
threshold=1.0
echo "== ft demo: fine-tune tiny-demo on the built-in synthetic task (CPU), output in $out =="
"$ft" launch --standalone --nproc-per-node 1 --preset tiny-demo --output "$out"
final=$(tail -n 10 "$out/metrics.jsonl" | python3 -c '
import json, sys
losses = [json.loads(l)["loss"] for l in sys.stdin if l.strip()]
print(f"{sum(losses) / len(losses):.4f}")')
first=$(head -n 1 "$out/metrics.jsonl" | python3 -c 'import json, sys; print("%.4f" % json.load(sys.stdin)["loss"])')
echo "== loss: first step $first, mean of the last 10 steps $final (threshold $threshold) =="
python3 -c "import sys; sys.exit(0 if $final < $threshold else 1)" || {
  echo "demo FAILED: the loss did not fall below $threshold" >&2
  exit 1
}
echo "== demo passed; the model is in $out/final (Hugging Face safetensors + config.json) =="
echo "== the run's report (open it in a browser): $out/report.html =="

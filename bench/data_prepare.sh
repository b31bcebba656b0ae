#!/usr/bin/env bash
# ft data prepare's throughput (issue 14): a JSONL of chat records of at least BENCH_MB megabytes
# (default 500; varied lengths and text, generated once into BENCH_DIR), tokenized with the Llama 3
# fixture tokenizer (tests/tokenizer/fixtures/llama3: Llama 3's pre-tokenizer and byte-level BPE
# with a small vocabulary) and the llama3 template, on all cores; then ft train's start on it with
# and without the cache (time to the first step line).
#   bench/data_prepare.sh [BUILD]     BENCH_MB (500), BENCH_DIR (/tmp/ft-bench-data)
set -euo pipefail
build=${1:-build}
mb=${BENCH_MB:-500}
dir=${BENCH_DIR:-/tmp/ft-bench-data}
tok=tests/tokenizer/fixtures/llama3/tokenizer.json
data=$dir/chat-${mb}mb.jsonl
mkdir -p "$dir"
if [[ ! -s $data ]]; then
  echo "[bench] writing $data ($mb MB of chat records)" >&2
  python3 - "$data" "$mb" <<'PY'
import json, random, sys
path, mb = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
words = ("the of and to in is was for on that with as by at from model data train token loss "
         "naïve café 東京 データ 모델 привет مرحبا नमस्ते 3.14 2026 ok? yes! (x) [y] {z} :-) 🙂").split()
def text(n): return " ".join(rng.choice(words) for _ in range(n))
with open(path, "w", encoding="utf-8") as f:
    size = 0
    while size < mb * 1_000_000:
        turns = [{"role": "system", "content": text(rng.randint(3, 20))}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": text(rng.randint(5, 120))},
                      {"role": "assistant", "content": text(rng.randint(5, 300))}]
        line = json.dumps({"messages": turns}, ensure_ascii=False) + "\n"
        f.write(line)
        size += len(line.encode())
PY
fi
common=(--data "$data" --tokenizer "$tok" --set model.vocab_size=1152 --set data.format=chat
        --set data.template=llama3)
rm -rf "$data.ftcache"
echo "[bench] ft data prepare on $(nproc) cores" >&2
/usr/bin/time -f "[bench] prepare: %e s wall, %M KiB peak RSS" "$build/bin/ft" data prepare "${common[@]}"
ls -l "$data.ftcache"
# ft train's start: tokenizing the whole file to count the epoch's rows (train.max_steps=0), with
# and without the cache; a tiny fraction of an epoch of a tiny model.
for cache in with without; do
  out=$(mktemp -d)
  extra=(); [[ $cache == without ]] && extra=(--data-cache "$out/none")
  start=$(date +%s.%N)
  "$build/bin/ft" train --preset tiny-demo --output "$out/run" "${common[@]}" "${extra[@]}" \
    --set train.max_steps=0 --set train.epochs=0.00001 --set data.seq_len=256 >"$out/log" 2>&1
  echo "[bench] ft train (epochs: the rows counted) $cache the cache: $(echo "$(date +%s.%N) - $start" | bc) s"
  rm -rf "$out"
done

#!/usr/bin/env bash
# Reading Parquet (issue 30): ft's peak resident memory and `ft data prepare`'s throughput on a
# Parquet file of text records of about BENCH_MB megabytes (default 2000), against the same records
# as JSONL. The files are written once into BENCH_DIR by pyarrow (FT_PYTHON's; row groups of 16,384
# records, about 45 MB of text each; pages compressed with BENCH_COMPRESSION, default none, so that
# the file is as large as its text: the generated text repeats paragraphs, which snappy shrinks to a
# third) and the records are tokenized with the Llama 3 fixture tokenizer on all cores.
#   bench/data_files.sh [BUILD]     BENCH_MB (2000), BENCH_DIR (/tmp/ft-bench-files)
# Prints, per file: ft data prepare's line (records, tokens, tokens/s) and its wall time, CPU time
# and peak RSS (GNU time), then the same for `ft data show -n 0` (the statistics: every record read
# once). On a shared machine compare the CPU seconds: wall time follows the other load.
set -euo pipefail
build=${1:-build}
mb=${BENCH_MB:-2000}
dir=${BENCH_DIR:-/tmp/ft-bench-files}
compression=${BENCH_COMPRESSION:-none}
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}
# shellcheck disable=SC1091
[[ -n ${FT_PYTHON:-} ]] || source "$FT_CACHE/env.sh"
tok=tests/tokenizer/fixtures/llama3/tokenizer.json
base=$dir/text-${mb}mb-$compression
mkdir -p "$dir"
if [[ ! -s $base.parquet || ! -s $base.jsonl ]]; then
  echo "[bench] writing $base.parquet and $base.jsonl ($mb MB of text records each)" >&2
  "$FT_PYTHON" - "$base" "$mb" "$compression" <<'PY'
import json, random, sys
import pyarrow as pa, pyarrow.parquet as pq
base, mb, compression = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = random.Random(0)
words = ("the of and to in is was for on that with as by at from model data train token loss "
         "naïve café 東京 データ 모델 привет مرحبا नमस्ते 3.14 2026 ok? yes! (x) [y] {z} :-) 🙂").split()
# Paragraphs drawn once; a record is a numbered choice of them (2-3 KB), so records all differ.
paras = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 200))) for _ in range(4000)]
size, n, rows = 0, 0, 16384
schema = pa.schema([("text", pa.string())])
with pq.ParquetWriter(base + ".parquet", schema, compression=compression) as w, open(base + ".jsonl", "w") as j:
    while size < mb * 1_000_000:
        batch = []
        for _ in range(rows):
            batch.append(f"Document {n}. " + "\n".join(rng.choice(paras) for _ in range(rng.randint(1, 8))))
            n += 1
        w.write_table(pa.table({"text": batch}, schema=schema))
        text = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in batch)
        j.write(text)
        size += len(text.encode())
print(f"{n} records", file=sys.stderr)
PY
fi
ls -l "$base.parquet" "$base.jsonl"
common=(--tokenizer "$tok" --set model.vocab_size=1152 --set data.format=text)
for ext in parquet jsonl; do
  cache=$dir/cache-$ext
  rm -rf "$cache"
  echo "[bench] ft data prepare --data $base.$ext on $(nproc) cores" >&2
  /usr/bin/time -f "[bench] $ext prepare: %e s wall, %U s user + %S s sys, %M KiB peak RSS" \
    "$build/bin/ft" data prepare --data "$base.$ext" --cache-dir "$cache" "${common[@]}"
  rm -rf "$cache"
  echo "[bench] ft data show -n 0 --data $base.$ext (statistics, no cache)" >&2
  /usr/bin/time -f "[bench] $ext show: %e s wall, %U s user + %S s sys, %M KiB peak RSS" \
    "$build/bin/ft" data show -n 0 --data "$base.$ext" "${common[@]}" | head -4
done

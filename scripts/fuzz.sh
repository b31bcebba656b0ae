#!/usr/bin/env bash
# `make fuzz`: builds the libFuzzer harnesses of tests/fuzz/ into build-fuzz/ (clang, ASan + UBSan,
# every ft library instrumented) and runs each for FUZZ_SECONDS on a copy of its seed corpus.
# Prints each harness's executions and result; exits 1 if any harness found a crash, a hang or an
# out-of-memory, and names the file that reproduces it (`build-fuzz/bin/NAME_fuzz FILE`).
#
#   scripts/fuzz.sh [SECONDS] [NAME...]   seconds per harness (default $FUZZ_SECONDS, else 60);
#                                         NAME: only these harnesses (e.g. tokenizer store)
# The corpus grows in build-fuzz/corpus/NAME/ (kept between runs); tests/fuzz/corpus/ is only read.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-${FUZZ_SECONDS:-60}}
shift || true
build=build-fuzz
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd)}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# Objects compiled with the precompiled ATen header (ft_aten_pch) are cached too.
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}

log() { printf '[fuzz] %s\n' "$*"; }
# Runs "$@" and passes its output through; after 20 s without a line says it is still at work.
with_heartbeat() {
  local start=$SECONDS line rc
  set +e
  "$@" 2>&1 | while true; do
    if IFS= read -r -t 20 line; then
      printf '%s\n' "$line"
    elif (($? > 128)); then
      log "still building ($((SECONDS - start)) s)"
    else
      break
    fi
  done
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

command -v clang++ >/dev/null || { echo "fuzz: clang++ not found; run \`make deps\` (Debian clang)" >&2; exit 2; }
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o /dev/null 2>/dev/null; then
  echo "fuzz: clang cannot link libFuzzer; run \`make deps\` (Debian libclang-rt-14-dev)" >&2
  exit 2
fi
# shellcheck disable=SC1091
source "$FT_CACHE/env.sh"

# --- build ----------------------------------------------------------------------------------------
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
launcher=(); command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
want="$FT_TORCH_PREFIX|$FT_PYTHON|${FT_DEPS_DIR:-}"
if [[ ! -f $build/CMakeCache.txt || "$(cat "$build/.ft-config" 2>/dev/null)" != "$want" ]]; then
  log "configuring $build/ (clang, FT_FUZZ=ON)"
  CC=clang CXX=clang++ cmake -S . -B "$build" "${gen[@]}" "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE=Debug -DFT_FUZZ=ON -DFT_BUILD_TESTS=OFF -DFT_WITH_CUDA=OFF \
    -DCMAKE_PREFIX_PATH="$FT_TORCH_PREFIX" -DFT_PYTHON="$FT_PYTHON" \
    -DFT_DEPS_DIR="${FT_DEPS_DIR:-}" >"$build.configure.log" 2>&1 ||
    { cat "$build.configure.log" >&2; exit 1; }
  mv "$build.configure.log" "$build/configure.log"
  echo "$want" >"$build/.ft-config"
fi
log "building the harnesses (target ft_fuzz)"
with_heartbeat cmake --build "$build" --target ft_fuzz -j "${FT_JOBS:-$(nproc)}"

# --- run ------------------------------------------------------------------------------------------
names=("$@")
if ((${#names[@]} == 0)); then
  for f in tests/fuzz/*_fuzz.cpp; do names+=("$(basename "$f" _fuzz.cpp)"); done
fi
# Scratch files of the harnesses (one per input for the parsers that read only files): on tmpfs
# where there is one.
tmp_base=/tmp; [[ -d /dev/shm ]] && tmp_base=/dev/shm
export FT_FUZZ_TMP; FT_FUZZ_TMP=$(mktemp -d "$tmp_base/ft-fuzz.XXXXXX")
trap 'rm -rf "$FT_FUZZ_TMP"' EXIT
failed=0
summary=()
for name in "${names[@]}"; do
  bin=$build/bin/${name}_fuzz
  [[ -x $bin ]] || { echo "fuzz: no harness $bin" >&2; exit 2; }
  corpus=$build/corpus/$name crashes=$build/crashes/$name logfile=$build/logs/$name.log
  mkdir -p "$corpus" "$crashes" "$(dirname "$logfile")"
  cp -n tests/fuzz/corpus/"$name"/* "$corpus"/ 2>/dev/null || true
  log "$name: fuzzing for $seconds s (log $logfile)"
  # -timeout: an input running longer is a hang. -malloc_limit_mb: one allocation larger than
  # this is a finding (a size taken from the input); -rss_limit_mb leaves room for LibTorch and a
  # long run's corpus.
  "$bin" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=4096 -malloc_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$crashes/" "$corpus" >"$logfile" 2>&1 &
  pid=$!
  start=$SECONDS next=15
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if ((SECONDS - start >= next)); then
      last=$(grep -ao '^#[0-9]*' "$logfile" | tail -n 1 || true)
      log "$name: $((SECONDS - start)) s, ${last:-#0} executions"
      next=$((next + 15))
    fi
  done
  set +e; wait "$pid"; rc=$?; set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logfile" | tail -n 1)
  if [[ -z $execs ]]; then  # a crash ends the run before the final stats
    execs=$(grep -ao '^#[0-9]*' "$logfile" | tail -n 1 | tr -d '#')
  fi
  artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$logfile" | tail -n 1)
  if ((rc == 0)); then
    result="ok"
  else
    failed=1
    why=$(grep -aE -m1 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:|fuzz harness:|terminate called' "$logfile" || true)
    result="FOUND (exit $rc): ${why:-see $logfile}; reproduce: $bin ${artifact:-?}"
    tail -n 40 "$logfile" >&2
  fi
  line=$(printf '%-12s %12s executions in %4d s  %s' "$name" "${execs:-0}" "$((SECONDS - start))" "$result")
  log "$line"
  summary+=("$line")
done
log "summary ($seconds s each):"
for line in "${summary[@]}"; do log "  $line"; done
exit "$failed"

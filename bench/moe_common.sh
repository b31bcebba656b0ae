# shellcheck shell=bash disable=SC2154,SC2034  # me and build come from the script sourcing this; it uses tokenizer
# Sourced (not run) by bench/moe_step.sh and bench/moe_ep.sh: the ft that runs, the reference
# venv, the scratch directory and the benchmark models. Set `me` (the script's name, for messages)
# and `build` (the build directory) first; sets ft, here, tokenizer and work, and defines
# moe_models.
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}
# shellcheck disable=SC1091
source "$FT_CACHE/env.sh"
ft=$build/bin/ft
[[ -x $ft ]] || { echo "$me: no ft at '$ft': build it (scripts/build.sh) or name BUILD" >&2; exit 1; }
"$FT_PYTHON" -c "import transformers" 2>/dev/null ||
  { echo "$me: '$FT_PYTHON' lacks transformers: run scripts/setup.sh" >&2; exit 1; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tokenizer=$here/tests/tokenizer/fixtures/llama3/tokenizer.json
if [[ -n ${BENCH_KEEP:-} ]]; then
  work=$BENCH_KEEP
  mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi

# moe_models AUX SEQ RECORDS [NAMES...]: bench/moe_models.py's models and records into $work.
moe_models() {
  "$FT_PYTHON" "$here/bench/moe_models.py" "$work" "$@" >"$work/models.log" 2>&1 ||
    { echo "$me: moe_models.py failed:" >&2; cat "$work/models.log" >&2; exit 1; }
}

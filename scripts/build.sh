#!/usr/bin/env bash
# Configures (once) and builds ft into the build folder given as $1 (default build/); further
# arguments name the only targets to build (e.g. `ft ft_cuda test_cuda_gpu` on a GPU machine).
# Reads $FT_CACHE/env.sh written by setup.sh. ccache and Ninja are used when present.
#
# Debug information is -g1 by default (function names and line tables: enough for backtraces and
# `perf`), not -g: full DWARF made each object of LibTorch's inline code about 30% slower to build
# on CI's two cores, and the binaries 5x larger. FT_DEBUG_INFO=-g brings it back.
set -euo pipefail
build=${1:-build}
shift || true
targets=(); (($#)) && targets=(--target "$@")
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}
# Fresh clones in other folders still hit the compiler cache: paths relative to the clone, and the
# working directory left out of the hash (the debug information then names the first clone's path).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd)}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# Objects compiled with the precompiled ATen header (ft_aten_pch) are cached too.
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
debug=${FT_DEBUG_INFO:--g1}
# shellcheck disable=SC1091
source "$FT_CACHE/env.sh"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
launcher=(); command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
want="$FT_TORCH_PREFIX|$FT_PYTHON|${FT_DEPS_DIR:-}|${FT_WITH_CUDA:-AUTO}|${FT_ARROW_LIB_DIR:-}|$debug"
if [[ ! -f $build/CMakeCache.txt || "$(cat "$build/.ft-config" 2>/dev/null)" != "$want" ]]; then
  cmake -S . -B "$build" "${gen[@]}" "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE="${FT_BUILD_TYPE:-RelWithDebInfo}" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 $debug -DNDEBUG" \
    -DCMAKE_PREFIX_PATH="$FT_TORCH_PREFIX" \
    -DFT_PYTHON="$FT_PYTHON" \
    -DFT_DEPS_DIR="${FT_DEPS_DIR:-}" \
    -DFT_ARROW_INCLUDE_DIR="${FT_ARROW_INCLUDE_DIR:-}" \
    -DFT_ARROW_LIB_DIR="${FT_ARROW_LIB_DIR:-}" \
    -DFT_WITH_CUDA="${FT_WITH_CUDA:-AUTO}"
  echo "$want" > "$build/.ft-config"
fi
cmake --build "$build" -j "${FT_JOBS:-$(nproc)}" "${targets[@]}"

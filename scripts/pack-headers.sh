#!/usr/bin/env bash
# Copies the header-only build dependencies (CLI11, nlohmann/json, Catch2 and its CMake module, Gloo's
# headers), PCRE2 and ICU (headers and shared libraries, which the GPU machine's image lacks; ICU's data
# library is about 30 MB) from this
# machine's Debian packages into an ignored folder, .deps/ by default, so they can
# travel with the working tree to a machine that cannot install packages (the GPU machine). There:
#   FT_PYTHON=python3 FT_SKIP_APT=1 FT_DEPS_DIR=$PWD/.deps make test
set -euo pipefail
out=${1:-.deps}
mkdir -p "$out/include" "$out/cmake"
for d in CLI nlohmann catch2 gloo; do
  [[ -d /usr/include/$d ]] || { echo "missing /usr/include/$d: run scripts/setup.sh first" >&2; exit 1; }
  rm -rf "${out:?}/include/$d"
  cp -r "/usr/include/$d" "$out/include/$d"
done
mkdir -p "$out/lib"
cp /usr/include/pcre2.h "$out/include/"
cp -L /usr/lib/x86_64-linux-gnu/libpcre2-8.so.0 "$out/lib/libpcre2-8.so.0"
ln -sf libpcre2-8.so.0 "$out/lib/libpcre2-8.so"
rm -rf "${out:?}/include/unicode"
cp -r /usr/include/unicode "$out/include/unicode"
for lib in /usr/lib/x86_64-linux-gnu/libicu{uc,data}.so.[0-9]*; do
  [[ $lib == *.so.[0-9][0-9] ]] || continue
  cp -L "$lib" "$out/lib/"
  ln -sf "$(basename "$lib")" "$out/lib/$(basename "${lib%.*}")"
done
cp /usr/lib/cmake/Catch2/Catch.cmake /usr/lib/cmake/Catch2/CatchAddTests.cmake "$out/cmake/"
echo "headers in $out ($(du -sh "$out" | cut -f1)); carry it and set FT_DEPS_DIR=\$PWD/$out"

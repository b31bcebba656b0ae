#!/usr/bin/env bash
# Packs what a lent GPU machine needs to run ft built here into .gpu/ (ignored; send it with the
# working tree): this build's ft, libft_cuda.so and gpu test programs, stripped of debug
# information (6 MB instead of 61), and the system libraries the machine's image lacks (ICU,
# PCRE2). bench/gpu_session.sh unpacks them there. Saves building on the GPU machine, whose
# minutes are few; the libraries are built against this machine's LibTorch 2.11 (cu130), which
# the GPU machine's python3 carries.
#   bench/gpu_carry.sh [BUILD]
set -euo pipefail
build=${1:-build}
dest=.gpu
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
rm -rf "$dest"
mkdir -p "$dest"
mkdir -p "$out/bin" "$out/lib"
for b in ft test_cuda_gpu test_cuda_gpu_ranks; do
  [[ -x $build/bin/$b ]] || { echo "gpu_carry: $build/bin/$b is not built" >&2; exit 1; }
  strip -o "$out/bin/$b" "$build/bin/$b"
done
[[ -f $build/lib/libft_cuda.so ]] || { echo "gpu_carry: $build/lib/libft_cuda.so is not built (FT_WITH_CUDA)" >&2; exit 1; }
strip -o "$out/lib/libft_cuda.so" "$build/lib/libft_cuda.so"
for lib in $(ldd "$build/bin/ft" | awk '/libicu|libpcre2|libarrow|libparquet/ { print $3 }'); do
  cp -L "$lib" "$out/lib/"
done
# The site-packages folder of LibTorch's run path, which gpu_session.sh links to the machine's own.
readelf -d "$build/bin/ft" | sed -n 's/.*runpath: \[\([^:]*\)\/torch\/lib.*/\1/p' > "$out/site-packages"
[[ -s $out/site-packages ]] || { echo "gpu_carry: no torch/lib in ft's run path" >&2; exit 1; }
git rev-parse HEAD > "$out/commit"
git status --short | grep -v '^??' >> "$out/commit" || true
mv "$out/site-packages" "$out/commit" "$dest/"
XZ_OPT="-6 -T0" tar -C "$out" -cJf "$dest/pack.tar.xz" bin lib
du -sh "$dest"

#!/usr/bin/env bash
# Installs what ft needs to build, idempotently: Debian packages, LibTorch from the PyPI torch wheel
# and Apache Arrow's C++ library from the pyarrow wheel (into a venv under $FT_CACHE, outside the
# checkout). Writes $FT_CACHE/env.sh, which build.sh reads.
# A second run with everything in place only checks and takes about a second.
#
#   FT_CACHE=dir        cache folder (default ~/.cache/ft)
#   FT_PYTHON=python    use this Python's torch; create no venv, download nothing
#   FT_SKIP_APT=1       never call apt-get (packages must be present, or headers in FT_DEPS_DIR)
#   FT_DEPS_DIR=dir     extra include/ prefix for header-only deps (CLI11, nlohmann, fmt, catch2) where
#                       apt cannot run; scripts/pack-headers.sh makes one
#   FT_WITH_REFERENCE=0 skip the reference libraries (transformers, peft, tokenizers, safetensors,
#                       jinja2, tensorboard, datasets), which are otherwise pip-installed into the venv: the
#                       interop tests and the fixture scripts use them. Default 1, except with
#                       FT_PYTHON (no downloads) and FT_SETUP=demo
#   FT_SETUP=demo       only what building and running `ft` needs (`make demo`): no test tools
#                       (clang, chromium, iproute2) and no reference libraries
#   FT_SETUP=bench      everything, and the benchmarks' anchors (`make bench`): deepspeed, whose
#                       DeepSpeedCPUAdam bench/host_adamw.sh times beside ft's host AdamW
set -euo pipefail
FT_TORCH_VERSION=${FT_TORCH_VERSION:-2.11.0}
# Apache Arrow's C++ library (Parquet and Arrow data) comes from the pyarrow wheel, as LibTorch from
# torch's; ft links it, so `make demo` installs it too.
FT_PYARROW_VERSION=${FT_PYARROW_VERSION:-26.0.1}
FT_CACHE=${FT_CACHE:-$HOME/.cache/ft}
mkdir -p "$FT_CACHE"

log() { printf '[setup] %s\n' "$*"; }

# --- Debian packages -------------------------------------------------------------------------------
# libpcre2-dev and libicu-dev: the tokenizer's regexes and Unicode normalization / properties.
# zlib1g-dev and libzstd-dev: JSONL data compressed with gzip or zstd.
# clang and libclang-rt-14-dev (libFuzzer, ASan, UBSan): the fuzz harnesses (scripts/fuzz.sh).
# chromium: the browser test of `ft report`'s pages (tests/report/browser_check.py).
pkgs=(cmake g++ ninja-build ccache make git python3 python3-venv libcli11-dev nlohmann-json3-dev catch2 libgloo-dev libpcre2-dev libicu-dev zlib1g-dev libzstd-dev pkg-config)
# slurm-wlm (slurmctld, slurmd, sbatch...): the SLURM cluster test (tests/launcher/slurm_test.cpp).
# openmpi-bin (mpirun): ft train and ft launch started by mpirun (tests/launcher/mpirun_test.cpp).
[[ "${FT_SETUP:-all}" == demo ]] || pkgs+=(iproute2 clang libclang-rt-14-dev chromium slurm-wlm openmpi-bin)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ -n "${FT_SKIP_APT:-}" ]] || ! command -v apt-get >/dev/null; then
    log "not installing (FT_SKIP_APT or no apt-get): ${missing[*]}"
  else
    log "installing Debian packages: ${missing[*]}"
    sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# --- LibTorch (from the torch wheel) --------------------------------------------------------------
if [[ -n "${FT_PYTHON:-}" ]]; then
  py=$FT_PYTHON
  log "using existing torch from $py"
else
  venv="$FT_CACHE/venv-torch-$FT_TORCH_VERSION"
  py="$venv/bin/python"
  stamp="$venv/.ft-installed"
  if [[ ! -f $stamp ]]; then
    log "installing torch==$FT_TORCH_VERSION into $venv (one-time, several GB)"
    [[ -x $py ]] || python3 -m venv "$venv"
    "$py" -m pip install -q --disable-pip-version-check --progress-bar off \
      "torch==$FT_TORCH_VERSION" numpy
    touch "$stamp"
  fi
fi
# torch.utils.cmake_prefix_path is <torch package>/share/cmake; find it without importing torch
# (an import costs seconds, and this runs on every make).
info=$("$py" - <<'PY'
import importlib.metadata, importlib.util, os
spec = importlib.util.find_spec("torch")
root = list(spec.submodule_search_locations)[0]
assert os.path.isdir(os.path.join(root, "share", "cmake", "Torch")), "no LibTorch CMake files in " + root
print(os.path.join(root, "share", "cmake"))
print(importlib.metadata.version("torch"))
PY
) || { echo "[setup] error: '$py' cannot import torch. Set FT_PYTHON to a Python with torch, or unset it." >&2; exit 1; }
prefix=$(sed -n 1p <<<"$info"); tver=$(sed -n 2p <<<"$info")

# --- Apache Arrow (from the pyarrow wheel) -----------------------------------------------------------
# Its headers and libraries sit in the package folder (pyarrow.get_include(), get_library_dirs());
# found without importing pyarrow, as torch is.
arrow_info() {
  "$py" - <<'PY'
import importlib.metadata, importlib.util, os
spec = importlib.util.find_spec("pyarrow")
root = list(spec.submodule_search_locations)[0] if spec else ""
ok = root and os.path.isfile(os.path.join(root, "include", "arrow", "api.h"))
print(importlib.metadata.version("pyarrow") if ok else "")
print(os.path.join(root, "include") if ok else "")
print(root)
PY
}
arrow=$(arrow_info)
if [[ "$(sed -n 1p <<<"$arrow")" != "$FT_PYARROW_VERSION" ]]; then
  if [[ -n "${FT_PYTHON:-}" ]]; then
    [[ -n "$(sed -n 1p <<<"$arrow")" ]] || {
      echo "[setup] error: '$py' has no pyarrow, which ft links (Parquet and Arrow data): pip install pyarrow==$FT_PYARROW_VERSION there" >&2; exit 1; }
    log "using pyarrow $(sed -n 1p <<<"$arrow") from $py (ft pins $FT_PYARROW_VERSION)"
  else
    log "installing pyarrow==$FT_PYARROW_VERSION into $venv"
    "$py" -m pip install -q --disable-pip-version-check --progress-bar off "pyarrow==$FT_PYARROW_VERSION"
    arrow=$(arrow_info)
  fi
fi
arrow_include=$(sed -n 2p <<<"$arrow"); arrow_lib=$(sed -n 3p <<<"$arrow")

cat > "$FT_CACHE/env.sh.tmp" <<ENV
FT_PYTHON=$py
FT_TORCH_PREFIX=$prefix
FT_TORCH_VERSION_FOUND=$tver
FT_DEPS_DIR=${FT_DEPS_DIR:-}
FT_ARROW_INCLUDE_DIR=$arrow_include
FT_ARROW_LIB_DIR=$arrow_lib
ENV
mv "$FT_CACHE/env.sh.tmp" "$FT_CACHE/env.sh"
log "torch $tver at $prefix; pyarrow $(sed -n 1p <<<"$arrow") at $arrow_lib"

# --- Reference libraries ---------------------------------------------------------------
# Pinned: the committed fixtures were generated with these versions (tests/*/fixtures/make_*.py).
# tensorboard: its own reader checks ft's event files (tests/report/tensorboard_check.py).
# datasets: writes the Parquet, Arrow (save_to_disk) and compressed files ft reads in
# tests/data/files_check.py. bitsandbytes (its CPU backend): the NF4 fixtures
# (tests/model/fixtures/make_nf4_fixtures.py).
reference_pkgs=(transformers==5.24.0 peft==0.21.2 tokenizers==0.23.3 safetensors==0.8.0 jinja2==3.1.6 tensorboard==2.21.0 datasets==5.2.0 bitsandbytes==0.50.2)
if [[ -n "${FT_PYTHON:-}" || "${FT_SETUP:-all}" == demo ]]; then FT_WITH_REFERENCE=${FT_WITH_REFERENCE:-0}; fi
if [[ "${FT_WITH_REFERENCE:-1}" != 0 ]]; then
  # find_spec, not import: importing transformers costs seconds on every make.
  if "$py" -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("transformers", "peft", "tokenizers", "safetensors", "jinja2", "tensorboard", "datasets", "bitsandbytes")))'; then
    log "reference libraries present in $py"
  else
    log "installing the reference libraries (transformers, peft, tokenizers, safetensors, jinja2, tensorboard, datasets, bitsandbytes) into $py"
    "$py" -m pip install -q --disable-pip-version-check --progress-bar off \
      "${reference_pkgs[@]}"
  fi
fi

# --- Benchmark anchors (`make bench`) --------------------------------------------------------------
# deepspeed: DeepSpeedCPUAdam, the host optimizer step's anchor (bench/host_adamw.sh, issue 32); its
# CPU op builds on first use. Not needed by any test, so `make test` does not install it.
bench_pkgs=(deepspeed==0.19.8)
if [[ "${FT_SETUP:-all}" == bench && -z "${FT_PYTHON:-}" ]]; then
  if "$py" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("deepspeed") is None)'; then
    log "benchmark anchors present in $py"
  else
    log "installing the benchmark anchors (${bench_pkgs[*]}) into $py"
    "$py" -m pip install -q --disable-pip-version-check --progress-bar off "${bench_pkgs[@]}"
  fi
fi

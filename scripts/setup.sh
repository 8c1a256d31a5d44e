#!/usr/bin/env bash
# Installs what spillway needs to build, then configures and builds it into build/.
# Works on a fresh Debian/Ubuntu machine (root, or a user with sudo). The CUDA backend is built
# when a CUDA toolkit is found (nvcc on PATH or /usr/local/cuda); without one the build is
# sim-only and everything runs on the simulated device.
#
# The PyTorch plugin (c10 allocator and the spillway Python package) is built against torch 2.11
# when there is a CUDA toolkit: the python3 on PATH is used if it already has torch 2.11 (the GPU
# machines, which have no network); otherwise torch==2.11.0 is installed from PyPI into .venv/.
# SPILLWAY_TORCH=0 skips it.
#
#   scripts/setup.sh [extra cmake arguments...]
#   BUILD_DIR=build-release BUILD_TYPE=Release scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake g++ make libboost-dev doctest-dev python3 python3-dev python3-venv gzip)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ -d /usr/local/cuda/bin ] && ! command -v nvcc >/dev/null 2>&1; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

torch_version=2.11.0
torch_args=()
if [ "${SPILLWAY_TORCH:-1}" != 0 ] && command -v nvcc >/dev/null 2>&1; then
  has_torch() { "$1" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; }
  if has_torch python3; then
    torch_python=$(command -v python3)
  else
    if ! has_torch .venv/bin/python; then
      echo "setup: installing torch==$torch_version into .venv (PyPI)"
      python3 -m venv .venv
      .venv/bin/pip install -q --upgrade pip
      .venv/bin/pip install -q "torch==$torch_version" scikit-build-core
    fi
    torch_python=$PWD/.venv/bin/python
  fi
  torch_args=(-DPython3_EXECUTABLE="$torch_python" -DSPILLWAY_WITH_TORCH=ON)
fi

build_dir=${BUILD_DIR:-build}
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" "${torch_args[@]}" "$@"
cmake --build "$build_dir" -j "$jobs"
echo "setup: built into $build_dir"

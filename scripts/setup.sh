#!/usr/bin/env bash
# Installs what spillway needs to build, then configures and builds it into build/.
# Works on a fresh Debian/Ubuntu machine (root, or a user with sudo). The CUDA backend is built
# when a CUDA toolkit is found (nvcc on PATH or /usr/local/cuda); without one the build is
# sim-only and everything runs on the simulated device.
#
#   scripts/setup.sh [extra cmake arguments...]
#   BUILD_DIR=build-release BUILD_TYPE=Release scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake g++ make libboost-dev doctest-dev python3 gzip)
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

build_dir=${BUILD_DIR:-build}
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" "$@"
cmake --build "$build_dir" -j "$jobs"
echo "setup: built into $build_dir"

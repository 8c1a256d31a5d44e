#!/bin/bash
# Reruns this folder's figures from the repository root (about 5 minutes on the 2-core machine; the
# seed study and the hybrid/spill check are seed-study/run.sh's):
#   SIM=build-dev/bench/spillway-evict-sim bench/results/sim-2026-11-25-cheapest-join/run.sh
# SIM: a Release spillway-evict-sim (cmake -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_TORCH=OFF).
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
SIM=${SIM:?set SIM to a built spillway-evict-sim}
python3 "$HERE/../sim-2026-11-22-dtr-models/run.py" "$SIM" "$HERE/dtr-models"
OUT="$HERE/sweep" SIM="$SIM" "$HERE/../sim-2026-11-21-chain-dense/run.sh" .
python3 "$HERE/compare.py" > "$HERE/compare.md"
"$(dirname "$SIM")/spillway-policy-bench" --json > "$HERE/policy-bench/after-$(git rev-parse --short HEAD).json"

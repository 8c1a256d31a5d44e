#!/bin/bash
# The thrashing bound (engine_config::max_recompute_factor, default 8) on the simulated device:
# reruns sim-2026-11-22-dtr-models/run.py into dtr-models/ and sim-2026-11-21-chain-dense/run.sh
# into sweep/, and compares them with sim-2026-11-25-cheapest-join (the same commands without the
# bound) into compare.md. About 5 minutes on 2 cores. From the repository root:
#   SIM=build-evsim/bench/spillway-evict-sim bench/results/sim-2026-11-26-thrash-bound/run.sh
# SIM: a Release spillway-evict-sim (cmake -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_TORCH=OFF).
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
SIM=${SIM:?set SIM to a built spillway-evict-sim}
mkdir -p "$HERE/dtr-models" "$HERE/sweep"
python3 "$HERE/../sim-2026-11-22-dtr-models/run.py" "$SIM" "$HERE/dtr-models"
OUT="$HERE/sweep" SIM="$SIM" "$HERE/../sim-2026-11-21-chain-dense/run.sh" .
python3 "$HERE/../sim-2026-11-25-cheapest-join/compare.py" "The thrashing bound (max_recompute_factor 8)" \
  sim-2026-11-25-cheapest-join sim-2026-11-26-thrash-bound > "$HERE/compare.md"

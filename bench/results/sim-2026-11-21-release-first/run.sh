#!/bin/bash
# Everything in this folder, from a clean export of the commit under test:
#   git archive COMMIT | tar -x -C SRC && bench/results/sim-2026-11-21-release-first/run.sh SRC
# The same runs as ../sim-2026-11-21-holes/run.sh (the five torch traces with every policy, mode
# and variant; ResNet-1202; the synth:mlp chain and the four synthetic traces, both segment
# kinds), written here, then driver.sh SRC (the chain with driver and sync costs).
set -e
SRC=$(cd "$1" && pwd)
R=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$R/../../.." && pwd)
cd "$SRC"
cmake -S . -B build-optrace -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_CUDA=OFF -DSPILLWAY_WITH_TORCH=OFF > /dev/null
cmake --build build-optrace -j2 --target spillway_evict_sim > /dev/null
mkdir -p build && ln -sfn ../build-optrace/bench build/bench
start=$(date +%s)
bash "$REPO/bench/sweep_op_traces.sh" "$SRC" "$R"
OUT=$R bash "$R/../sim-2026-11-21-resnet1202/run.sh" "$SRC"
OUT=$R NAME=resnet1202-expandable EXTRA=--expandable bash "$R/../sim-2026-11-21-resnet1202/run.sh" "$SRC"
for X in "" "--expandable"; do
  N=synth-mlp-drop${X:+-expandable}
  build/bench/spillway-evict-sim --trace synth:mlp --budgets 1.0,0.8,0.6,0.5,0.4,0.35,0.3 --modes drop --verify $X > "$R/$N.txt"
  build/bench/spillway-evict-sim --trace synth:mlp --budgets 1.0,0.8,0.6,0.5,0.4,0.35,0.3 --modes drop --verify $X --json > "$R/$N.json"
done
OUT=$R bash "$R/../sim-2026-11-21-holes/run_synth.sh" "$SRC"
end=$(date +%s)
bash "$R/driver.sh" "$SRC" "$R/driver.jsonl"
echo "all but driver.sh: $((end-start)) s (2-core dev machine)" > "$R/sweep-time.txt"

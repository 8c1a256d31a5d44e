#!/bin/bash
# Everything in this folder, from a clean export of the commit under test:
#   git archive COMMIT | tar -x -C SRC && bench/results/sim-2026-11-21-holes/run.sh SRC
# Builds spillway-evict-sim (Release, no CUDA, no torch) in SRC/build-optrace, then runs
# bench/sweep_op_traces.sh (five torch traces, every policy and mode, three variants),
# run_resnet1202.sh, the synth:mlp chain with both segment kinds, and run_synth.sh.
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
mid=$(date +%s)
bash "$R/run_resnet1202.sh" "$SRC"
for X in "" "--expandable"; do
  N=synth-mlp-drop${X:+-expandable}
  build/bench/spillway-evict-sim --trace synth:mlp --budgets 1.0,0.8,0.6,0.5,0.4,0.35,0.3 --modes drop --verify $X > "$R/$N.txt"
  build/bench/spillway-evict-sim --trace synth:mlp --budgets 1.0,0.8,0.6,0.5,0.4,0.35,0.3 --modes drop --verify $X --json > "$R/$N.json"
done
end=$(date +%s)
bash "$R/run_synth.sh" "$SRC"
echo "sweep_op_traces.sh: $((mid-start)) s; resnet1202 + chain: $((end-mid)) s (2-core dev machine)" > "$R/sweep-time.txt"

#!/bin/bash
# The expandable-segment runs of ../sim-2026-11-21-release-first/run.sh, from a clean export of
# the commit under test (only dtr-frag with expandable segments changed: fixed segments take the
# same path as before, so their runs there stand):
#   git archive COMMIT | tar -x -C SRC && bench/results/sim-2026-11-21-frag-granules/run.sh SRC
# The five torch traces (drop-only, every policy), ResNet-1202 (every policy and mode), the
# synth:mlp chain (drop-only) and the four synthetic traces (drop-only), all --expandable --verify.
set -e
SRC=$(cd "$1" && pwd)
R=$(cd "$(dirname "$0")" && pwd)
cd "$SRC"
cmake -S . -B build-optrace -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_CUDA=OFF -DSPILLWAY_WITH_TORCH=OFF > /dev/null
cmake --build build-optrace -j2 --target spillway_evict_sim > /dev/null
mkdir -p build && ln -sfn ../build-optrace/bench build/bench
SIM=build/bench/spillway-evict-sim
start=$(date +%s)
for m in mlp unet resnet50 bert gpt2; do
  B=$R/evict-sim-torch-$m-cpu-expandable
  $SIM --trace bench/op_traces/torch-$m-cpu.optrace.gz --budgets 1.0,0.8,0.6,0.5,0.4,0.3 --verify --modes drop --expandable > $B.txt
  $SIM --trace bench/op_traces/torch-$m-cpu.optrace.gz --budgets 1.0,0.8,0.6,0.5,0.4,0.3 --verify --modes drop --expandable --json > $B.json
done
OUT=$R NAME=resnet1202-expandable EXTRA=--expandable bash "$R/../sim-2026-11-21-resnet1202/run.sh" "$SRC"
N=synth-mlp-drop-expandable
$SIM --trace synth:mlp --budgets 1.0,0.8,0.6,0.5,0.4,0.35,0.3 --modes drop --verify --expandable > "$R/$N.txt"
$SIM --trace synth:mlp --budgets 1.0,0.8,0.6,0.5,0.4,0.35,0.3 --modes drop --verify --expandable --json > "$R/$N.json"
for m in mlp resnet transformer unet; do
  N=synth-$m-expandable
  $SIM --trace bench/op_traces/synth-$m.optrace --budgets 1.0,0.8,0.6,0.5,0.4,0.3 --modes drop --verify --expandable > "$R/$N.txt"
  $SIM --trace bench/op_traces/synth-$m.optrace --budgets 1.0,0.8,0.6,0.5,0.4,0.3 --modes drop --verify --expandable --json > "$R/$N.json"
done
end=$(date +%s)
echo "run.sh: $((end-start)) s (2-core dev machine)" > "$R/sweep-time.txt"

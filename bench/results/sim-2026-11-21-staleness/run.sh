#!/bin/bash
# Three engines on the same traces: before (865fc8e), staleness clock (70bec92), staleness clock
# and spill cost with the spill's own copy (22a8fda). Drop-only and hybrid, every policy, --verify,
# the synthetic traces and the recorded torch op traces (CPU-timed), simulated device.
# Usage: run.sh BEFORE_SRC STALENESS_SRC SPILLCOST_SRC  (each a clean export of its commit with
#   spillway-evict-sim built in SRC/build: cmake -S SRC -B SRC/build -DCMAKE_BUILD_TYPE=Release
#   -DSPILLWAY_WITH_CUDA=OFF -DSPILLWAY_WITH_TORCH=OFF; cmake --build SRC/build --target spillway_evict_sim)
set -eu
OUT=$(cd "$(dirname "$0")" && pwd)
TRACES="synth:mlp synth:transformer synth:resnet synth:unet"
for m in mlp resnet50 gpt2 bert unet; do TRACES="$TRACES bench/op_traces/torch-$m-cpu.optrace.gz"; done
labels=(before staleness spillcost)
srcs=("$1" "$2" "$3")
for i in 0 1 2; do
  for t in $TRACES; do
    name=$(basename "$t" .optrace.gz); name=${name//:/-}
    (cd "${srcs[$i]}" && build/bench/spillway-evict-sim --trace "$t" --budgets 0.8,0.6,0.5,0.4,0.3 \
       --modes drop,hybrid --verify --json) > "$OUT/${labels[$i]}-$name.json" 2>/dev/null
  done
done
python3 "$OUT/compare.py" "$OUT" before staleness > "$OUT/compare-staleness.txt"
python3 "$OUT/compare.py" "$OUT" before spillcost > "$OUT/compare-both.txt"
python3 "$OUT/compare.py" "$OUT" staleness spillcost > "$OUT/compare-spillcost.txt"

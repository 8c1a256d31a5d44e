#!/bin/bash
# The four synthetic op traces (bench/op_traces/synth-*.optrace), drop-only, with PyTorch's
# segment sizes and with expandable segments, every policy, --verify.
# Usage: run_synth.sh SRC  (SRC: a clean export of the commit under test, spillway-evict-sim built
#   in SRC/build; see run_resnet1202.sh)
set -eu
OUT=${OUT:-$(cd "$(dirname "$0")" && pwd)}  # OUT=DIR: write there instead
cd "$1"
for m in mlp resnet transformer unet; do
  for X in "" "--expandable"; do
    N=synth-$m${X:+-expandable}
    build/bench/spillway-evict-sim --trace bench/op_traces/synth-$m.optrace --budgets 1.0,0.8,0.6,0.5,0.4,0.3 --modes drop --verify $X > "$OUT/$N.txt"
    build/bench/spillway-evict-sim --trace bench/op_traces/synth-$m.optrace --budgets 1.0,0.8,0.6,0.5,0.4,0.3 --modes drop --verify $X --json > "$OUT/$N.json"
  done
done

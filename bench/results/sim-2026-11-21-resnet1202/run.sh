#!/bin/bash
# ResNet-1202 (CIFAR, batch 32, CPU-timed op trace) on the simulated device at the DTR prototype's
# memory ratios (89.8%, 44.9%, 22.5%) and the usual ones, every policy and mode, with --verify.
# Usage: run.sh SRC  (a clean export of the commit under test with spillway-evict-sim built in
#   SRC/build: cmake -S SRC -B SRC/build -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_CUDA=OFF
#   -DSPILLWAY_WITH_TORCH=OFF; cmake --build SRC/build --target spillway_evict_sim)
# Environment (for later folders that rerun it): OUT (default: beside this script), NAME (default
# resnet1202: the output files' name), EXTRA (more spillway-evict-sim options, e.g. --expandable).
set -eu
OUT=${OUT:-$(cd "$(dirname "$0")" && pwd)}
NAME=${NAME:-resnet1202}
EXTRA=${EXTRA:-}
cd "$1"
T=bench/op_traces/torch-resnet1202-cpu.optrace.gz
B=1.0,0.898,0.8,0.6,0.449,0.4,0.3,0.225
# largest/drop thrashes on this trace (366 s for one run at 0.6, then out of memory): left out.
P=dtr,dtr-frag,lru
build/bench/spillway-evict-sim --trace $T --budgets $B --policies $P --verify $EXTRA > "$OUT/$NAME.txt"
build/bench/spillway-evict-sim --trace $T --budgets $B --policies $P --verify $EXTRA --json > "$OUT/$NAME.json"

#!/bin/bash
# ResNet-1202 (CIFAR, batch 32, CPU-timed op trace) on the simulated device at the DTR prototype's
# memory ratios (89.8%, 44.9%, 22.5%) and the usual ones, every policy and mode, with --verify,
# with PyTorch's segment sizes and with expandable segments (copied from sim-2026-11-21-resnet1202).
# Usage: run.sh SRC  (a clean export of the commit under test with spillway-evict-sim built in
#   SRC/build: cmake -S SRC -B SRC/build -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_CUDA=OFF
#   -DSPILLWAY_WITH_TORCH=OFF; cmake --build SRC/build --target spillway_evict_sim)
set -eu
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$1"
T=bench/op_traces/torch-resnet1202-cpu.optrace.gz
B=1.0,0.898,0.8,0.6,0.449,0.4,0.3,0.225
# largest/drop thrashes on this trace (366 s for one run at 0.6, then out of memory): left out.
P=dtr,dtr-frag,lru
for X in "" "--expandable"; do
  N=resnet1202${X:+-expandable}
  build/bench/spillway-evict-sim --trace $T --budgets $B --policies $P --verify $X > "$OUT/$N.txt"
  build/bench/spillway-evict-sim --trace $T --budgets $B --policies $P --verify $X --json > "$OUT/$N.json"
done

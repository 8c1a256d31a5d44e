#!/bin/bash
# Next-use prediction (Note [Next-use prediction] in docs/eviction.md): each run twice, as one step
# (--warmup-steps 0, staleness as before) and as the second of two steps (--warmup-steps 1: the
# first records its reads, the second, measured, is predicted from them). Drop-only, dtr and
# dtr-frag, --verify, PyTorch's segment sizes and expandable segments. From a clean export:
#   git archive COMMIT | tar -x -C SRC && bench/results/sim-2026-11-21-next-use/run.sh SRC
# (SIM=path/to/spillway-evict-sim skips the build.) Writes one JSON per trace, size mode and
# step count, and compare.md (compare.py), here or in OUT (a later results folder's run.sh).
set -e
SRC=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
R=${OUT:-$HERE}
cd "$SRC"
if [ -z "$SIM" ]; then
  cmake -S . -B build-optrace -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_CUDA=OFF -DSPILLWAY_WITH_TORCH=OFF > /dev/null
  cmake --build build-optrace -j2 --target spillway_evict_sim > /dev/null
  SIM=build-optrace/bench/spillway-evict-sim
fi
run() {  # name trace budgets
  for w in 0 1; do
    for e in fixed expandable; do
      flag=""; [ $e = expandable ] && flag=--expandable
      $SIM --trace "$2" --budgets "$3" --policies dtr,dtr-frag --modes drop --verify --warmup-steps $w $flag --json \
        > "$R/$1-$e-warmup$w.json" &
    done
    wait
  done
}
for m in mlp unet resnet50 bert gpt2; do run torch-$m bench/op_traces/torch-$m-cpu.optrace.gz 0.8,0.6,0.5,0.4,0.3; done
run synth-mlp synth:mlp 0.8,0.6,0.5,0.4,0.35,0.3
run torch-resnet1202 bench/op_traces/torch-resnet1202-cpu.optrace.gz 0.898,0.449,0.225
python3 "$HERE/compare.py" "$R" > "$R/compare.md"

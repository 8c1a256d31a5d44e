#!/bin/bash
# 1. The sweep of sim-2026-11-21-next-use (same traces, budgets, policies, flags; one step and the
#    predicted second), written into this folder.
# 2. The two chain traces at dense budget ratios from rotor's minimum up (chain-*.json): the
#    chain target is "at every budget from the rotor minimum up", and the sweep's ratios skip the
#    range just above the minimum, where the misses are.
# From a clean export:
#   git archive COMMIT | tar -x -C SRC && bench/results/sim-2026-11-21-chain-dense/run.sh SRC
# (SIM=path/to/spillway-evict-sim skips the build; OUT=DIR writes there instead of here.)
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
R=${OUT:-$HERE}
OUT=$R "$HERE/../sim-2026-11-21-next-use/run.sh" "$@"
cd "$1"
SIM=${SIM:-build-optrace/bench/spillway-evict-sim}
dense() {  # name trace budgets
  for w in 0 1; do
    for e in fixed expandable; do
      flag=""; [ $e = expandable ] && flag=--expandable
      $SIM --trace "$2" --budgets "$3" --policies dtr,dtr-frag --modes drop --verify --warmup-steps $w $flag --json \
        > "$R/chain-$1-$e-warmup$w.json" &
    done
    wait
  done
}
dense synth-mlp synth:mlp 0.285,0.3,0.316,0.32,0.33,0.34,0.35,0.37,0.4,0.45,0.5,0.6,0.7,0.8,0.9
dense torch-mlp bench/op_traces/torch-mlp-cpu.optrace.gz 0.525,0.53,0.54,0.56,0.58,0.6,0.65,0.7,0.8,0.9
python3 "$HERE/chain_table.py" "$R" > "$R/chain.md"

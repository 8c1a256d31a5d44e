#!/bin/bash
# Runs every recorded and synthetic op trace, drop and hybrid modes, dtr and dtr-frag, the default
# budgets, one step and predicted, --verify. usage (repository root): run.sh SIM OUT.jsonl
BIN=$1; OUT=$2; : > $OUT
for t in bench/op_traces/torch-*.optrace.gz bench/op_traces/synth-*.optrace; do
  for w in 0 1; do
    $BIN --trace $t --modes drop,hybrid --policies dtr,dtr-frag --warmup-steps $w --json --verify >> $OUT 2>/dev/null
  done
done

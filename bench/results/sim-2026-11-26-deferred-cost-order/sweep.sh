#!/bin/bash
# sweep.sh BIN OUTDIR RATIOS POLICIES: one JSON per trace, kind of segments and warm-up setting
# (8 traces x PyTorch's segments / expandable x one step / predicted), drop and hybrid, into
# OUTDIR. Run from the repository root. Used by this folder's run.sh and by
# sim-2026-11-26-releasable-count/run.sh.
set -e
mkdir -p "$2"
for t in synth:mlp synth:resnet synth:transformer bench/op_traces/torch-resnet50-cpu.optrace.gz \
         bench/op_traces/torch-gpt2-cpu.optrace.gz bench/op_traces/torch-bert-cpu.optrace.gz \
         bench/op_traces/torch-unet-cpu.optrace.gz bench/op_traces/torch-mlp-cpu.optrace.gz; do
  n=$(basename "$t" | tr ':' '-')
  for e in fixed expandable; do
    f=""; [ $e = expandable ] && f=--expandable
    for w in 0 1; do
      "$1" --trace "$t" --budgets "$3" --policies "$4" --modes drop,hybrid --warmup-steps $w $f --json \
        > "$2/$n-$e-$w.json" 2>/dev/null
    done
  done
done

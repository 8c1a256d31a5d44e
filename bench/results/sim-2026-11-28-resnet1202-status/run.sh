#!/bin/bash
# ResNet-1202 (torch-resnet1202-cpu.optrace.gz) at DTR's three ratios, drop-only, dtr and dtr-frag,
# both segment kinds, one step and predicted, --verify. usage (repository root): run.sh SIM > OUT
SIM=$1
for x in "" "--expandable"; do
  for w in 0 1; do
    echo "== ${x:-fixed} warmup-steps $w"
    $SIM --trace bench/op_traces/torch-resnet1202-cpu.optrace.gz --budgets 0.898,0.449,0.225 \
      --policies dtr,dtr-frag --modes drop --verify --warmup-steps $w $x 2>&1 |
      grep -E "^(dtr|dtr-frag)/drop|baseline"
  done
done

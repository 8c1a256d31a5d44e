#!/bin/bash
# ResNet-50 at 40% and 30% of peak under three sampling seeds, with the bound (the README's
# "Over three sampling seeds"): one line per run, its time / unconstrained time, OOM, or THRASH
# (out of memory because a pin passed max_recompute_factor). From the repository root:
#   SIM=build-evsim/bench/spillway-evict-sim bench/results/sim-2026-11-26-thrash-bound/seeds-resnet50.sh
set -e
SIM=${SIM:?set SIM to a built spillway-evict-sim}
HERE=$(cd "$(dirname "$0")" && pwd)
for s in 1 2 3; do
  for kind in "" --expandable; do
    for wu in 0 1; do
      for policy in dtr dtr-frag; do
        for ratio in 0.4 0.3; do
          printf 's%s %s wu%s %s %s: ' $s "${kind:-fixed}" $wu $policy $ratio
          "$SIM" --modes drop --json --trace bench/op_traces/torch-resnet50-cpu.optrace.gz --budgets $ratio \
              --policies $policy --warmup-steps $wu --seed $s $kind 2>/dev/null |
            python3 -c "import json, sys; r = json.load(sys.stdin)['traces'][0]['runs'][0]; print('%.2f' % (1 + r['overhead']) if r['ok'] else ('THRASH' if 'thrashing' in r['failure'] else 'OOM'))"
        done
      done
    done
  done
done > "$HERE/seeds-resnet50.txt"
cat "$HERE/seeds-resnet50.txt"

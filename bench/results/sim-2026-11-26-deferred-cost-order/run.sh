#!/bin/bash
# Before (2392a89) against after (2565703), simulated device, from the repository root (sweep.sh runs
# the traces; compare.py compares two sweeps field by field):
#   BASE=path/to/spillway-evict-sim-of-2392a89 NEW=build-evsim/bench/spillway-evict-sim \
#     bench/results/sim-2026-11-26-deferred-cost-order/run.sh
# (each built with: cmake -S SRC -B B -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_TORCH=OFF &&
#  make -C B spillway_evict_sim spillway_policy_bench; SRC from git worktree add or git archive).
# 1. 1,536 runs with each (8 traces x fixed/expandable x one step/predicted x 8 ratios x
#    dtr/dtr-frag/lru x drop/hybrid), compared field by field (compare.txt); about 18 minutes
#    with the two running side by side on 2 cores.
# 2. ResNet-1202 at 40% of peak, dtr, the two alternately four times (resnet1202.txt): the
#    upkeep's mean time per step and the run's wall time.
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/deferred-cost-order}
ratios=0.9,0.7,0.6,0.5,0.45,0.4,0.35,0.3
"$HERE/sweep.sh" "$BASE" "$OUT/base" $ratios dtr,dtr-frag,lru & "$HERE/sweep.sh" "$NEW" "$OUT/new" $ratios dtr,dtr-frag,lru
wait
python3 "$HERE/compare.py" "$OUT/base" "$OUT/new" > "$HERE/compare.txt"
for i in 1 2 3 4; do
  for b in "$BASE" "$NEW"; do
    "$b" --trace bench/op_traces/torch-resnet1202-cpu.optrace.gz --budgets 0.4 --policies dtr --modes drop \
      --warmup-steps 1 --json 2>/dev/null | python3 -c "
import json, sys
r = json.load(sys.stdin)['traces'][0]['runs'][0]
print('$b', r['time_ns'], r['drops'], round(r['upkeep_mean_ns']), r['upkeep_steps'], r['decision_median_ns'], round(r['wall_seconds'], 2))"
  done
done > "$HERE/resnet1202.txt"

#!/bin/bash
# Before (3f29d87) against after (8b4ce93), simulated device, from the repository root:
#   BEFORE=path/to/spillway-evict-sim-of-3f29d87 AFTER=path/to/spillway-evict-sim-of-8b4ce93 \
#     bench/results/sim-2026-11-26-releasable-count/run.sh
# (each: cmake -S SRC -B B -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_TORCH=OFF &&
#  make -C B spillway_evict_sim). 1. 512 runs with each, compared field by field (compare.txt;
# about 11 minutes side by side on 2 cores). 2. ResNet-1202 at 40%, alternately (resnet1202.txt).
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/releasable-count}
SWEEP=$HERE/../sim-2026-11-26-deferred-cost-order/sweep.sh
"$SWEEP" "$BEFORE" "$OUT/before" 0.7,0.5,0.4,0.3 dtr,dtr-frag & "$SWEEP" "$AFTER" "$OUT/after" 0.7,0.5,0.4,0.3 dtr,dtr-frag
wait
python3 "$HERE/../sim-2026-11-26-deferred-cost-order/compare.py" "$OUT/before" "$OUT/after" > "$HERE/compare.txt"
for i in 1 2 3 4; do
  for b in "$BEFORE" "$AFTER"; do
    for e in --expandable ""; do
      "$b" --trace bench/op_traces/torch-resnet1202-cpu.optrace.gz --budgets 0.4 --policies dtr --modes drop \
        --warmup-steps 1 $e --json 2>/dev/null | python3 -c "
import json, sys
r = json.load(sys.stdin)['traces'][0]['runs'][0]
print('$b', '${e:-fixed}', r['time_ns'], r['drops'], round(r['upkeep_mean_ns']), r['decision_median_ns'], round(r['wall_seconds'], 2))"
    done
  done
done > "$HERE/resnet1202.txt"

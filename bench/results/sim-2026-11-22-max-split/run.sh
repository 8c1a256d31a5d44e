#!/bin/bash
# max_split_size (PyTorch's max_split_size_mb) under budgets, PyTorch's segment sizes, simulated
# device. Budgets are the same bytes for every limit: ratios 0.8, 0.6, 0.5, 0.4 of the peak
# reserved WITHOUT a limit (a limit raises the unconstrained peak, so ratios of each run's own
# peak would give it more bytes). Prints, per trace, limit and step kind, the overhead
# (time / baseline - 1) of dtr and dtr-frag, drop-only, --verify, or OOM.
# Usage: SIM=path/to/spillway-evict-sim run.sh [TRACE_DIR]
set -euo pipefail
sim=${SIM:?set SIM to a spillway-evict-sim binary}
traces=${1:-bench/op_traces}
peak() {  # trace, limit MiB, warm-up steps -> peak reserved bytes without a budget
  "$sim" --trace "$1" --budgets 1.0 --policies dtr --modes drop --warmup-steps "$3" \
      --max-split-mb "$2" --json 2>/dev/null |
    python3 -c "import json,sys; print(json.load(sys.stdin)['traces'][0]['peak_reserved'])"
}
echo "cells: ratio 0.8 0.6 0.5 0.4 of the unlimited peak; [dtr, dtr-frag] overhead or OOM"
for name in bert gpt2 unet resnet50; do
  trace=$traces/torch-$name-cpu.optrace.gz
  for warmup in 0 1; do
    p0=$(peak "$trace" 0 $warmup)
    for limit in 0 32 64 128; do
      p1=$(peak "$trace" $limit $warmup)
      ratios=$(python3 -c "print(','.join('%.6f' % (r * $p0 / $p1) for r in (0.8, 0.6, 0.5, 0.4)))")
      printf '%-8s %-9s max_split %3s MiB (peak %d MiB): ' $name \
          "$([ $warmup = 1 ] && echo predicted || echo '1 step')" $limit $((p1 >> 20))
      "$sim" --trace "$trace" --budgets "$ratios" --policies dtr,dtr-frag --modes drop --verify \
          --warmup-steps $warmup --max-split-mb $limit --json 2>/dev/null | python3 -c "
import json, sys
t = json.load(sys.stdin)['traces'][0]
cells, bad = {}, 0
for r in t['runs']:
    cells.setdefault(r['ratio'], []).append('%.2f' % r['overhead'] if r['ok'] else 'OOM')
    bad += r.get('verify_mismatches', 0)
print(' '.join('[' + ', '.join(cells[k]) + ']' for k in sorted(cells, reverse=True)), 'mismatches', bad)"
    done
  done
done

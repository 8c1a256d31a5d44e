#!/bin/bash
# Compaction (Note [Compaction]) on the simulated device, from the repository root:
#   BEFORE=path/to/spillway-evict-sim-of-2228639 AFTER=path/to/spillway-evict-sim-of-this-commit \
#     bench/results/sim-2026-11-26-compaction/run.sh
# (each: cmake -S SRC -B B -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_TORCH=OFF &&
#  make -C B spillway_evict_sim).
# 1. identity.txt: AFTER with --no-compact against BEFORE, 512 runs field by field (compaction
#    off is the engine as it was).
# 2. effect.txt: AFTER with compaction (the default) against AFTER --no-compact, same 512 runs.
# 3. chain.md: the chain target's dense cells (synth:mlp, torch MLP), both ways.
# 4. dtr-models-on/, dtr-models-off/, compare_dtr_models.txt: DenseNet-121 and Inception-v3 at
#    DTR's ratios (sim-2026-11-22-dtr-models/run.py), both ways.
# 5. resnet1202.txt: ResNet-1202, PyTorch's segments, predicted step, drop-only, both ways.
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/compaction}
SWEEP=$HERE/../sim-2026-11-26-deferred-cost-order/sweep.sh
mkdir -p "$OUT"
OFF=$OUT/sim-no-compact
printf '#!/bin/sh\nexec %s --no-compact "$@"\n' "$AFTER" > "$OFF" && chmod +x "$OFF"
"$SWEEP" "$BEFORE" "$OUT/before" 0.7,0.5,0.4,0.3 dtr,dtr-frag & "$SWEEP" "$OFF" "$OUT/off" 0.7,0.5,0.4,0.3 dtr,dtr-frag
wait
"$SWEEP" "$AFTER" "$OUT/on" 0.7,0.5,0.4,0.3 dtr,dtr-frag
python3 "$HERE/../sim-2026-11-26-deferred-cost-order/compare.py" "$OUT/before" "$OUT/off" > "$HERE/identity.txt"
python3 "$HERE/effect.py" "$OUT/off" "$OUT/on" > "$HERE/effect.txt"
dense() {  # name trace budgets
  for sim in "$OFF" "$AFTER"; do
    d=$OUT/chain-on; [ "$sim" = "$OFF" ] && d=$OUT/chain-off
    mkdir -p "$d"
    for w in 0 1; do
      for e in fixed expandable; do
        flag=""; [ $e = expandable ] && flag=--expandable
        "$sim" --trace "$2" --budgets "$3" --policies dtr,dtr-frag --modes drop --verify --warmup-steps $w $flag --json \
          > "$d/chain-$1-$e-warmup$w.json" 2>/dev/null &
      done
      wait
    done
  done
}
dense synth-mlp synth:mlp 0.285,0.3,0.316,0.32,0.33,0.34,0.35,0.37,0.4,0.45,0.5,0.6,0.7,0.8,0.9
dense torch-mlp bench/op_traces/torch-mlp-cpu.optrace.gz 0.525,0.53,0.54,0.56,0.58,0.6,0.65,0.7,0.8,0.9
{
  echo "## Compaction off (--no-compact)"; python3 "$HERE/../sim-2026-11-21-chain-dense/chain_table.py" "$OUT/chain-off"
  echo; echo "## Compaction on"; python3 "$HERE/../sim-2026-11-21-chain-dense/chain_table.py" "$OUT/chain-on"
} > "$HERE/chain.md"
mkdir -p "$HERE/dtr-models-on" "$HERE/dtr-models-off"
python3 "$HERE/../sim-2026-11-22-dtr-models/run.py" "$AFTER" "$HERE/dtr-models-on"
python3 "$HERE/../sim-2026-11-22-dtr-models/run.py" "$OFF" "$HERE/dtr-models-off"
python3 "$HERE/compare_dtr_models.py" > "$HERE/compare_dtr_models.txt"
for sim in "$OFF" "$AFTER"; do
  "$sim" --trace bench/op_traces/torch-resnet1202-cpu.optrace.gz --budgets 0.4,0.3 --policies dtr,dtr-frag \
    --modes drop --warmup-steps 1 --json 2>/dev/null | python3 -c "
import json, sys
for r in json.load(sys.stdin)['traces'][0]['runs']:
    print('$(basename "$sim")', r['policy'], r['ratio'], r['ok'], 'overhead %.4f' % r['overhead'], 'drops', r['drops'],
          'moves', r.get('moves'), 'segments_emptied', r.get('segments_emptied'))"
done > "$HERE/resnet1202.txt"

#!/bin/bash
# Replays the recorded torch-*-cpu op traces in spillway-evict-sim, every policy and mode plus
# three variants, and writes the tables, JSON and plots to OUT (the sweeps under bench/results/).
# Usage: sweep_op_traces.sh SPILLWAY_SOURCE_DIR OUT [models...]   (default: mlp unet resnet50 bert gpt2)
#   SPILLWAY_SOURCE_DIR: a clean export of the commit under test, built with
#     cmake -S DIR -B DIR/build-optrace -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_CUDA=OFF
#     cmake --build DIR/build-optrace -j2 --target spillway_evict_sim
# The simulator runs inside DIR (so the traces are DIR/bench/op_traces, as committed).
# (Until 2026-11-21 this was bench/results/sim-2026-11-21/run_torch.sh, which wrote next to itself.)
set -u
SRC=$1; shift
mkdir -p "$1"
OUT=$(cd "$1" && pwd); shift
SIM=$SRC/build-optrace/bench/spillway-evict-sim
BUDGETS=1.0,0.8,0.6,0.5,0.4,0.3
cd "$SRC"
for m in "${@:-mlp unet resnet50 bert gpt2}"; do
  for m1 in $m; do
    T=bench/op_traces/torch-$m1-cpu.optrace.gz
    B=$OUT/evict-sim-torch-$m1-cpu
    # every policy and mode, PyTorch's segment sizes, 50 GB/s link: the table, the plot, the JSON
    $SIM --trace $T --budgets $BUDGETS --verify --plot $B.svg > $B.txt
    $SIM --trace $T --budgets $BUDGETS --verify --json > $B.json
    # variants: drop-only without eager drops; drop-only with expandable segments;
    # hybrid and spill with a 100x slower host link (0.5 GB/s)
    for v in noeager expandable slowlink; do
      case $v in
        noeager) X="--modes drop --no-eager-drop" ;;
        expandable) X="--modes drop --expandable" ;;
        slowlink) X="--modes hybrid,spill --link-gbps 0.5" ;;
      esac
      $SIM --trace $T --budgets $BUDGETS --verify $X > $B-$v.txt
      $SIM --trace $T --budgets $BUDGETS --verify $X --json > $B-$v.json
    done
  done
done
# label the plots: these are simulated-device figures with CPU-timed ops
for f in "$OUT"/evict-sim-torch-*-cpu.svg; do
  grep -q "simulated device" "$f" || sed -i 's|^\(<text x="70" y="22" font-size="14" font-weight="bold">[^<]*</text>\)$|\1\n<text x="880" y="22" text-anchor="end" font-size="11" fill="#444">spillway simulated device, 2-core dev machine, no GPU; op times are CPU timings</text>|' "$f"
done

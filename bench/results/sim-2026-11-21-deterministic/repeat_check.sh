#!/bin/bash
# Runs the drop-only commands of bench/results/sim-2026-11-21-policy/recheck-torch.txt (section 4)
# N times each (default 10) and counts the distinct outcomes per policy: status, overhead, extra
# compute ms, pressure drops (or the op a failed run stopped at). Prints the tally, then every raw
# output. Usage: repeat_check.sh SPILLWAY_SOURCE_DIR [N]   (built as run_torch.sh says)
set -u
SRC=$1
N=${2:-10}
SIM=$SRC/build-optrace/bench/spillway-evict-sim
cd "$SRC"
RAW=$(mktemp)
tally() {  # the table rows of one run's text output -> one line per policy
  awk '$1 ~ /\/drop$/ && $4 == "ok" { printf "%s ok %s %s drops=%s\n", $1, $6, $7, $13 }
       $1 ~ /\/drop$/ && $4 == "FAILED" { printf "%s FAILED at op %s\n", $1, $10 }'
}
for spec in "mlp 0.6" "mlp 0.6 --no-eager-drop" "bert 0.6" "resnet50 0.5" "gpt2 0.6"; do
  set -- $spec
  m=$1 r=$2 x=${3:-}
  echo "== $m${x:+ $x} $r ($N repeats): \$SIM --trace bench/op_traces/torch-$m-cpu.optrace.gz --budgets $r --modes drop --verify $x"
  for i in $(seq "$N"); do
    out=$($SIM --trace bench/op_traces/torch-$m-cpu.optrace.gz --budgets $r --modes drop --verify $x 2>/dev/null)
    { echo "### $m $r $x, repeat $i"; echo "$out"; } >> "$RAW"
    echo "$out" | tally
  done | sort | uniq -c
done
echo
echo "======== raw outputs ========"
cat "$RAW"
rm -f "$RAW"

#!/bin/bash
# The seed study of this folder's README: builds f6f5dd9 with k-env.patch (SW_K: how many of the
# cheapest per byte join a DTR sample, 0 for none, which is the engine before the join; SW_EXH:
# score every candidate up to this many) in a temporary git worktree, and replays the low ratios of
# sim-2026-11-22-dtr-models (0.45 and below) and ResNet-50 at 0.4 and 0.3 for SW_K 0, 8 and 16
# under --seed 1, 2 and 3 (rows.json, summary.txt); then ResNet-50 one step with every candidate
# scored against the sample (exhaustive-resnet50.txt). About 6 minutes on 2 cores.
#   [HYBRID=1] bench/results/sim-2026-11-25-cheapest-join/seed-study/run.sh REPO [WORKDIR]
set -euo pipefail
repo=$(cd "$1" && pwd)
work=${2:-/tmp/spillway-seed-study}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
git -C "$repo" worktree prune
git -C "$repo" worktree add -q --detach "$work" f6f5dd9
trap 'git -C "$repo" worktree remove --force "$work"' EXIT
git -C "$work" apply "$here/k-env.patch"
cmake -S "$work" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_TORCH=OFF \
      -DSPILLWAY_WITH_CUDA=OFF > "$work/cmake.log"
cmake --build "$work/build" --target spillway_evict_sim -j 2 > "$work/build.log" 2>&1
python3 "$here/seeds.py" "$work/build/bench/spillway-evict-sim" "$repo" "$here/rows.json"
python3 "$here/summary.py" "$here/rows.json" > "$here/summary.txt"
# ResNet-50 one step, seed 1: the sample (SW_K=8, the engine as it is) against every candidate scored.
sim=$work/build/bench/spillway-evict-sim
for kind in "" --expandable; do
  for policy in dtr dtr-frag; do
    for ratio in 0.4 0.3; do
      for exh in 64 100000; do
        printf '%-12s %-8s %s SW_EXH=%-6s: ' "${kind:-fixed}" $policy $ratio $exh
        (cd "$repo" && SW_K=8 SW_EXH=$exh "$sim" --modes drop --json --trace bench/op_traces/torch-resnet50-cpu.optrace.gz \
            --budgets $ratio --policies $policy $kind 2>/dev/null) |
          python3 -c "import json, sys; r = json.load(sys.stdin)['traces'][0]['runs'][0]; print('%.3fx, %d drops' % (1 + r['overhead'], r['drops']) if r['ok'] else 'out of memory')"
      done
    done
  done
done > "$here/exhaustive-resnet50.txt"
cat "$here/summary.txt" "$here/exhaustive-resnet50.txt"
# HYBRID=1: the hybrid and spill modes (every recorded trace at the default budgets, dtr, dtr-frag
# and lru, --verify) without the join (SW_K=0) and with it: ../hybrid-spill.md. About 15 minutes.
if [ "${HYBRID:-0}" = 1 ]; then
  for k in 0 8; do
    (cd "$repo" && SW_K=$k "$sim" --modes hybrid,spill --policies dtr,dtr-frag,lru --verify --json > "$work/hybrid-k$k.json" 2>/dev/null)
  done
  python3 "$here/hybrid_compare.py" "$work/hybrid-k0.json" "$work/hybrid-k8.json" > "$here/../hybrid-spill.md"
  head -5 "$here/../hybrid-spill.md"
fi

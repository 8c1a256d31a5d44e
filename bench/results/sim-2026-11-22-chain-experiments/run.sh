#!/bin/bash
# Chain-target experiments of 2026-11-22 (not kept in the engine): builds commit 7ed9ea6 with
# experiments.patch in a temporary git worktree and prints, for synth:mlp, the best drop-only
# extra compute over rotor's (dtr, dtr-frag) at each ratio, per allocator kind and step, for each
# variant the patch switches on with an environment variable (OOM: every drop-only run out of
# memory; inf: rotor needs no recompute and the best run does). Usage: run.sh REPO [WORKDIR]
# Other experiments reuse it: BASE (commit), PATCH (file) and VARIANTS (space-separated, "base"
# for none) override this directory's.
set -euo pipefail
repo=$(cd "$1" && pwd)
work=${2:-/tmp/spillway-chain-experiments}
here=$(cd "$(dirname "$0")" && pwd)
base=${BASE:-7ed9ea6}
patch=${PATCH:-$here/experiments.patch}
variants=${VARIANTS:-"base SW_DIR=1 SW_DIR=2 SW_DIR=3 SW_DIR=4 SW_MID=0.5 SW_MID=0.66"}
rm -rf "$work"
git -C "$repo" worktree prune
git -C "$repo" worktree add -q --detach "$work" "$base"
trap 'git -C "$repo" worktree remove --force "$work"' EXIT
git -C "$work" apply "$patch"
cmake -S "$work" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_WITH_TORCH=OFF \
      -DSPILLWAY_WITH_CUDA=OFF > "$work/cmake.log"
cmake --build "$work/build" --target spillway_evict_sim -j 2 > "$work/build.log" 2>&1
sim=$work/build/bench/spillway-evict-sim
ratios=0.316,0.32,0.33,0.34,0.35,0.37,0.4,0.45,0.5,0.6,0.7,0.8,0.9
echo "ratios: $ratios"
for variant in $variants; do
  echo "== $variant"
  for kind in --expandable ""; do
    for warmup in 0 1; do
      name=fixed; [ -n "$kind" ] && name=expandable
      printf '%-10s %-9s: ' "$name" "$([ $warmup = 1 ] && echo predicted || echo '1 step')"
      env $([ "$variant" = base ] || echo "${variant//,/ }") "$sim" --trace synth:mlp --budgets $ratios \
          --policies dtr,dtr-frag --modes drop --warmup-steps $warmup $kind 2>&1 |
        grep -E "ratio 0\.[0-9]+:" |
        sed -E 's/.*best \((none ran|every[^)]*)\).*/OOM/; s/.*-> ([0-9.]+x|inf).*/\1/' | tr -d x | tr '\n' ' '
      echo
    done
  done
done

#!/bin/bash
# Revolve snapshots in chain recompute plans (2026-11-22, not kept in the engine): builds commit
# 32847ad with experiments.patch and prints the synth:mlp chain-target cells for each variant,
# with the chain-experiments driver. Usage: run.sh REPO [WORKDIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
variants="base"
for s in 1 2 3 4 6; do variants+=" SW_SNAP=$s SW_SNAP=$s,SW_SNAP_BOOST=1000"; done
BASE=32847ad PATCH=$here/experiments.patch VARIANTS=$variants \
  exec "$here/../sim-2026-11-22-chain-experiments/run.sh" "$@"

#!/bin/bash
# The sweep of sim-2026-11-21-next-use (its run.sh and compare.py: the same traces, budgets,
# policies and flags, one step and the predicted second), written into this folder. From a clean
# export:
#   git archive COMMIT | tar -x -C SRC && bench/results/sim-2026-11-21-dependants/run.sh SRC
# (SIM=path/to/spillway-evict-sim skips the build.) Then vs_next_use.py > vs_next_use.md.
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=$HERE exec "$HERE/../sim-2026-11-21-next-use/run.sh" "$@"

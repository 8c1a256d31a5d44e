#!/bin/bash
# The synth:mlp chain, drop-only, both segment kinds, with the simulated device charging
# 0, 20 and 100 us per driver call (segment reserve/release, page map/unmap) and per device
# synchronisation: how the release-or-evict choice of Note [Memory pressure path] moves with
# costs that were not measured on a GPU here. One JSON line per run to OUT.
# Usage: driver.sh SRC OUT  (SRC: spillway-evict-sim built in SRC/build)
set -eu
cd "$1"
: > "$2"
for X in "" "--expandable"; do
  for us in 0 20 100; do
    build/bench/spillway-evict-sim --trace synth:mlp --budgets 0.8,0.6,0.5,0.4,0.35 --modes drop --verify $X \
      --driver-us $us --sync-us $us --json | python3 -c '
import json, sys
d = json.load(sys.stdin)
for t in d["traces"]:
    for r in t["runs"]:
        print(json.dumps({"expandable": "'"$X"'" != "", "driver_us": '"$us"', "baseline_ns": t["baseline_ns"],
            **{k: r[k] for k in r if k in ("policy", "ratio", "ok", "time_ns", "overhead", "extra_compute_ns", "stall_ns", "device_syncs",
             "device_allocs", "device_frees", "releases_before_eviction", "verify_mismatches")}}))
' >> "$2"
  done
done

#!/usr/bin/env python3
"""Summarises spillway-evict-sim --json outputs: per trace, the chain target line and, per mode,
how many runs failed and the mean overhead of the runs that completed in both files.

usage: summarize.py BEFORE.json AFTER.json"""
import json
import sys


def load(path):
    with open(path) as f:
        return {t["name"]: t for t in json.load(f)["traces"]}


def key(p):
    return (p["policy"], p["mode"], p["ratio"])


before, after = load(sys.argv[1]), load(sys.argv[2])
for name in before:
    b, a = before[name], after[name]
    print(f"== {name}")
    for label, t in (("before", b), ("after", a)):
        row = []
        for c in t["chain_targets"]:
            f = c.get("factor")
            row.append(f"{c['ratio']:.2f}:{f:.2f}" if c.get("best") and f is not None else f"{c['ratio']:.2f}:OOM")
        print(f"   chain target {label:6s} {' '.join(row)}")
    runs_b = {key(p): p for p in b["runs"]}
    runs_a = {key(p): p for p in a["runs"]}
    for mode in ("drop", "hybrid", "spill"):
        ks = [k for k in runs_b if k[1] == mode]
        fb = sum(1 for k in ks if not runs_b[k]["ok"])
        fa = sum(1 for k in ks if not runs_a[k]["ok"])
        both = [k for k in ks if runs_b[k]["ok"] and runs_a[k]["ok"]]
        ob = sum(runs_b[k]["overhead"] for k in both) / max(1, len(both))
        oa = sum(runs_a[k]["overhead"] for k in both) / max(1, len(both))
        corrupt = sum(runs_a[k]["verify_mismatches"] for k in ks)
        print(f"   {mode:6s}: failed {fb:2d} -> {fa:2d} of {len(ks)}; mean overhead of the {len(both)} "
              f"runs that completed in both {100 * ob:6.1f}% -> {100 * oa:6.1f}%; mismatches after: {corrupt}")

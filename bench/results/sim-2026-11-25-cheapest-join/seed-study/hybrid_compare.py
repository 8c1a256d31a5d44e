#!/usr/bin/env python3
"""Compares two `spillway-evict-sim --modes hybrid,spill --json` outputs, before and after:
hybrid_compare.py BEFORE.json AFTER.json (prints markdown)."""
import json
import math
import os
import sys


def runs(path):
    out = {}
    for t in json.load(open(path))["traces"]:
        for r in t["runs"]:
            out[(os.path.basename(t["name"]), r["policy"], r["mode"], round(r["ratio"], 4))] = r
    return out


before, after = runs(sys.argv[1]), runs(sys.argv[2])
both = [k for k in before if k in after and before[k]["ok"] and after[k]["ok"]]
ratio = {k: (1 + after[k]["overhead"]) / (1 + before[k]["overhead"]) for k in both}
geo = math.exp(sum(math.log(v) for v in ratio.values()) / len(ratio))
print("# Hybrid and spill modes: after / before (simulated device)\n")
print(f"- {len(before)} runs; {len(both)} fit in both: geometric mean of time after / before {geo:.4f}; "
      f"{sum(v < 0.98 for v in ratio.values())} over 2% faster, {sum(v > 1.02 for v in ratio.values())} over 2% slower")
print(f"- fit before only: {sum(1 for k in before if k in after and before[k]['ok'] and not after[k]['ok'])}; "
      f"after only: {sum(1 for k in before if k in after and after[k]['ok'] and not before[k]['ok'])}")
print(f"- --verify mismatches after: {sum(r.get('verify_mismatches', 0) for r in after.values())}\n")
print("| trace | policy | mode | ratio | before | after |\n| --- | --- | --- | --- | --- | --- |")
for k in sorted(ratio, key=lambda k: -abs(math.log(ratio[k]))):
    if abs(math.log(ratio[k])) > math.log(1.02):
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {1 + before[k]['overhead']:.3f} | {1 + after[k]['overhead']:.3f} |")

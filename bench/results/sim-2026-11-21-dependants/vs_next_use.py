#!/usr/bin/env python3
"""The predicted second steps here against those of sim-2026-11-21-next-use (before dependants'
reads counted): every cell whose best-of-two overhead (dtr, dtr-frag) moved by more than a point,
then the per-policy counts. Usage: vs_next_use.py [THIS_DIR] [BEFORE_DIR]"""
import glob
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
before = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "..", "sim-2026-11-21-next-use")


def runs(path):
    return json.load(open(path))["traces"][0]["runs"]


def best(rs):
    out = {}
    for r in rs:
        v = r["overhead"] if r["ok"] else None
        k = r["ratio"]
        if k not in out or (v is not None and (out[k] is None or v < out[k])):
            out[k] = v
    return out


def show(v):
    return "OOM" if v is None else f"{100 * v:.1f}%"


def verdict(a, b):
    if a is None and b is None:
        return "same"
    if a is None:
        return "better"
    if b is None:
        return "worse"
    return "better" if b < a - 0.01 else "worse" if b > a + 0.01 else "same"


print("| run (predicted step) | ratio | before | after | |\n| --- | --- | --- | --- | --- |")
counts = {"best": {}, "policy": {}}
for f in sorted(glob.glob(os.path.join(here, "*-warmup1.json"))):
    g = os.path.join(before, os.path.basename(f))
    if not os.path.exists(g):
        continue
    name = os.path.basename(f)[: -len("-warmup1.json")]
    ra, rb = runs(g), runs(f)
    ba, bb = best(ra), best(rb)
    for k in ba:
        v = verdict(ba[k], bb.get(k))
        counts["best"][v] = counts["best"].get(v, 0) + 1
        if v != "same":
            print(f"| {name} | {k} | {show(ba[k])} | {show(bb.get(k))} | {v} |")
    pa = {(r["policy"], r["ratio"]): r for r in ra}
    for r in rb:
        a = pa.get((r["policy"], r["ratio"]))
        if a is None:
            continue
        v = verdict(a["overhead"] if a["ok"] else None, r["overhead"] if r["ok"] else None)
        counts["policy"][v] = counts["policy"].get(v, 0) + 1
print()
print("best of the two policies:", ", ".join(f"{k} {v}" for k, v in sorted(counts["best"].items())))
print("each policy:", ", ".join(f"{k} {v}" for k, v in sorted(counts["policy"].items())))

#!/usr/bin/env python3
"""Summarises the seed study's rows.json: summary.py rows.json"""
import collections
import json
import math
import sys

rows = json.load(open(sys.argv[1]))
JOINS = sorted({r["k"] for r in rows})
SEEDS = sorted({r["seed"] for r in rows})
key = lambda r: (r["seed"], r["trace"], r["config"], r["warmup_steps"], r["policy"], r["ratio"])
by = {k: {key(r): r for r in rows if r["k"] == k} for k in JOINS}
fit_in_all = [x for x in by[JOINS[0]] if all(by[k][x]["status"] == "ok" for k in JOINS)]
slow = lambda r, limit: r["status"] == "timeout" or (r["status"] == "ok" and r["slowdown"] > limit)

print("Simulated device, drop-only: time / unconstrained time. k = cheapest per byte joined (0: none).")
print(f"Seeds {SEEDS}; a run past 30 s counts as timeout and as over 2x.\n")
for name, part in (("DenseNet-121 and Inception-v3, ratios 0.45-0.30", lambda x: x[1] != "resnet50"),
                   ("ResNet-50, ratios 0.4 and 0.3", lambda x: x[1] == "resnet50")):
    common = [x for x in fit_in_all if part(x)]
    print(f"== {name}: geometric mean over the {len(common)} runs that fit for every k")
    for k in JOINS:
        rs = [r for x, r in by[k].items() if part(x)]
        n = collections.Counter(r["status"] for r in rs)
        geo = math.exp(sum(math.log(by[k][x]["slowdown"]) for x in common) / len(common))
        worst = max((r["slowdown"] for r in rs if r["status"] == "ok"), default=float("nan"))
        print(f"k={k:2d}: runs {len(rs)}, out of memory {n['out of memory']}, timeout {n['timeout']}, "
              f"over 2x {sum(slow(r, 2) for r in rs)}, over 1.6x {sum(slow(r, 1.6) for r in rs)}, "
              f"geometric mean {geo:.3f}, worst {worst:.2f}x")
    print()

print("== best of dtr and dtr-frag at DTR's lowest ratio (DenseNet-121 0.387, DTR 1.51x; Inception-v3 0.384,")
print("   DTR's Inception-v4 1.25x), seeds " + "/".join(map(str, SEEDS)))
for trace, ratio in (("densenet121", 0.387), ("inception_v3", 0.384)):
    for config in ("fixed", "fixed, max_split 32 MiB", "expandable"):
        for wu in (0, 1):
            line = f"{trace:12s} {config:24s} {'predicted' if wu else 'one step':9s}"
            for k in JOINS:
                cells = []
                for s in SEEDS:
                    ok = [by[k][(s, trace, config, wu, p, ratio)] for p in ("dtr", "dtr-frag")]
                    ok = [r["slowdown"] for r in ok if r["status"] == "ok"]
                    cells.append("%.3f" % min(ok) if ok else "OOM")
                line += f"  k={k}: " + "/".join(cells)
            print(line)
print()
print("== ResNet-50 per run, seeds " + "/".join(map(str, SEEDS)))
for config in ("fixed", "expandable"):
    for wu in (0, 1):
        for policy in ("dtr", "dtr-frag"):
            for ratio in (0.4, 0.3):
                line = f"{config:10s} {'predicted' if wu else 'one step':9s} {policy:8s} {ratio}"
                for k in JOINS:
                    rs = [by[k][(s, "resnet50", config, wu, policy, ratio)] for s in SEEDS]
                    line += f"  k={k}: " + "/".join("%.2f" % r["slowdown"] if r["status"] == "ok" else
                                                    ("OOM" if r["status"] == "out of memory" else "t/o") for r in rs)
                print(line)

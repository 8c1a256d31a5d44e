#!/usr/bin/env python3
"""Best run per mode and budget ratio (any policy), and dtr-frag's own, OLD_DIR -> NEW_DIR, for the
non-torch result files of NEW_DIR (ResNet-1202, the synth:mlp chain, the synthetic traces; the
torch traces are compared by ../sim-2026-11-21-deterministic/compare_torch.py). A run counts only
if it ran with 0 --verify mismatches.

    python3 compare_best.py OLD_DIR NEW_DIR
"""
import glob
import json
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)["traces"][0]["runs"]


def cell(runs, mode, ratio, policy=None):
    ok = [r for r in runs if r["mode"] == mode and r["ratio"] == ratio and r["ok"]
          and r["verify_mismatches"] == 0 and (policy is None or r["policy"] == policy)]
    if not ok:
        return "OOM"
    r = min(ok, key=lambda r: r["overhead"])
    return f"{100 * r['overhead']:.1f}%" + ("" if policy else f" ({r['policy']})")


def main(old, new):
    for path in sorted(glob.glob(os.path.join(new, "*.json"))):
        name = os.path.basename(path)
        if name.startswith("evict-sim-torch-") or not os.path.exists(os.path.join(old, name)):
            continue
        a, b = load(os.path.join(old, name)), load(path)
        ratios = sorted({r["ratio"] for r in b}, reverse=True)
        print(f"\n### {name[:-5]}\n")
        print("| mode, runs | " + " | ".join(f"{q:.3g}" for q in ratios) + " |")
        print("|---|" + "---|" * len(ratios))
        for mode in sorted({r["mode"] for r in b}):
            for policy, label in [(None, "best"), ("dtr-frag", "dtr-frag")]:
                cells = []
                for q in ratios:
                    x, y = cell(a, mode, q, policy), cell(b, mode, q, policy)
                    cells.append(x if x == y else f"{x} -> **{y}**")
                print(f"| {mode}, {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

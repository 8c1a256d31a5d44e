#!/usr/bin/env python3
"""Best drop-only run per synthetic trace x segment kind x ratio, OLD_DIR -> NEW_DIR (run_synth.sh
outputs, --json). A run counts only if it ran with 0 --verify mismatches.

    python3 compare_synth.py OLD_DIR NEW_DIR
"""
import json
import os
import sys

RATIOS = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3]


def load(d, name):
    with open(os.path.join(d, name + ".json")) as f:
        return json.load(f)["traces"][0]["runs"]


def best(runs, ratio):
    ok = [r for r in runs if r["ratio"] == ratio and r["ok"] and r["verify_mismatches"] == 0]
    if not ok:
        return "OOM"
    r = min(ok, key=lambda r: r["overhead"])
    return f"{100 * r['overhead']:.1f}% ({r['policy']})"


def main(old, new):
    print("| trace, segments | " + " | ".join(f"{q:.2f}" for q in RATIOS) + " |")
    print("|---|" + "---|" * len(RATIOS))
    for m in ["mlp", "resnet", "transformer", "unet"]:
        for kind in ["", "-expandable"]:
            name = f"synth-{m}{kind}"
            a, b = load(old, name), load(new, name)
            cells = []
            for q in RATIOS:
                x, y = best(a, q), best(b, q)
                cells.append(x if x == y else f"{x} -> **{y}**")
            label = f"synth-{m}, " + ("expandable" if kind else "PyTorch segments")
            print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

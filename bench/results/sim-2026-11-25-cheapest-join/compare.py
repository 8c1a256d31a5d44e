#!/usr/bin/env python3
"""Compares this folder's runs with the engine before the change (the committed folders that ran the
same commands), and prints compare.md. From the repository root:

    python3 bench/results/sim-2026-11-25-cheapest-join/compare.py > bench/results/sim-2026-11-25-cheapest-join/compare.md

Other folders reuse it: compare.py TITLE BEFORE AFTER compares the dtr-models/ and sweep/ of the
results folders BEFORE and AFTER (names under bench/results).
"""
import glob
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.dirname(HERE)


def dtr_models(path):
    runs = json.load(open(path))["runs"]
    return {(r["trace"], r["config"], r["warmup_steps"], r["policy"], r["ratio"]): r for r in runs}


def sweep(folder):
    out = {}
    for f in glob.glob(os.path.join(folder, "*.json")):
        for t in json.load(open(f))["traces"]:
            for r in t["runs"]:
                out[(os.path.basename(f)[:-5], r["policy"], round(r["ratio"], 4))] = r
    return out


def word(ok, slowdown, status="ok"):
    return "%.3f" % slowdown if ok else status


def main():
    if len(sys.argv) == 4:
        title, before_dir, after_dir = sys.argv[1:]
        dtr = (f"{before_dir}/dtr-models/results.json", f"{after_dir}/dtr-models/results.json")
        sweeps = (f"{before_dir}/sweep", f"{after_dir}/sweep")
    else:
        title = "The cheapest per byte join every sample"
        dtr = ("sim-2026-11-22-dtr-models/results.json", "sim-2026-11-25-cheapest-join/dtr-models/results.json")
        sweeps = ("sim-2026-11-22-wanted-now", "sim-2026-11-25-cheapest-join/sweep")
    print(f"# {title}: before and after (simulated device)\n")
    before, after = (dtr_models(os.path.join(RESULTS, p)) for p in dtr)
    print("## DenseNet-121 and Inception-v3 (sim-2026-11-22-dtr-models/run.py), time / unconstrained time\n")
    for name, runs in (("before", before), ("after", after)):
        over = sum(1 for r in runs.values() if r["status"] == "timeout" or (r["status"] == "ok" and r["slowdown"] > 2))
        oom = sum(1 for r in runs.values() if r["status"] == "out of memory")
        print(f"- {name}: {len(runs)} runs, {over} over 2x or past 60 s, {oom} out of memory")
    both = [k for k in after if before[k]["status"] == "ok" and after[k]["status"] == "ok"]
    g = math.exp(sum(math.log(after[k]["slowdown"] / before[k]["slowdown"]) for k in both) / len(both))
    print(f"- geometric mean of after / before over the {len(both)} runs that fit in both: {g:.3f}\n")
    print("Runs whose time changed by over 1.5x (a timeout counts as 999):\n")
    print("| trace | configuration | step | policy | ratio | before | after | drops before | drops after |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    s = lambda r: r["slowdown"] if r["status"] == "ok" else (999 if r["status"] == "timeout" else float("nan"))
    for k in sorted(after):
        x, y = s(before[k]), s(after[k])
        if x > 1.5 * y or y > 1.5 * x or (before[k]["status"] != after[k]["status"]):
            print(f"| {k[0]} | {k[1]} | {'predicted' if k[2] else 'one step'} | {k[3]} | {k[4]} | "
                  f"{word(before[k]['status'] == 'ok', x, before[k]['status'])} | {word(after[k]['status'] == 'ok', y, after[k]['status'])} | "
                  f"{before[k].get('drops', '-')} | {after[k].get('drops', '-')} |")
    b, a = (sweep(os.path.join(RESULTS, p)) for p in sweeps)
    print(f"\n## The recorded traces and the chain traces (sim-2026-11-21-chain-dense/run.sh), against {sweeps[0]}\n")
    fit = [k for k in a if b[k]["ok"] and a[k]["ok"]]
    ratios = [(1 + a[k]["overhead"]) / (1 + b[k]["overhead"]) for k in fit]
    g = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"- {len(a)} runs; {len(fit)} fit in both: geometric mean of after / before {g:.4f}; "
          f"{sum(r < 0.98 for r in ratios)} over 2% faster, {sum(r > 1.02 for r in ratios)} over 2% slower")
    now_fit = sorted(k for k in a if a[k]["ok"] and not b[k]["ok"])
    now_oom = sorted(k for k in a if b[k]["ok"] and not a[k]["ok"])
    print(f"- {len(now_fit)} fit that ran out of memory, {len(now_oom)} run out of memory that fit; "
          f"--verify mismatches after: {sum(r.get('verify_mismatches', 0) for r in a.values())}\n")
    print("| file | policy | ratio | before | after |")
    print("| --- | --- | --- | --- | --- |")
    for k in sorted(a):
        x, y = b[k], a[k]
        if x["ok"] != y["ok"] or (x["ok"] and y["ok"] and not 1 / 1.5 < (1 + y["overhead"]) / (1 + x["overhead"]) < 1.5):
            print(f"| {k[0]} | {k[1]} | {k[2]} | {word(x['ok'], 1 + x.get('overhead', 0), 'OOM')} | "
                  f"{word(y['ok'], 1 + y.get('overhead', 0), 'OOM')} |")


if __name__ == "__main__":
    main()

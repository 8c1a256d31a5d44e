#!/usr/bin/env python3
"""Summarises spillway-evict-sim --json output: per trace and budget ratio, the best run overall
and the best drop-only run (the DTR-like mode), as overhead (time / baseline - 1).

    python3 bench/results/sim-2026-11-21/summarize_torch.py FILE.json [FILE.json ...]
"""
import json
import sys


def fmt(run, ran=True):
    if not ran:
        return "not run"
    if run is None:
        return "OOM"
    return f"{100 * run['overhead']:.1f}% ({run['policy']}/{run['mode']})"


def main(paths):
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        for t in d["traces"]:
            opts = ("expandable" if d.get("expandable") else "PyTorch segments") + \
                ("" if d.get("eager_drop", True) else ", no eager drop")
            print(f"## {path}: {t['name']} ({opts}; {d.get('device', '')})")
            print(f"peak {t['peak_reserved'] / 2**20:.0f} MiB reserved, "
                  f"params {t['param_bytes'] / 2**20:.0f} MiB, baseline {t['baseline_ns'] / 1e6:.1f} ms")
            ratios = sorted({r["ratio"] for r in t["runs"]}, reverse=True)
            rotor = {p["ratio"]: p for p in t["rotor"].get("points", [])} if t.get("rotor") else {}
            print("| ratio | best overall | best drop-only | rotor (extra compute) |")
            print("|---|---|---|---|")
            for ratio in ratios:
                # A run that read back wrong bytes (--verify) does not count as a success.
                runs = [r for r in t["runs"] if r["ratio"] == ratio and r["ok"] and r["verify_mismatches"] == 0]
                best = min(runs, key=lambda r: r["overhead"], default=None)
                drops = [r for r in runs if r["mode"] == "drop"]
                best_drop = min(drops, key=lambda r: r["overhead"], default=None)
                rp = rotor.get(ratio)
                rtxt = "-" if rp is None else (f"{100 * rp['overhead']:.1f}%" if rp.get("feasible") else "infeasible")
                ran_drop = any(r["mode"] == "drop" for r in t["runs"])
                print(f"| {ratio:.2f} | {fmt(best)} | {fmt(best_drop, ran_drop)} | {rtxt} |")
            print()


if __name__ == "__main__":
    main(sys.argv[1:])

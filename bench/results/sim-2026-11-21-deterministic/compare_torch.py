#!/usr/bin/env python3
"""Compares two run_torch.sh result folders (spillway-evict-sim --json on the torch-*-cpu traces).

    python3 compare_torch.py best OLD_DIR NEW_DIR   # best overhead per model x variant x mode x ratio, old -> new
    python3 compare_torch.py diff OLD_DIR NEW_DIR   # every run whose status changed or whose overhead moved > 1 point
    python3 compare_torch.py text DIR               # each .txt table against its .json twin (same replays, two processes)
    python3 compare_torch.py verify DIR             # --verify checks and mismatches over the .json files

A run counts as a success only if it ran and --verify found no mismatch (as in summarize_torch.py).
"""
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sim-2026-11-21"))
from summarize_torch import fmt  # noqa: E402  (the cell format of summary-torch.md)

MODELS = ["mlp", "resnet50", "gpt2", "bert", "unet"]
VARIANTS = ["", "-noeager", "-expandable", "-slowlink"]
RATIOS = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3]


def load(folder, model, variant):
    path = os.path.join(folder, f"evict-sim-torch-{model}-cpu{variant}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return {(r["policy"], r["mode"], r["ratio"]): r for r in json.load(f)["traces"][0]["runs"]}


def good(r):
    return r is not None and r["ok"] and r["verify_mismatches"] == 0


def best(runs, mode, ratio):
    ok = [r for (p, m, q), r in runs.items() if m == mode and q == ratio and good(r)]
    return min(ok, key=lambda r: r["overhead"], default=None)


def cell(run):
    # fmt prints "12.3% (policy/mode)"; the mode is the row here
    return fmt(run).replace(f"/{run['mode']})", ")") if run else "OOM"


def cmd_best(old, new):
    print("| model, variant | mode | " + " | ".join(f"{r:.2f}" for r in RATIOS) + " |")
    print("|---|---|" + "---|" * len(RATIOS))
    for model in MODELS:
        for variant in VARIANTS:
            o, n = load(old, model, variant), load(new, model, variant)
            if n is None:
                continue
            for mode in ("drop", "hybrid", "spill"):
                if not any(k[1] == mode for k in n):
                    continue
                cells = []
                for ratio in RATIOS:
                    nb = cell(best(n, mode, ratio))
                    ob = cell(best(o, mode, ratio)) if o is not None else "-"
                    cells.append(nb if ob == nb else f"{ob} -> **{nb}**")
                print(f"| {model}{variant or ' (default)'} | {mode} | " + " | ".join(cells) + " |")


def describe(r):
    if r is None:
        return "not run"
    if not r["ok"]:
        m = re.search(r"at op (\d+).*?tried to allocate ([0-9.]+ [KMG]iB)", r["failure"])
        return f"OOM (op {m.group(1)}, {m.group(2)})" if m else "OOM"
    bad = f", {r['verify_mismatches']} MISMATCHES" if r["verify_mismatches"] else ""
    return f"{100 * r['overhead']:.1f}%{bad}"


def cmd_diff(old, new):
    changed = total = 0
    print("| model, variant | run | ratio | old | new |")
    print("|---|---|---|---|---|")
    for model in MODELS:
        for variant in VARIANTS:
            o, n = load(old, model, variant), load(new, model, variant)
            if o is None or n is None:
                continue
            for k in sorted(n, key=lambda k: (k[1], k[0], -k[2])):
                total += 1
                a, b = o.get(k), n[k]
                same_status = a is not None and good(a) == good(b)
                if same_status and (not good(b) or abs(a["overhead"] - b["overhead"]) <= 0.01):
                    continue
                changed += 1
                print(f"| {model}{variant or ' (default)'} | {k[0]}/{k[1]} | {k[2]:.2f} | "
                      f"{describe(a)} | {describe(b)} |")
    print(f"\n{changed} of {total} runs changed status or overhead by more than 1 point.")


ROW = re.compile(r"^(\S+/(?:drop|hybrid|spill))\s+([0-9.]+)\s+\d+\s+(ok|FAILED|CORRUPT)\s*(.*)$")


def cmd_text(folder):
    runs = same = 0
    for js in sorted(glob.glob(os.path.join(folder, "evict-sim-torch-*.json"))):
        with open(js) as f:
            jr = {(r["policy"], r["mode"], r["ratio"]): r for r in json.load(f)["traces"][0]["runs"]}
        with open(js[:-5] + ".txt") as f:
            for line in f:
                m = ROW.match(line)
                if not m:
                    continue
                policy, mode = m.group(1).split("/")
                r = jr[(policy, mode, float(m.group(2)))]
                runs += 1
                if m.group(3) == "FAILED":
                    ok = not r["ok"] and m.group(4)[:60] == r["failure"][:60]
                else:
                    col = m.group(4).split()
                    ok = (r["ok"] and col[1] == f"{100 * r['overhead']:.1f}%" and
                          col[2] == f"{r['extra_compute_ns'] / 1e6:.3f}" and int(col[8]) == r["drops"])
                if ok:
                    same += 1
                else:
                    print(f"DIFFERS: {os.path.basename(js)} {policy}/{mode} {m.group(2)}: {line.strip()[:120]}")
    print(f"{same} of {runs} runs: the .txt row (status, failure text or overhead, extra ms, drops) "
          f"equals the .json run")


def cmd_verify(folder):
    checks = bad = n = 0
    for js in sorted(glob.glob(os.path.join(folder, "evict-sim-torch-*.json"))):
        with open(js) as f:
            for r in json.load(f)["traces"][0]["runs"]:
                n += 1
                checks += r["verify_checks"]
                bad += r["verify_mismatches"]
    print(f"--verify: {bad} mismatches in {checks} checks over {n} runs")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"best": cmd_best, "diff": cmd_diff, "text": cmd_text, "verify": cmd_verify}[cmd](*args)

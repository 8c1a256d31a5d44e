#!/usr/bin/env python3
"""DenseNet-121 and Inception-v3 (CPU-timed op traces) on the simulated device at the DTR prototype's
memory ratios, drop-only, against DTR's published slowdowns (README.md beside this script).

    bench/results/sim-2026-11-22-dtr-models/run.py SIM [OUT]

SIM: a built spillway-evict-sim. OUT: where results.json and results.txt go (default: beside this
script). Budgets are fractions of the same bytes in every configuration: ratio x the unconstrained
peak reserved with PyTorch's segment sizes and no split limit (DTR's baseline is unmodified
PyTorch), or with expandable segments for the expandable runs. Each run has a 60 s limit; a run
that passes it is reported as "timeout" (it thrashes: see the README).
"""
import concurrent.futures
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
TRACES = {  # name: (file, DTR's ratios and slowdowns from its data-full.json, docs/simulator.md)
    "densenet121": ("bench/op_traces/dtr-models/torch-densenet121-cpu.optrace.gz", {0.911: 1.16, 0.387: 1.51}),
    "inception_v3": ("bench/op_traces/dtr-models/torch-inception_v3-cpu.optrace.gz", {0.893: 1.07, 0.384: 1.25}),
}
RATIOS = [0.8, 0.6, 0.5, 0.45, 0.35, 0.3]
# name: (its options, the options of its baseline, whose peak the budget ratios are of)
CONFIGS = {"fixed": ([], []), "fixed, max_split 32 MiB": (["--max-split-mb", "32"], []),
           "expandable": (["--expandable"], ["--expandable"])}
POLICIES = ["dtr", "dtr-frag"]
LIMIT_S = 60


def sim(args):
    try:
        out = subprocess.run([SIM, "--modes", "drop", "--verify", "--json"] + args, capture_output=True, text=True,
                             timeout=LIMIT_S, check=True).stdout
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out)["traces"][0]


def peak(trace, options, wu):
    return sim(["--trace", trace, "--budgets", "1.0", "--policies", "dtr", "--warmup-steps", str(wu)] + options)[
        "peak_reserved"]


def one(job):
    name, config, wu, policy, ratio, budget_ratio = job
    t = sim(["--trace", TRACES[name][0], "--budgets", "%.6f" % budget_ratio, "--policies", policy,
             "--warmup-steps", str(wu)] + CONFIGS[config][0])
    if t is None:
        return job, {"status": "timeout"}
    r = t["runs"][0]
    if not r["ok"]:
        return job, {"status": "out of memory", "failure": r.get("failure", "")}
    return job, {"status": "ok", "slowdown": 1 + r["overhead"], "drops": r["drops"], "budget": r["budget"],
                 "verify_mismatches": r.get("verify_mismatches", 0)}


def main():
    os.chdir(ROOT)
    jobs = []
    peaks = {}
    for name, (trace, dtr) in TRACES.items():
        ratios = sorted(set(RATIOS) | set(dtr), reverse=True)
        for config in CONFIGS:
            for wu in (0, 1):
                options, baseline = CONFIGS[config]
                p0, p1 = peak(trace, baseline, wu), peak(trace, options, wu)
                peaks[f"{name}/{config}/{wu}"] = {"baseline_peak": p0, "own_peak": p1}
                for policy in POLICIES:
                    for r in ratios:
                        jobs.append((name, config, wu, policy, r, r * p0 / p1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, jobs))
    rows = [dict(zip(("trace", "config", "warmup_steps", "policy", "ratio", "budget_ratio"), j), **r) for j, r in results]
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump({"peaks": peaks, "runs": rows}, f, indent=1)
    with open(os.path.join(OUT, "results.txt"), "w") as f:
        for name, (trace, dtr) in TRACES.items():
            ratios = sorted(set(RATIOS) | set(dtr), reverse=True)
            f.write(f"== {name} ({trace}); time / unconstrained time, best of {', '.join(POLICIES)} (each: dtr / dtr-frag)\n")
            f.write("%-34s" % "config, step" + "".join("%16.3f" % r for r in ratios) + "\n")
            f.write("%-34s" % "DTR prototype (GPU, its batch)" + "".join(
                ("%15.2fx" % dtr[r]) if r in dtr else "%16s" % "" for r in ratios) + "\n")
            for config in CONFIGS:
                for wu in (0, 1):
                    cells = []
                    for r in ratios:
                        got = [x for x in rows if x["trace"] == name and x["config"] == config and
                               x["warmup_steps"] == wu and x["ratio"] == r]
                        got.sort(key=lambda x: POLICIES.index(x["policy"]))
                        word = lambda x: "%.3f" % x["slowdown"] if x["status"] == "ok" else (
                            "OOM" if x["status"] == "out of memory" else "t/o")
                        cells.append("/".join(word(x) for x in got))
                    f.write("%-34s" % f"{config}, {'predicted' if wu else 'one step'}" +
                            "".join("%16s" % c for c in cells) + "\n")
            f.write("\n")
        bad = sum(x.get("verify_mismatches", 0) for x in rows)
        f.write(f"--verify mismatches over all runs: {bad}; runs: {len(rows)}, timeouts ({LIMIT_S} s): "
                f"{sum(1 for x in rows if x['status'] == 'timeout')}\n")
    sys.stdout.write(open(os.path.join(OUT, "results.txt")).read())


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    SIM = os.path.abspath(sys.argv[1])
    OUT = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else HERE
    main()

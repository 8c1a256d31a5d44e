#!/usr/bin/env python3
"""Runs the seed study (run.sh beside this file): seeds.py SIM REPO OUT.json

Each run: spillway-evict-sim --modes drop on the simulated device, one trace, one budget, one
policy, one --seed, SW_K in the environment; a 30 s limit (a run past it is "timeout").
"""
import concurrent.futures
import json
import os
import subprocess
import sys

SIM, REPO, OUT = sys.argv[1:4]
DTR_MODELS = os.path.join(REPO, "bench/results/sim-2026-11-25-cheapest-join/dtr-models/results.json")
TRACES = {"densenet121": "bench/op_traces/dtr-models/torch-densenet121-cpu.optrace.gz",
          "inception_v3": "bench/op_traces/dtr-models/torch-inception_v3-cpu.optrace.gz",
          "resnet50": "bench/op_traces/torch-resnet50-cpu.optrace.gz"}
OPTIONS = {"fixed": [], "fixed, max_split 32 MiB": ["--max-split-mb", "32"], "expandable": ["--expandable"]}
JOINS = (0, 8, 16)
SEEDS = (1, 2, 3)


def cases():
    # dtr-models' runs at 0.45 and below, at the budget ratios it used (of each configuration's own peak)
    for r in json.load(open(DTR_MODELS))["runs"]:
        if r["ratio"] <= 0.45:
            yield r["trace"], r["config"], r["warmup_steps"], r["policy"], r["ratio"], r["budget_ratio"]
    for config in ("fixed", "expandable"):
        for wu in (0, 1):
            for policy in ("dtr", "dtr-frag"):
                for ratio in (0.4, 0.3):
                    yield "resnet50", config, wu, policy, ratio, ratio


def one(job):
    k, seed, (trace, config, wu, policy, ratio, budget_ratio) = job
    row = dict(k=k, seed=seed, trace=trace, config=config, warmup_steps=wu, policy=policy, ratio=ratio)
    cmd = [SIM, "--modes", "drop", "--json", "--trace", TRACES[trace], "--budgets", "%.6f" % budget_ratio,
           "--policies", policy, "--warmup-steps", str(wu), "--seed", str(seed)] + OPTIONS[config]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True, cwd=REPO,
                             env=dict(os.environ, SW_K=str(k))).stdout
    except subprocess.TimeoutExpired:
        return dict(row, status="timeout")
    run = json.loads(out)["traces"][0]["runs"][0]
    if not run["ok"]:
        return dict(row, status="out of memory")
    return dict(row, status="ok", slowdown=1 + run["overhead"], drops=run["drops"])


jobs = [(k, seed, c) for seed in SEEDS for k in JOINS for c in cases()]
with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    rows = list(pool.map(one, jobs))
with open(OUT, "w") as f:
    json.dump(rows, f, indent=0)

#!/usr/bin/env python3
"""replay_min_budget: the smallest budget under which spillway replays a trace without running out
of memory, as a multiple of the trace's peak live bytes: fragmentation measured as what a job needs
under a cap, not as what an uncapped cache grows to.

    python3 bench/replay_min_budget.py [--replay build/bench/spillway-replay] [--device sim]
                                       [--trace FILE[,FILE...]] [--step 2MiB] [--json]
    python3 bench/replay_min_budget.py --smoke        # ctest: one synthetic trace, coarse steps

For each trace, with fixed and with expandable segments: spillway-replay without a budget (the
peak live bytes of the trace, and the uncapped peak reserved), then a bisection on --budget between
the peak live bytes and the uncapped peak reserved, down to --step, for the smallest budget whose
replay has no out-of-memory answer. Out of memory is not strictly monotonic in the budget (a
smaller cap changes when the cache is released, so placement), so the figure is the bisection's
answer: a budget that works, with every budget tried below it failing.

Prints one line per trace and mode, or with --json one JSON document on stdout. Exit status 1 if
a replay fails to run.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_bytes(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def replay(a, trace, expandable, budget=None):
    cmd = [a.replay, "--trace", trace, "--device", a.device, "--json"]
    if expandable:
        cmd.append("--expandable")
    if budget is not None:
        cmd += ["--budget", str(budget)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}: {p.stderr.strip()}")
    return json.loads(p.stdout)["traces"][0]


def min_budget(a, trace, expandable):
    free = replay(a, trace, expandable)
    live, hi = free["trace_peak_live_bytes"], free["peak_reserved"]
    lo, tried = live - 1, 1  # lo: the largest budget known to fail (below the live bytes, all do)
    while hi - lo > a.step:
        mid = (lo + hi) // 2
        tried += 1
        if replay(a, trace, expandable, mid)["ooms"] == 0:
            hi = mid
        else:
            lo = mid
    return {"trace": os.path.basename(trace), "expandable": expandable, "peak_live": live,
            "uncapped_peak_reserved": free["peak_reserved"], "uncapped_ratio": free["peak_reserved"] / live,
            "min_budget": hi, "min_budget_ratio": hi / live, "replays": tried,
            "torch_peak_reserved": (free.get("torch") or {}).get("peak_reserved")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replay", default=os.path.join(ROOT, "build", "bench", "spillway-replay"))
    p.add_argument("--device", default="sim", help="sim (default) or cuda")
    p.add_argument("--trace", default=",".join(os.path.join(ROOT, "bench", "traces", f"torch-{m}.trace.gz")
                                                for m in ("resnet50", "gpt2")))
    p.add_argument("--step", default="2MiB", help="bisection resolution (default 2MiB)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true", help="synth-cnn, 64 MiB steps; checks the answer")
    a = p.parse_args()
    a.step = parse_bytes(a.step)
    if a.step <= 0:
        p.error(f"--step {a.step}: expected a positive size")
    if a.smoke:
        a.trace, a.step = os.path.join(ROOT, "bench", "traces", "synth-cnn.trace.gz"), 64 << 20
    rows = []
    try:
        for trace in a.trace.split(","):
            for expandable in (False, True):
                rows.append(min_budget(a, trace, expandable))
    except RuntimeError as e:
        print(f"replay_min_budget: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"tool": "replay_min_budget", "device": a.device, "step": a.step, "results": rows}, indent=1))
    else:
        for r in rows:
            print(f"{r['trace']:28} {'expandable' if r['expandable'] else 'fixed':10} peak live {r['peak_live']:>14,}"
                  f"  smallest budget {r['min_budget']:>14,} ({r['min_budget_ratio']:.4f}x)"
                  f"  uncapped reserved {r['uncapped_peak_reserved']:>14,} ({r['uncapped_ratio']:.4f}x)")
    if a.smoke:
        bad = [r for r in rows if not (r["peak_live"] <= r["min_budget"] <= r["uncapped_peak_reserved"])
               or replay(a, os.path.join(ROOT, "bench", "traces", r["trace"]), r["expandable"], r["min_budget"])["ooms"]]
        if bad:
            print(f"replay_min_budget: smoke check failed: {bad}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""spillway-evict-sim --json --timeline, and plot_results.py drawing it (no torch needed).

    python3 tests/test_sim_timeline_plot.py PATH/TO/spillway-evict-sim OUT_DIR

Checks: the timeline's fields, a point as the step began and one per op done (a run out of
memory: up to where it stopped), within the budget, ending at the run's counters and time; a
plot per run with a timeline, titled with the run, carrying the budget line; --timeline without --json is refused,
naming what is expected.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import plot_results  # noqa: E402


def main(sim, out):
    base = [sim, "--trace", "synth:mlp:layers=8,batch=16384,width=256", "--budgets", "0.8,0.3",
            "--policies", "dtr", "--modes", "drop", "--quiet"]
    refused = subprocess.run(base + ["--timeline"], capture_output=True, text=True)
    assert refused.returncode == 2, refused
    assert "--timeline without --json: expected --json too" in refused.stderr, refused.stderr
    doc = json.loads(subprocess.run(base + ["--json", "--timeline"], capture_output=True, text=True,
                                    check=True).stdout)
    trace = doc["traces"][0]
    fits, fails = trace["runs"]  # 0.8 fits with recomputes; 0.3 runs out of memory in the forward
    assert fits["ok"] and fits["recomputes"] > 0 and not fails["ok"], trace["runs"]
    for run in trace["runs"]:
        tl = run["timeline"]
        assert tl["fields"] == ["op", "t_ms", "allocated", "reserved", "resident", "spills", "drops",
                                "eager_drops", "restores", "recomputes"], tl["fields"]
        # A point as the step began and after each op done (up to the one that failed).
        ops = trace["ops"] if run["ok"] else run["ops_done"]
        assert [s[0] for s in tl["samples"]] == list(range(ops + 1)), tl["samples"]
        assert all(s[2] <= s[3] <= run["budget"] for s in tl["samples"]), (run["budget"], tl["samples"])
    last = dict(zip(fits["timeline"]["fields"], fits["timeline"]["samples"][-1]))
    assert last["recomputes"] == fits["recomputes"] and last["drops"] == fits["drops"] and \
        last["eager_drops"] == fits["eager_drops"] and abs(last["t_ms"] * 1e6 - fits["time_ns"]) < 1, (last, fits)
    path = os.path.join(out, "timeline.json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)
    assert plot_results.main(["--sim", path, "--out", out]) == 0
    for run, title in ((fits, "dtr/drop at 0.80: memory over one step<"),
                       (fails, "dtr/drop at 0.30: memory over one step, out of memory where it ends<")):
        svg = os.path.join(out, f"sim-timeline-{plot_results.slug(trace['name'])}-dtr-drop-{run['ratio']}.svg")
        text = open(svg).read()
        assert title in text, (svg, title)
        assert ">budget<" in text, svg
    print("sim timeline and its plots: ok")


if __name__ == "__main__":
    main(*sys.argv[1:3])

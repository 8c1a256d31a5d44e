#!/usr/bin/env python3
"""The chain target's dense cells (synth:mlp, the recorded torch MLP) with rotor's lower bound
beside its plan, as the review of 2026-11-28 has them judged: by the time a run adds to the
baseline (recomputes and compaction's stalls), corrupt runs counting as none, and the recorded
torch MLP, whose backward makes gradients rotor's model leaves out, reported but not judged.

    bench/results/sim-2026-11-28-chain-review/run.py SIM > chain.md

SIM: a spillway-evict-sim built from this commit (cmake -S . -B B -DCMAKE_BUILD_TYPE=Release
-DSPILLWAY_WITH_TORCH=OFF && make -C B spillway_evict_sim). Drop-only, dtr and dtr-frag, --verify,
compaction on (the default); 1 step measured without warm-up, and the second step with next uses
predicted from the first (--warmup-steps 1); PyTorch's segment sizes and expandable segments.
"""
import json
import subprocess
import sys

TRACES = [
    ("synth-mlp", "synth:mlp", "0.285,0.3,0.316,0.32,0.33,0.34,0.35,0.37,0.4,0.45,0.5,0.6,0.7,0.8,0.9"),
    ("torch-mlp", "bench/op_traces/torch-mlp-cpu.optrace.gz",
     "0.34,0.36,0.38,0.4,0.42,0.45,0.48,0.5,0.51,0.525,0.53,0.54,0.56,0.58,0.6,0.65,0.7,0.8,0.9"),
]


def run(sim, trace, ratios, expandable, warmup):
    cmd = [sim, "--trace", trace, "--budgets", ratios, "--policies", "dtr,dtr-frag",
           "--modes", "drop", "--verify", "--warmup-steps", str(warmup), "--json"]
    if expandable:
        cmd.append("--expandable")
    out = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)["traces"][0], " ".join(cmd[1:])


def cell(t):
    if t is None:
        return "(below min)"
    if t["best"] == "":
        return "none finished" + (" (not judged)" if not t["judged"] else ": **missed**")
    f = "inf" if t["factor"] < 0 else f"{t['factor']:.3f}"
    b = "inf" if t["factor_vs_bound"] < 0 else f"{t['factor_vs_bound']:.3f}"
    fb = " [fallback]" if t["rotor_fallback"] else ""
    verdict = " (not judged)" if not t["judged"] else "" if t["met"] else ": **missed**"
    return f"{f} / {b}{fb} {t['best'].split('/')[0]}" + verdict


def table(sim, name, trace_arg, ratios_text):
    cols = [("expandable, 1 step", True, 0), ("expandable, predicted", True, 1),
            ("fixed, 1 step", False, 0), ("fixed, predicted", False, 1)]
    data, cmds, mins = [], [], {}
    for _, exp, warm in cols:
        trace, cmd = run(sim, trace_arg, ratios_text, exp, warm)
        data.append({round(t["ratio"], 3): t for t in trace["chain_targets"]})
        cmds.append(cmd)
        mins["expandable" if exp else "fixed"] = trace["rotor"]["min_budget"] / trace["peak_reserved"]
    print(f"## {name}\n")
    print("rotor's minimum, ratio of each kind's own peak: " +
          ", ".join(f"{k} {v:.3f}" for k, v in sorted(mins.items(), reverse=True)) + "\n")
    print("| ratio | " + " | ".join(c[0] for c in cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    missed = total = unjudged = 0
    for r in [float(x) for x in ratios_text.split(",")]:
        cells = []
        for d in data:
            t = d.get(round(r, 3))
            cells.append(cell(t))
            if t is not None and not t["judged"]:
                unjudged += 1
            elif t is not None:
                total += 1
                missed += 0 if t["met"] else 1
        print(f"| {r} | " + " | ".join(cells) + " |")
    if unjudged:
        print(f"\nNot judged: {unjudged} cells (rotor's model leaves out the gradients the backward makes).\n")
    else:
        print(f"\nMissed: {missed} of {total} cells at or above rotor's minimum.\n")
    return cmds


def main():
    sim = sys.argv[1]
    print("# Chain target with rotor's lower bound (simulated device)\n")
    print("Each cell: the best drop-only run's time added to the baseline (recomputes and compaction's")
    print("stalls; dtr, dtr-frag) / rotor's extra compute, then / rotor's lower bound (its program with")
    print("sizes rounded down: no persistent schedule costs less), and the policy. Met at <= 1.15")
    print("against the plan, or against the bound where the plan is a fallback (the slot grid found")
    print("none: the least-memory schedule, no optimum).\n")
    cmds = []
    for name, trace_arg, ratios_text in TRACES:
        cmds += table(sim, name, trace_arg, ratios_text)
    print("Commands (SIM = the binary):\n")
    for c in cmds:
        print(f"    SIM {c}")


if __name__ == "__main__":
    main()

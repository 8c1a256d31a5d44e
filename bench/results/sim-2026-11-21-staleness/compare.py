"""Table of two engines from run.sh's JSON (compare.py DIR OLD NEW): overhead (%) per trace, mode, budget and policy, and the
chain target rows for synth-mlp. A run that ran out of memory is OOM; a verify mismatch is flagged."""
import glob, json, os, sys

out = sys.argv[1]
old, new = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("before", "after")
policies = ["dtr", "dtr-frag", "lru", "largest"]

def runs(path):
    t = json.load(open(path))["traces"][0]
    return t, {(r["policy"], r["mode"], r["ratio"]): r for r in t["runs"]}

def cell(r):
    if r is None: return "-"
    if r["verify_mismatches"]: return "MISMATCH"
    return f"{100 * r['overhead']:.1f}" if r["ok"] else "OOM"

changed = better = worse = 0
for before in sorted(glob.glob(os.path.join(out, f"{old}-*.json"))):
    name = os.path.basename(before)[len(old) + 1:-len(".json")]
    tb, b = runs(before)
    ta, a = runs(os.path.join(out, f"{new}-{name}.json"))
    print(f"== {name} (overhead %, {old} -> {new})")
    for mode in ["drop", "hybrid"]:
        for ratio in sorted({k[2] for k in b}, reverse=True):
            row = []
            for p in policies:
                rb, ra = b.get((p, mode, ratio)), a.get((p, mode, ratio))
                if rb is None and ra is None: continue
                cb, ca = cell(rb), cell(ra)
                if cb != ca:
                    changed += 1
                    ob = rb["overhead"] if rb and rb["ok"] else float("inf")
                    oa = ra["overhead"] if ra and ra["ok"] else float("inf")
                    better += oa < ob
                    worse += oa > ob
                row.append(f"{p} {cb}->{ca}")
            print(f"  {mode:6s} {ratio:.2f}  " + "  ".join(row))
    for label, t in ((old, tb), (new, ta)):
        for c in t.get("chain_targets", []):
            print(f"  chain target {label} {c}")
mism = sum(r["verify_mismatches"] for f in glob.glob(os.path.join(out, f"{new}-*.json")) for r in json.load(open(f))["traces"][0]["runs"])
checks = sum(r["verify_checks"] for f in glob.glob(os.path.join(out, f"{new}-*.json")) for r in json.load(open(f))["traces"][0]["runs"])
print(f"\ncells changed: {changed} (better {better}, worse {worse}); verify: {checks} checks, {mism} mismatches")

# Per mode: runs that now fit / no longer fit, and among runs that fit both times the geometric
# mean of (1 + overhead after) / (1 + overhead before).
import math
for mode in ["drop", "hybrid"]:
    fit = lost = 0
    logs = []
    for before in sorted(glob.glob(os.path.join(out, f"{old}-*.json"))):
        name = os.path.basename(before)[len(old) + 1:-len(".json")]
        _, b = runs(before)
        _, a = runs(os.path.join(out, f"{new}-{name}.json"))
        for k, rb in b.items():
            ra = a.get(k)
            if k[1] != mode or ra is None: continue
            if rb["ok"] and ra["ok"]: logs.append(math.log((1 + ra["overhead"]) / (1 + rb["overhead"])))
            elif ra["ok"]: fit += 1
            elif rb["ok"]: lost += 1
    gm = math.exp(sum(logs) / len(logs)) if logs else 1.0
    print(f"{mode}: {fit} runs fit that did not, {lost} no longer fit; over the {len(logs)} runs that fit both "
          f"times, time after / time before = {gm:.3f} (geometric mean)")

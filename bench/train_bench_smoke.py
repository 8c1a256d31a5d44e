"""train_bench_smoke: what train_bench.py --smoke checks in the results of its suite.

check_smoke(results) -> a list of failures (empty: passed), for the results of the budget suite
run on the smoke MLP on CPU: every configuration ran (only native at a budget, spillway-alloc and
compile-budget may be skipped), every loss is bit-identical to the unconstrained run's, each
spillway mode ran on the simulated device within its budget and evicted through the allocator's
pressure (spills; drops and recomputes; evictions), and the baselines on torch's CPU allocator
leave the GPU-only fields null. Standard library only.
"""

from train_bench_models import SPILLWAY_MODES


def check_smoke(results):
    failures = []
    ref = next((r for r in results if r["ratio"] is None), None)
    if ref is None or ref["status"] != "ok" or not ref.get("saved_activation_bytes"):
        return [f"the unconstrained run failed: {ref and ref.get('error')}"]
    for r in results:
        name = f"{r['config']} at {r['ratio']}"
        if r["status"] == "skipped":
            if r["config"] not in ("native", "spillway-alloc", "compile-budget"):
                failures.append(f"{name} was skipped: {r['error']}")
            continue
        if r["status"] != "ok":
            failures.append(f"{name}: {r['status']}: {r.get('error')} {r.get('stderr_tail', '')[-400:]}")
            continue
        if r["losses"] != ref["losses"]:
            failures.append(f"{name}: losses {r['losses']} differ from the unconstrained run's {ref['losses']}")
        mode = SPILLWAY_MODES.get(r["config"])
        if mode and r["ratio"] is not None:
            # On the simulated device, under its budget: the allocator's pressure evicted.
            if not r.get("budget_bytes") or not r.get("peak_reserved"):
                failures.append(f"{name}: no budget or peak on the simulated device: "
                                f"{r.get('budget_bytes')}, {r.get('peak_reserved')}")
            elif r["peak_reserved"] > r["budget_bytes"]:
                failures.append(f"{name}: peak reserved {r['peak_reserved']} over the budget "
                                f"{r['budget_bytes']}")
            want = {"spill": ("spills",), "drop": ("drops", "recomputes"), "hybrid": ("evictions",)}[mode]
            for k in want + ("pressure_calls",):
                if not r.get(k):
                    failures.append(f"{name}: expected {k} > 0 under the budget, got {r.get(k)}")
        elif r["ratio"] is not None:
            for field in ("peak_reserved", "peak_allocated", "budget_bytes"):
                if r.get(field) is not None:
                    failures.append(f"{name}: GPU-only field {field} is {r[field]} on CPU, not null")
    if not ref.get("peak_reserved"):
        failures.append("the unconstrained run measured no peak on the simulated device")
    return failures

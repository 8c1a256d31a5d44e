# The smoke MLP of bench/train_bench.py (4 residual blocks, batch 1024, fp32, SGD with momentum,
# one spillway.checkpoint per block) on CPU tensors served by spillway's simulated device, under
# budgets of its peak, in each spillway mode: one worker process per cell, as train_bench runs it.
# Usage (from the repository root): PYTHONPATH=<build>/python .venv/bin/python \
#   bench/results/sim-2026-11-27-early-stop/smoke_mlp.py [RATIO ...]
# Prints one JSON line per cell, the unconstrained run first (its peak reserved bytes are what
# the ratios are of); "identical": every loss equal to the unconstrained run's.
import json, os, sys

os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the workers
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from train_bench import run_subprocess  # noqa: E402  (bench/train_bench.py: one worker per cell)

KEEP = ("config", "ratio", "budget_bytes", "status", "peak_reserved", "drops", "spills",
        "recomputes", "recomputes_stopped", "bytes_dropped", "step_ms_median", "error")


def run(config, ratio, budget):
    spec = {"kind": "train", "model": "mlp", "config": config, "ratio": ratio, "device": "cpu",
            "batch": 1024, "precision": "fp32", "accum": 1, "steps": 10, "warmup": 3,
            "policy": None, "spillway_settings": None, "timeline": False, "seed": 0,
            "budget_bytes": budget, "deterministic": True, "sim": True}
    return run_subprocess(spec, timeout=600)


ref = run("native", None, None)
print(json.dumps({k: ref.get(k) for k in KEEP}), flush=True)
for ratio in [float(r) for r in sys.argv[1:]] or [0.7, 0.5, 0.45, 0.4]:
    for config in ("spillway-spill", "spillway-drop", "spillway-hybrid"):
        r = run(config, ratio, int(ref["peak_reserved"] * ratio))
        cell = {k: r.get(k) for k in KEEP}
        cell["identical"] = r.get("status") == "ok" and r.get("losses") == ref.get("losses")
        print(json.dumps(cell), flush=True)

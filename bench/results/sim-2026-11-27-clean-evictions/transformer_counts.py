"""tests/test_torch_budget_cpu.py's transformer (4 layers, checkpoint_sequential in 4 segments,
CPU tensors on spillway's simulated device under a budget of 70% and 50% of the unconstrained
peak), one training step per mode, and the activation manager's counters after it, including the
clean evictions and the bytes copied each way. One JSON line per (ratio, mode).

    PYTHONPATH=build/python .venv/bin/python bench/results/sim-2026-11-27-clean-evictions/transformer_counts.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
import test_torch_budget_cpu as t  # noqa: E402

KEYS = ("packed", "spills", "drops", "restores", "prefetches", "prefetches_unused",
        "clean_evictions", "recomputes", "bytes_spilled", "bytes_restored")
T = t.TrainUnderBudget
T.setUpClass()
for ratio in (0.7, 0.5):
    for mode in ("spill", "hybrid", "drop"):
        (got, acts), _ = T.run_under(T, ratio, mode, False)
        print(json.dumps({"ratio": ratio, "mode": mode, **{k: acts.get(k) for k in KEYS}}))

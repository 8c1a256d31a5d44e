#!/usr/bin/env python3
"""activation_evict_bench: what choosing and evicting a saved activation costs under the
allocator's pressure, as the number of saved storages grows.

    PYTHONPATH=build/python python3 bench/activation_evict_bench.py [--saved 1000,4000,16000]
        [--kib 16] [--mode spill] [--policy dtr] [--json FILE]
    PYTHONPATH=build/python python3 bench/activation_evict_bench.py --smoke

Contract
- Runs on spillway's simulated device serving torch's CPU tensors (spillway.install(backend="sim",
  cpu_tensors=True)): no GPU is needed, and every allocation over the budget runs the activation
  manager's pressure handler from inside the operator, as on a GPU. Each count of --saved runs in
  its own process (install comes once per process), with one torch thread.
- The workload: a chain of N elementwise ops (y = y.sin()) on a tensor of --kib KiB under
  spillway.activations(mode, policy, min_bytes=1 KiB), so that N storages are saved, then the
  backward. The budget is half of what the chain saves (at least 1 MiB), so about half of the
  saved storages are evicted during the forward, each by one pressure call, while the others are
  candidates; the backward copies or recomputes them back.
- Per count, one JSON line on stdout (and with --json FILE a document holding them): saved,
  budget_bytes, evictions, pressure_calls, evict_ns (the manager's host time in choosing and
  evicting, the activation_stats field), evict_us_per_call (evict_ns / pressure_calls / 1000),
  forward_s and backward_s (wall), and grad_identical: the leaf's gradient equals an unconstrained
  run's, bit for bit. Status "ok", or "error" with the message.
- --smoke: counts 300 and 1000, and exit 1 unless each run evicted, was bit-identical and reports
  a positive evict_ns. A harness check: the figures of a 2-core machine are not a GPU's.
- Bad arguments exit 2 with a message naming the value.
"""

import argparse
import json
import os
import subprocess
import sys
import time

MARK = "ACTIVATION_EVICT_BENCH "


def worker(saved, kib, mode, policy):
    import torch
    torch.set_num_threads(1)
    import spillway
    n = kib * 256  # floats
    budget = max(1 << 20, saved * kib * 1024 // 2)
    x0 = torch.randn(n, generator=torch.Generator().manual_seed(0))

    def run(acts):
        x = x0.clone().requires_grad_()
        t0 = time.perf_counter()
        if acts is not None:
            acts.__enter__()
        try:
            y = x
            for _ in range(saved):
                y = y.sin()
        finally:
            if acts is not None:
                acts.__exit__(None, None, None)
        t1 = time.perf_counter()
        y.sum().backward()
        return x.grad, t1 - t0, time.perf_counter() - t1

    reference, _, _ = run(None)  # before install: torch's CPU allocator, no budget
    spillway.install(backend="sim", cpu_tensors=True, budget=budget, sim_capacity="8GiB")
    acts = spillway.activations(mode=mode, policy=policy, min_bytes=1024)
    grad, forward_s, backward_s = run(acts)
    s = acts.stats()
    calls = s["pressure_calls"]
    evict_ns = s.get("evict_ns")  # None: a build from before the field (a baseline)
    return {"status": "ok", "saved": saved, "kib": kib, "mode": mode, "policy": policy,
            "budget_bytes": budget, "evictions": s["evictions"], "pressure_calls": calls,
            "evict_ns": evict_ns,
            "evict_us_per_call": round(evict_ns / calls / 1000, 3) if calls and evict_ns else None,
            "forward_s": round(forward_s, 4), "backward_s": round(backward_s, 4),
            "grad_identical": bool(torch.equal(grad, reference))}


def run_one(saved, a):
    spec = json.dumps({"saved": saved, "kib": a.kib, "mode": a.mode, "policy": a.policy})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", spec], env=env,
                           capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "saved": saved, "error": f"timed out after {a.timeout} s"}
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {"status": "error", "saved": saved,
            "error": f"exit {p.returncode}: {p.stderr.strip()[-600:]}"}


def parse_counts(text):
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--saved {text!r} is invalid: expected counts like 1000,4000")
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--saved {text!r} is invalid: expected counts >= 1")
    return counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saved", type=parse_counts, default=[1000, 4000, 16000])
    ap.add_argument("--kib", type=int, default=16)
    ap.add_argument("--mode", choices=("spill", "drop", "hybrid"), default="spill")
    ap.add_argument("--policy", choices=("dtr", "lru", "largest"), default="dtr")
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.kib < 1:
        ap.error(f"--kib {a.kib} is invalid: expected KiB >= 1")
    if a.worker:
        spec = json.loads(a.worker)
        print(MARK + json.dumps(worker(spec["saved"], spec["kib"], spec["mode"], spec["policy"])))
        return 0
    if a.mode == "drop":
        ap.error("--mode drop is invalid here: the chain has no checkpoint segments to recompute "
                 "from; expected spill or hybrid")
    counts = [300, 1000] if a.smoke else a.saved
    results = []
    for saved in counts:
        r = run_one(saved, a)
        results.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tool": "activation_evict_bench", "argv": sys.argv[1:], "results": results}, f,
                      indent=1)
    if a.smoke:
        bad = [r for r in results if r.get("status") != "ok" or not r.get("evictions")
               or not r.get("grad_identical") or not r.get("evict_ns")]
        print(f"activation_evict_bench smoke: {'FAILED' if bad else 'PASSED'}", file=sys.stderr)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torch_gpu_checks: what issue 4 asks to verify on a GPU, each case in a fresh process.

    python3 tests/torch_gpu_checks.py [--steps 1000] [--json FILE] [--cases budgets,tooling]

--cases (default: SPILLWAY_GPU_CHECKS, else every case) picks the cases to run, so a lent machine's
short call can run the one that matters (bench/gpu_suite.sh passes the variable through ctest).

Without a CUDA device it prints "SKIPPED: no CUDA device" and exits 0 (ctest runs it everywhere;
bench/gpu_suite.sh runs it on the GPU machine). Needs the spillway package on PYTHONPATH.

Cases
- identical:  losses and gradients of an MLP, a CNN with BatchNorm and dropout, and a small
              transformer, with deterministic algorithms: spillway installed with every activation
              evicted (max_resident=0; checkpoint segments dropped, the rest spilled) against a run
              on PyTorch's own allocator. Must be bit-identical. And the MLP in spill mode with
              every storage evicted at each Linear's backward, so that storages restored ahead
              are spilled again while their copy back may still run.
- budgets:    the transformer trained at 70%, 50% and 30% of its unconstrained peak reserved bytes
              (measured first under spillway without a budget), with activations() and checkpoint
              segments under the allocator's pressure, hybrid, and at 50% also spill-only and
              drop-only: must complete; step time and peak reported.
- tooling:    memory_stats (torch.cuda and torch.accelerator), the profiler's CUDA memory,
              memory_summary, _snapshot with history (segment events included), empty_cache and
              the cudnn benchmark under spillway.
- leaks:      --steps training steps; allocated bytes after the last equal those after step 2.
- preload:    a PyTorch training script under LD_PRELOAD=libspillway_preload.so with
              PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (needs SPILLWAY_PRELOAD_LIB).
Exit status 0 when every case passed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

COMMON = textwrap.dedent("""
    import os, sys, time, json, torch
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    def make(name):
        torch.manual_seed(0)
        if name == "mlp":
            layers = []
            for _ in range(8):
                layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
            return torch.nn.Sequential(*layers), lambda: torch.randn(1024, 2048)
        if name == "cnn":
            blocks = []
            c = 3
            for w in (64, 128, 128, 256):
                blocks += [torch.nn.Conv2d(c, w, 3, padding=1), torch.nn.BatchNorm2d(w),
                           torch.nn.ReLU(), torch.nn.Dropout(0.1)]
                c = w
            return (torch.nn.Sequential(*blocks, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                        torch.nn.Linear(c, 10)), lambda: torch.randn(32, 3, 64, 64))
        layer = lambda: torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.1, batch_first=True)
        return torch.nn.Sequential(*[layer() for _ in range(6)]), lambda: torch.randn(16, 256, 512)
    LAST = {}  # the last step's activation manager
    def step(model, x, spill, segments=None):
        import spillway
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        if spill is None:
            loss = model(x).float().square().mean()
        else:
            with spillway.activations(**spill) as acts:
                y = spillway.checkpoint_sequential(model, segments, x) if segments else model(x)
            LAST["acts"] = acts
            loss = y.float().square().mean()
        loss.backward()
        return loss
""")


def run(code, env=None, timeout=1800):
    # A case killed by a signal still leaves in its stderr the native stack (spillway's crash
    # backtrace) and the Python stack of every thread (faulthandler); the exit status is added to
    # it (a negative status is the signal's number).
    e = dict(os.environ, PYTHONFAULTHANDLER="1", SPILLWAY_CRASH_BACKTRACE="1")
    e.update(env or {})
    p = subprocess.run([sys.executable, "-c", COMMON + textwrap.dedent(code)], env=e,
                       capture_output=True, text=True, timeout=timeout)
    err = p.stderr if p.returncode == 0 else f"{p.stderr}\n(exit status {p.returncode})"
    return p.returncode, p.stdout, err


def case_identical(tmp):
    results = {}
    for name in ("mlp", "cnn", "transformer"):
        ref, got = os.path.join(tmp, name + "-ref.pt"), os.path.join(tmp, name + "-got.pt")
        rc1, _, e1 = run(f"""
            model, data = make("{name}"); model = model.cuda(); x = data().cuda()
            loss = step(model, x, None)
            torch.save([loss.cpu()] + [p.grad.cpu() for p in model.parameters()], "{ref}")
        """)
        rc2, _, e2 = run(f"""
            import spillway; spillway.install()
            model, data = make("{name}"); model = model.cuda(); x = data().cuda()
            loss = step(model, x, dict(max_resident=0, min_bytes=0), segments=3)
            torch.save([loss.cpu()] + [p.grad.cpu() for p in model.parameters()], "{got}")
            print(json.dumps(spillway.stats()))
        """)
        ok = rc1 == 0 and rc2 == 0 and all(
            torch_equal(a, b) for a, b in zip(load(ref), load(got)))
        results[name] = {"passed": ok, "stderr": (e1 + e2)[-2000:] if not ok else ""}
    # Storages restored ahead and evicted again before their unpack, while their copy back may
    # still run: each Linear's backward hook evicts everything, so the prefetches of the unpack
    # before are evicted again, to the host copies they kept (no copy out: clean_evictions), and
    # their blocks' frees wait for the copies back still writing them (record_stream).
    ref, got = os.path.join(tmp, "mlp-ref.pt"), os.path.join(tmp, "mlp-evict-got.pt")
    rc, _, e = run(f"""
        import spillway; spillway.install()
        model, data = make("mlp"); model = model.cuda(); x = data().cuda()
        def evict_all(*_):
            LAST["acts"].evict(1 << 50)
        for m in model:
            if isinstance(m, torch.nn.Linear):
                m.register_full_backward_hook(evict_all)
        loss = step(model, x, dict(mode="spill", prefetch=4, min_bytes=0))
        s = LAST["acts"].stats()
        assert s["prefetches"] > 0 and s["prefetches_unused"] > 0 and s["clean_evictions"] > 0, s
        torch.save([loss.cpu()] + [p.grad.cpu() for p in model.parameters()], "{got}")
    """)
    ok = rc == 0 and all(torch_equal(a, b) for a, b in zip(load(ref), load(got)))
    results["mlp, prefetches evicted"] = {"passed": ok, "stderr": e[-2000:] if not ok else ""}
    # An activation made and saved on a side stream, spilled from the default stream while the
    # side stream's work is still queued: the copy out waits for the stream it was saved on
    # (before, only for the evicting thread's, and could read the block before it was written).
    rc, _, e = run("""
        import spillway; spillway.install()
        side = torch.cuda.Stream()
        a = torch.randn(4096, 4096, device="cuda") / 64
        a.requires_grad_()
        torch.cuda.synchronize()
        with spillway.activations(mode="spill", min_bytes=0) as acts:
            with torch.cuda.stream(side):
                h = a
                for _ in range(16):
                    h = torch.tanh(h @ a)  # work queued on `side`, tens of milliseconds of it
                y = h.sin()                 # sin saves h, made on `side`
                expected = h.detach().clone()
            del h
            freed, _ = acts.evict(1 << 50)  # from the default stream, `side` still busy
            assert freed > 0 and acts.stats()["spills"] > 0, acts.stats()
        torch.cuda.synchronize()
        got = y.grad_fn._saved_self  # unpacked: copied back
        torch.cuda.synchronize()
        assert torch.equal(got, expected), "the spill read h before it was written"
    """)
    results["saved on a side stream, spilled from another"] = {"passed": rc == 0,
                                                               "stderr": e[-2000:] if rc else ""}
    # A gradient penalty inside a segment: on CUDA its backward runs on PyTorch's device thread
    # with the segment's hooks; what it saves there is not the segment's, in the first run nor in
    # the replay, or the dropped saves are refilled from shifted positions (all of one size here:
    # wrong gradients with no error). The CPU test carries the hooks to a thread by hand.
    rc, _, e = run("""
        import spillway; spillway.install()
        def penalised(t):
            h = t.sin()
            g, = torch.autograd.grad(h.sum(), t, create_graph=True)
            return (h * g).sin()
        w0 = torch.randn(1 << 20, device="cuda")
        w = w0.clone().requires_grad_()
        penalised(w * 3).sum().backward()
        reference, w = w.grad.clone(), w0.clone().requires_grad_()
        with spillway.activations(mode="drop", min_bytes=0) as acts:
            loss = spillway.checkpoint(penalised, w * 3).sum()
            assert acts.evict(1 << 50)[0] > 0, acts.stats()
            loss.backward()
        assert acts.stats()["recomputes"] == 1, acts.stats()
        assert torch.equal(w.grad, reference), "gradient penalty: replayed saves refilled out of place"
    """)
    results["gradient penalty inside a segment"] = {"passed": rc == 0, "stderr": e[-2000:] if rc else ""}
    return all(r["passed"] for r in results.values()), results


def load(path):
    import torch
    return torch.load(path)


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


def case_budgets(tmp):
    rc, out, err = run("""
        import spillway; spillway.install()
        model, data = make("transformer"); model = model.cuda(); x = data().cuda()
        step(model, x, None); torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter(); step(model, x, None); torch.cuda.synchronize()
        print(json.dumps({"peak": torch.cuda.memory_stats()["reserved_bytes.all.peak"],
                          "step_s": time.perf_counter() - t}))
    """)
    if rc != 0:
        return False, {"error": err[-16000:]}
    base = json.loads(out.strip().splitlines()[-1])
    rows = {"unconstrained": base}
    ok = True
    # Each mode at 50% (spill does no recomputation, drop no copy: which one fails says where).
    for ratio, mode in ((0.7, "hybrid"), (0.5, "spill"), (0.5, "drop"), (0.5, "hybrid"), (0.3, "hybrid")):
        rc, out, err = run(f"""
            import spillway; spillway.install(budget={int(base["peak"] * ratio)})
            model, data = make("transformer"); model = model.cuda(); x = data().cuda()
            step(model, x, dict(mode="{mode}"), segments=6); torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter(); step(model, x, dict(mode="{mode}"), segments=6); torch.cuda.synchronize()
            s = spillway.stats()
            link = LAST["acts"].stats()  # the PCIe link as the manager measured it
            print(json.dumps({{"peak": torch.cuda.memory_stats()["reserved_bytes.all.peak"],
                              "step_s": time.perf_counter() - t,
                              "spills": s.get("activations.spills"), "drops": s.get("activations.drops"),
                              "prefetches": s.get("activations.prefetches"),
                              "prefetches_unused": s.get("activations.prefetches_unused"),
                              "clean_evictions": s.get("activations.clean_evictions"),
                              "unpacks_waiting": s.get("activations.unpacks_waiting"),
                              "spill_bytes_per_s": link.get("spill_bytes_per_s"),
                              "restore_bytes_per_s": link.get("restore_bytes_per_s")}}))
        """)
        key = f"{ratio:.0%}" + ("" if mode == "hybrid" else f" {mode}")
        rows[key] = json.loads(out.strip().splitlines()[-1]) if rc == 0 else {"error": err[-16000:]}
        ok = ok and rc == 0
        if rc == 0 and mode == "spill":
            # The spills' copies were timed (CUDA events): the link is not the 25 GB/s guess.
            measured = rows[key]["spill_bytes_per_s"] not in (None, 25_000_000_000)
            rows[key]["link_measured"] = measured
            ok = ok and measured
    return ok, rows


def case_tooling(tmp):
    rc, out, err = run("""
        import spillway; spillway.install(budget="8GiB")
        torch.cuda.memory._record_memory_history(max_entries=100000)
        torch.backends.cudnn.benchmark = True
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3), torch.nn.ReLU()).cuda()
        model(torch.randn(8, 3, 64, 64, device="cuda")).sum().backward()
        stats = torch.cuda.memory_stats(); assert stats["allocated_bytes.all.current"] > 0
        # torch.accelerator asks c10's CUDA allocator (at::getDeviceAllocator): spillway too.
        assert torch.accelerator.memory_allocated() == torch.cuda.memory_allocated() > 0
        # torch's profiler sees CUDA memory (spillway reports it, as PyTorch's allocator does).
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
            y = torch.empty(1 << 20, device="cuda") + 1; del y
        assert any(e.device_memory_usage > 0 for e in prof.key_averages()), prof.key_averages()
        assert "memory summary" in torch.cuda.memory_summary()
        snap = torch.cuda.memory._snapshot(); assert snap["segments"] and snap["device_traces"][0]
        # Frees carry their sizes and complete (PyTorch's memory viewer rebuilds blocks from them).
        frees = [e for e in snap["device_traces"][0] if e["action"] == "free_completed"]
        assert frees and all(e["size"] > 0 for e in frees), frees[:3]
        import torch.cuda._memory_viz as viz; assert "free completed" in viz.trace(snap)
        # Segment events, as PyTorch's allocator records them (NCCL's register hook reads them from
        # the trace trackers): every segment of the snapshot was allocated in the trace.
        allocs = {e["addr"] for e in snap["device_traces"][0] if e["action"] == "segment_alloc"}
        assert allocs and {s["address"] for s in snap["segments"]} <= allocs, (allocs, snap["segments"])
        del model; torch.cuda.empty_cache()
        assert torch.cuda.memory_stats()["reserved_bytes.all.current"] < stats["reserved_bytes.all.peak"]
        after = torch.cuda.memory._snapshot()["device_traces"][0]
        assert any(e["action"] == "segment_free" for e in after), [e["action"] for e in after[-10:]]
        print("ok")
    """)
    return rc == 0, {"stderr": err[-16000:]}


def case_leaks(tmp, steps):
    rc, out, err = run(f"""
        import spillway; spillway.install()
        model, data = make("mlp"); model = model.cuda(); x = data().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        marks = {{}}
        for i in range({steps}):
            step(model, x, dict(max_resident="256MiB"), segments=4); opt.step()
            if i in (1, {steps} - 1):
                torch.cuda.synchronize(); marks[i] = torch.cuda.memory_allocated()
        print(json.dumps(marks)); assert marks[1] == marks[{steps} - 1], marks
    """, timeout=3600)
    return rc == 0, {"stdout": out[-500:], "stderr": err[-16000:]}


def case_preload(tmp):
    lib = os.environ.get("SPILLWAY_PRELOAD_LIB")
    if not lib:
        return False, {"error": "SPILLWAY_PRELOAD_LIB is not set"}
    rc, out, err = run("""
        model, data = make("mlp"); model = model.cuda(); x = data().cuda()
        for _ in range(3): step(model, x, None)
        print("ok")
    """, env={"LD_PRELOAD": lib, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync",
              "SPILLWAY_CONF": "budget:16GiB"})
    return rc == 0, {"stderr": err[-16000:]}


CASES = ("identical", "budgets", "tooling", "leaks", "preload")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--json")
    ap.add_argument("--cases", default=os.environ.get("SPILLWAY_GPU_CHECKS") or ",".join(CASES),
                    help="comma-separated, from " + ", ".join(CASES))
    args = ap.parse_args()
    wanted = [c for c in args.cases.split(",") if c]
    unknown = [c for c in wanted if c not in CASES]
    if unknown or not wanted:
        ap.error(f"--cases {args.cases!r}: expected some of {', '.join(CASES)}")
    import torch
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device")
        return 0
    report, failed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("identical", case_identical), ("budgets", case_budgets),
                         ("tooling", case_tooling), ("leaks", lambda t: case_leaks(t, args.steps)),
                         ("preload", case_preload)):
            if name not in wanted:
                continue
            start = time.time()
            ok, detail = fn(tmp)
            report[name] = {"passed": ok, "seconds": round(time.time() - start, 1), "detail": detail}
            print(f"{name}: {'passed' if ok else 'FAILED'}", flush=True)
            if not ok:
                failed.append(name)
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

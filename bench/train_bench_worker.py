"""train_bench_worker: one configuration of bench/train_bench.py run in this process: the child
side of its subprocess protocol.

Contract
- Protocol: the parent runs `python3 train_bench.py --worker SPEC` (the same script, so this module
  is imported from beside it), SPEC being a JSON object; worker_main(SPEC) writes one line,
  RESULT_MARK followed by the result as a JSON object, to stdout and returns 0. An exception in the
  work becomes a result with status "error"; only a SPEC that is not a JSON object raises. A crash
  or a timeout leaves no such line, and the parent records the configuration as crashed or timeout.
- SPEC "kind": "train" (the default) -> run_worker(spec): the fields of RESULT_FIELDS plus kind
  (and search when the spec has it); "probe" -> probe_device(): the versions, the device, whether
  spillway imports; "copy-limit" -> copy_limit(spec); "spill-profile" -> spill_profile(spec).
- run_worker: install_for(spec) first (spillway.install or the memory fraction: before anything
  touches CUDA), then the model (train_bench_models), spec's warmup and timed steps under the
  configuration's Pressure (an activations manager or save_on_cpu) and autocast; status ok / oom /
  error; spillway's counters summed over the timed steps; GPU-only fields null off CUDA; with
  "timeline", one more untimed step sampled at the block boundaries by Timeline.
- analyze_copy_trace(events) is pure (Chrome-trace events in, copy figures per direction out);
  --smoke checks it on synthetic events.
- Importing this module does not import torch; each function imports what it needs.
"""

import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from train_bench_models import SPILLWAY_MODES, build_model, make_optimizer, wrap_blocks

RESULT_MARK = "TRAIN_BENCH_RESULT "

RESULT_FIELDS = (
    "model", "config", "ratio", "budget_bytes", "max_resident_bytes", "batch", "precision", "accum",
    "status", "error", "device", "step_ms_median", "step_ms", "first_step_ms", "samples_per_s",
    "ms_per_sample", "peak_reserved", "peak_allocated", "saved_activation_bytes", "alloc_retries",
    "ooms", "spills", "drops", "restores", "recomputes", "recomputes_stopped", "evictions",
    "prefetches", "prefetches_unused", "clean_evictions", "unpacks_waiting", "bytes_spilled",
    "bytes_dropped", "bytes_restored", "pressure_calls", "losses", "timeline", "wall_s")
COUNTERS = ("spills", "drops", "restores", "recomputes", "recomputes_stopped", "evictions",
            "prefetches", "prefetches_unused", "clean_evictions", "unpacks_waiting", "bytes_spilled",
            "bytes_dropped", "bytes_restored")


# ================================================================================================
# Worker: one configuration in this process (spec from the parent)
# ================================================================================================

def import_torch():
    import torch
    return torch


def gpu_fields_null(result):
    for k in ("peak_reserved", "peak_allocated", "alloc_retries", "ooms", "budget_bytes"):
        result[k] = None


def _base(spec):
    out = {k: spec.get(k) for k in RESULT_FIELDS}
    out.update(status=None, error=None, timeline=None)
    return out


class Pressure:
    """What surrounds the forward of a step for a configuration, and the counters it collects."""

    def __init__(self, torch, spec):
        self.torch = torch
        self.spec = spec
        self.mode = SPILLWAY_MODES.get(spec["config"])
        self.totals = {k: 0 for k in COUNTERS}
        self.manager = None
        self.last_stats = {}  # the last closed manager's, for the timeline

    @contextlib.contextmanager
    def forward(self):
        torch, spec = self.torch, self.spec
        if self.mode is not None:
            import spillway
            policy = "dtr" if spec.get("policy") in (None, "dtr-frag") else spec["policy"]
            with spillway.activations(max_resident=spec.get("max_resident_bytes"), mode=self.mode,
                                      policy=policy) as manager:
                self.manager = manager
                yield
        elif spec["config"] == "save-on-cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=spec["device"] == "cuda"):
                yield
        else:
            yield

    def end_step(self, counting):
        if self.manager is None:
            return
        stats = self.last_stats = self.manager.stats()
        self.manager.close()
        self.manager = None
        if counting:
            for k in COUNTERS:
                self.totals[k] += stats.get(k, 0)


def autocast(torch, spec):
    if spec.get("precision") == "amp":
        return torch.autocast(device_type=spec["device"], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(torch, model, batches, optimizer, loss_fn, pressure, spec, counting, hooks=None):
    """One optimizer step over the micro-batches; returns the summed loss as a float."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for micro in batches:
        with pressure.forward(), autocast(torch, spec):
            loss = loss_fn(model, micro) / len(batches)
        if hooks:
            hooks.sample("fwd_end", None)
        loss.backward()
        pressure.end_step(counting)
        total += loss.detach().float().item()
    if hooks:
        hooks.sample("bwd_end", None)
    optimizer.step()
    return total


def synchronize(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def saved_activation_bytes(torch, model, batch, loss_fn, spec):
    """Bytes of the distinct non-parameter storages autograd saves for one forward (>= 64 KiB
    each, spillway's default min_bytes): the CPU smoke test's stand-in for a memory peak."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes() >= 1 << 16:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(torch, spec):
        loss = loss_fn(model, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


class Timeline:
    """Memory samples at block boundaries of one step (forward pre/post hooks, gradient hooks on the
    block outputs for the backward), with spillway's eviction counters at each sample."""

    FIELDS = ("t_ms", "event", "block", "allocated", "reserved", "resident_activation_bytes",
              "spills", "drops", "restores", "recomputes")

    def __init__(self, torch, device, pressure):
        self.torch, self.device, self.pressure = torch, device, pressure
        self.samples = []
        self.t0 = time.perf_counter()
        self.handles = []

    def sample(self, event, block):
        cuda = self.device == "cuda"
        m = self.pressure.manager
        st = m.stats() if m is not None else self.pressure.last_stats
        base = self.pressure.totals
        self.samples.append([
            round((time.perf_counter() - self.t0) * 1e3, 3), event, block,
            self.torch.cuda.memory_allocated() if cuda else None,
            self.torch.cuda.memory_reserved() if cuda else None,
            st.get("resident_bytes") if self.pressure.mode else None,
            *[base[k] + st.get(k, 0) for k in ("spills", "drops", "restores", "recomputes")]])

    def attach(self, blocks):
        for i, (parent, attr) in enumerate(blocks):
            module = getattr(parent, attr)
            self.handles.append(module.register_forward_pre_hook(lambda *_, i=i: self.sample("fwd", i)))
            self.handles.append(module.register_forward_hook(lambda m, a, out, i=i: self._on_output(out, i)))

    def _on_output(self, out, i):
        self.sample("fwd_done", i)
        t = out if isinstance(out, self.torch.Tensor) else next(
            (x for x in (out if isinstance(out, (tuple, list)) else ()) if isinstance(x, self.torch.Tensor)), None)
        if t is not None and t.requires_grad:
            t.register_hook(lambda g, i=i: self.sample("bwd", i))

    def detach(self):
        for h in self.handles:
            h.remove()


SIM_CAPACITY = "16GiB"


def on_simulated_device(spec):
    """A CPU run whose tensors spillway's simulated device serves (spec "sim"): the spillway
    configurations, under their budget, and the unconstrained reference, without one."""
    return (spec["device"] == "cpu" and bool(spec.get("sim")) and
            (spec["config"].startswith("spillway") or spec.get("ratio") is None))


def install_for(spec):
    """Installs spillway (CUDA, spillway configurations) or sets the memory fraction (CUDA,
    PyTorch configurations with a budget). Must run before anything touches CUDA."""
    torch = import_torch()
    config, device, budget = spec["config"], spec["device"], spec.get("budget_bytes")
    if on_simulated_device(spec):
        # CPU tensors on spillway's simulated device, under the budget (None: the reference run,
        # which measures the peak the budgets are ratios of).
        import spillway
        spillway.install(budget=budget, policy=spec.get("policy"), backend="sim",
                         sim_capacity=SIM_CAPACITY, cpu_tensors=True)
    elif config.startswith("spillway"):
        import spillway
        if device == "cuda":
            settings = dict(spec.get("spillway_settings") or {})
            spillway.install(budget=budget, policy=spec.get("policy"), **settings)
    elif device == "cuda" and budget is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        if budget > total:
            raise RuntimeError(f"budget {budget} bytes exceeds the device's {total} bytes")
        torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    return torch


def is_oom(torch, e):
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_worker(spec):
    """Runs one configuration; returns its result dict (RESULT_FIELDS)."""
    t_start = time.perf_counter()
    result = {k: spec.get(k) for k in RESULT_FIELDS}
    result.update(kind="train", status="ok", error=None, losses=[], step_ms=[], timeline=None)
    if spec.get("search"):
        result["search"] = spec["search"]
    device = spec["device"]
    try:
        torch = install_for(spec)
    except Exception as e:  # spillway missing, bad settings
        result.update(status="error", error=f"{type(e).__name__}: {e}")
        return result
    if spec.get("deterministic"):
        torch.use_deterministic_algorithms(True)
    if device == "cpu":
        torch.set_num_threads(1)  # a CPU run is a harness check; one thread is steadier on a shared machine
    result["device"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    try:
        _train(torch, spec, result)
    except Exception as e:
        result["status"] = "oom" if is_oom(torch, e) else "error"
        result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:600]
    _finish(torch, spec, result)
    result["wall_s"] = round(time.perf_counter() - t_start, 3)
    return result


def _train(torch, spec, result):
    device, config = spec["device"], spec["config"]
    torch.manual_seed(spec.get("seed", 0))
    model, blocks, make_batch, loss_fn = build_model(torch, spec["model"], device)
    model.train()
    optimizer = make_optimizer(torch, spec["model"], model)
    gen = torch.Generator().manual_seed(1 + spec.get("seed", 0))
    batches = [make_batch(spec["batch"], gen) for _ in range(spec.get("accum") or 1)]
    if spec.get("measure_saved"):
        result["saved_activation_bytes"] = saved_activation_bytes(torch, model, batches[0], loss_fn, spec)
    wrap_blocks(torch, blocks, config)
    if config == "compile-budget":
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = spec["ratio"]
        model = torch.compile(model)
    pressure = Pressure(torch, spec)
    for i in range(spec["warmup"] + spec["steps"]):
        counting = i >= spec["warmup"]
        torch.manual_seed(1000 + i)
        synchronize(torch, device)
        t0 = time.perf_counter()
        loss = train_step(torch, model, batches, optimizer, loss_fn, pressure, spec, counting)
        synchronize(torch, device)
        ms = (time.perf_counter() - t0) * 1e3
        result["losses"].append(loss)
        if i == 0:
            result["first_step_ms"] = round(ms, 3)
        if counting:
            result["step_ms"].append(round(ms, 3))
    if spec.get("timeline") and config != "compile-budget":
        tl = Timeline(torch, device, pressure)
        tl.attach(blocks)
        tl.sample("step_start", None)
        torch.manual_seed(999)
        train_step(torch, model, batches, optimizer, loss_fn, pressure, spec, False, hooks=tl)
        synchronize(torch, device)
        tl.sample("step_end", None)
        tl.detach()
        result["timeline"] = {"fields": list(Timeline.FIELDS), "samples": tl.samples}
    result.update({k: pressure.totals[k] for k in COUNTERS} if pressure.mode else {k: None for k in COUNTERS})


def _finish(torch, spec, result):
    if result["step_ms"]:
        med = statistics.median(result["step_ms"])
        samples = spec["batch"] * (spec.get("accum") or 1)
        result["step_ms_median"] = round(med, 3)
        result["samples_per_s"] = round(samples / (med / 1e3), 3)
        result["ms_per_sample"] = round(med / samples, 6)
    if spec["device"] != "cuda" and not on_simulated_device(spec):
        gpu_fields_null(result)
        return
    try:
        if spec["device"] == "cuda":
            ms = torch.cuda.memory_stats()
        else:
            import spillway
            ms = spillway.stats()
        result["peak_reserved"] = ms.get("reserved_bytes.all.peak")
        result["peak_allocated"] = ms.get("allocated_bytes.all.peak")
        result["alloc_retries"] = ms.get("num_alloc_retries")
        result["ooms"] = ms.get("num_ooms")
        if spec["config"].startswith("spillway"):
            import spillway
            result["pressure_calls"] = spillway.stats().get("num_pressure_handler_calls")
    except Exception as e:  # stats must never hide the run's own result
        result["error"] = (result["error"] or "") + f" [stats: {type(e).__name__}: {e}]"


def worker_main(spec_text):
    spec = json.loads(spec_text)
    kind = spec.get("kind", "train")
    try:
        if kind == "probe":
            out = probe_device()
        elif kind == "copy-limit":
            out = copy_limit(spec)
        elif kind == "spill-profile":
            out = spill_profile(spec)
        else:
            out = run_worker(spec)
    except Exception as e:  # a result, not a traceback the parent has to dig out of stderr
        out = dict(_base(spec), kind=kind, status="error", error=f"{type(e).__name__}: {e}"[:600])
    sys.stdout.write(RESULT_MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


def probe_device():
    torch = import_torch()
    out = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "cuda_runtime": torch.version.cuda, "python": platform.python_version(),
           "cpu_threads": torch.get_num_threads(), "host": platform.node()}
    if out["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, total_memory=props.total_memory,
                   capability=f"{props.major}.{props.minor}")
    else:
        out.update(device="cpu", total_memory=None)
    for pkg in ("torchvision", "transformers"):
        try:
            out[pkg] = __import__(pkg).__version__
        except Exception:
            out[pkg] = None
    try:
        import spillway  # noqa: F401
        out["spillway"] = os.path.dirname(spillway.__file__)
    except Exception as e:
        out["spillway"] = None
        out["spillway_error"] = f"{type(e).__name__}: {e}"
    return out


# ================================================================================================
# --spill-bandwidth workers (GPU)
# ================================================================================================

def copy_limit(spec):
    """Pinned host <-> device copy bandwidth: each direction alone and both at once, GB/s."""
    torch = import_torch()
    out = {"kind": "copy-limit", "config": "copy-limit", "status": "ok", "device": torch.cuda.get_device_name(0),
           "sizes": []}
    for size in spec["sizes"]:
        host_a = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host_b = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dev_a = torch.empty(size, dtype=torch.uint8, device="cuda")
        dev_b = torch.empty(size, dtype=torch.uint8, device="cuda")
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        row = {"bytes": size}
        for name, pairs in (("h2d", [(dev_a, host_a, s1)]), ("d2h", [(host_a, dev_a, s1)]),
                            ("both", [(dev_a, host_a, s1), (host_b, dev_b, s2)])):
            rates = []
            for _ in range(spec["iters"] + 1):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for dst, src, stream in pairs:
                    stream.wait_event(start)
                    with torch.cuda.stream(stream):
                        dst.copy_(src, non_blocking=True)
                    torch.cuda.current_stream().wait_stream(stream)
                end.record()
                end.synchronize()
                rates.append(size * len(pairs) / (start.elapsed_time(end) / 1e3) / 1e9)
            rates = rates[1:]  # the first copy of each kind warms up
            row[name + "_gbps_median"] = round(statistics.median(rates), 3)
            row[name + "_gbps_max"] = round(max(rates), 3)
        out["sizes"].append(row)
        del host_a, host_b, dev_a, dev_b
        torch.cuda.empty_cache()
    return out


def analyze_copy_trace(events, min_bytes=1 << 16):
    """From Chrome-trace events of a profiled step (torch.profiler / Kineto): the device<->host copies
    of at least min_bytes, per direction: count, bytes, busy microseconds, bandwidth (bytes / busy
    time), and the fraction of their time overlapped by kernels on any stream."""
    # Kineto names the categories "kernel" and "gpu_memcpy" (older versions: "Kernel", "Memcpy").
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if str(e.get("cat", "")).lower() == "kernel" and e.get("ph") == "X")
    merged = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out = {}
    for e in events:
        if "memcpy" not in str(e.get("cat", "")).lower() or e.get("ph") != "X":
            continue
        name = e.get("name", "")
        direction = "d2h" if "DtoH" in name else "h2d" if "HtoD" in name else None
        nbytes = (e.get("args") or {}).get("bytes", 0)
        if direction is None or nbytes < min_bytes:
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        overlap = sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged if x < b and y > a)
        d = out.setdefault(direction, {"copies": 0, "bytes": 0, "busy_us": 0.0, "overlapped_us": 0.0})
        d["copies"] += 1
        d["bytes"] += nbytes
        d["busy_us"] += e["dur"]
        d["overlapped_us"] += overlap
    for d in out.values():
        d["gbps"] = round(d["bytes"] / (d["busy_us"] * 1e-6) / 1e9, 3) if d["busy_us"] else None
        d["overlap_fraction"] = round(d["overlapped_us"] / d["busy_us"], 4) if d["busy_us"] else None
    return out


def spill_profile(spec):
    """Trains spec's model in spill mode under its budget; profiles one step's copies."""
    result = run_worker(dict(spec, kind="train"))
    if result["status"] != "ok":
        return dict(result, kind="spill-profile")
    import gc
    torch = import_torch()
    from torch.profiler import ProfilerActivity, profile
    import spillway
    gc.collect()
    torch.cuda.empty_cache()  # the measured run's model is gone; start the profiled one afresh
    model, blocks, make_batch, loss_fn = build_model(torch, spec["model"], "cuda")
    optimizer = make_optimizer(torch, spec["model"], model)
    batches = [make_batch(spec["batch"], torch.Generator().manual_seed(1))]
    pressure = Pressure(torch, spec)
    train_step(torch, model, batches, optimizer, loss_fn, pressure, spec, False)  # warm
    before = dict(pressure.totals)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        train_step(torch, model, batches, optimizer, loss_fn, pressure, spec, True)
        end.record()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    step_s = start.elapsed_time(end) / 1e3
    spilled = pressure.totals["bytes_spilled"] - before["bytes_spilled"]
    restored = pressure.totals["bytes_restored"] - before["bytes_restored"]
    return {"kind": "spill-profile", "status": "ok", "model": spec["model"], "config": spec["config"],
            "ratio": spec["ratio"], "batch": spec["batch"], "precision": spec["precision"],
            "accum": spec["accum"], "train": result, "profiled_step_ms": round(step_s * 1e3, 3),
            "bytes_spilled": spilled, "bytes_restored": restored,
            "spill_rate_over_step_gbps": round(spilled / step_s / 1e9, 3),
            "copies": analyze_copy_trace(events), "spillway_stats": {k: v for k, v in spillway.stats().items()
                                                                     if k.startswith("activations.")}}

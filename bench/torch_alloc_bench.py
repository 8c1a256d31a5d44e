#!/usr/bin/env python3
"""torch_alloc_bench: alloc+free pairs through PyTorch, PyTorch's caching allocator against spillway's.

First run on a GPU on 2026-11-26 (NVIDIA H200; bench/results/gpu-2026-11-26-h200/). Without a
CUDA device it prints "SKIPPED: no CUDA device" and exits 0. It complements build/bench/spillway-alloc-bench, which times spillway's C++
allocator against cudaMalloc, cudaMallocAsync and CUB from C++; this one times what a PyTorch
program pays, through torch's own calls, with each allocator installed the way a user installs it.

    PYTHONPATH=build/python python3 bench/torch_alloc_bench.py [--json FILE] [--smoke]
        [--subjects native-torch,native-raw,spillway-torch,spillway-raw] [--batches 200]
        [--pairs 1000] [--threads 2]
    python3 bench/torch_alloc_bench.py --cpu-harness     # checks the harness on CPU tensors only

Contract
- Subjects, each measured in its own fresh process (an allocator is chosen once per process):
    native-torch        PyTorch's caching allocator; torch.empty(4096, uint8, device="cuda"), del
    native-raw          PyTorch's caching allocator; torch.cuda.caching_allocator_alloc / _delete
    spillway-torch      spillway.install() (no budget), then torch.empty / del
    spillway-raw        spillway.install(), then caching_allocator_alloc / _delete (c10's raw API,
                        which spillway serves once installed)
    native-expandable   native-torch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    native-async        native-torch with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  (the last two are not in the default set).
- Cases, as in spillway-alloc-bench (bench/alloc_bench_cases.hpp), 4 KiB requests:
    floor          torch.empty(0) / del: torch's own cost with no allocation (size 0 skips the
                   allocator in both); subtract it from the others to see the allocator's share
    cache_hit      a 4 KiB hole between two live 4 KiB blocks: the pair takes it and gives it back
    split          4 KiB from a cached, otherwise empty 2 MiB small segment: split, then coalesce
    cross_stream   allocated on stream s1, record_stream(s2), freed (torch subjects only: the raw
                   API has no record_stream)
    multi_thread   --threads Python threads, each on its own stream, doing cache_hit pairs
- Timing: time.perf_counter_ns around batches of --pairs pairs after a warm-up; the figures are
  the median, p10 and p90 of the per-pair time over --batches batches, and the mean over the timed
  phase (x threads for multi_thread). They include the Python interpreter's and torch's dispatch
  overhead (see floor); under the GIL, multi_thread measures contention, not parallel speed.
- Output: a table on stdout, and with --json FILE a document: tool, device, torch version, the
  settings, and one record per (subject, case): median_ns, p10_ns, p90_ns, mean_ns, pairs,
  threads, or status "n/a" / "error" with the reason.
- Bad arguments exit 2 with a message naming the value.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

RESULT_MARK = "TORCH_ALLOC_BENCH_RESULT "
BYTES = 4096
SUBJECTS = {
    "native-torch": ("torch", False, None),
    "native-raw": ("raw", False, None),
    "spillway-torch": ("torch", True, None),
    "spillway-raw": ("raw", True, None),
    "native-expandable": ("torch", False, "expandable_segments:True"),
    "native-async": ("torch", False, "backend:cudaMallocAsync"),
}
DEFAULT_SUBJECTS = ("native-torch", "native-raw", "spillway-torch", "spillway-raw")
CASES = ("floor", "cache_hit", "split", "cross_stream", "multi_thread")


# --- the API of a subject: torch tensors or the raw pointer calls ---------------------------------

class TensorAPI:
    def __init__(self, torch, device):
        self.torch, self.device = torch, device

    def alloc(self, nbytes, stream=None):
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def free(self, handle):
        del handle

    def record(self, handle, stream):
        handle.record_stream(stream)


class RawAPI:
    def __init__(self, torch, device):
        self.torch = torch
        self.index = torch.device(device).index or 0

    def alloc(self, nbytes, stream=None):
        stream = stream if stream is not None else self.torch.cuda.current_stream()
        return self.torch.cuda.caching_allocator_alloc(nbytes, self.index, stream)

    def free(self, ptr):
        self.torch.cuda.caching_allocator_delete(ptr)

    record = None  # no record_stream for raw pointers


# --- timing ---------------------------------------------------------------------------------------

def time_batches(pair, batches, pairs):
    """(per-pair nanoseconds of each batch of `pairs` calls of pair(), nanoseconds of the timed
    phase), after one untimed warm-up batch."""
    for _ in range(pairs):
        pair()
    out = []
    start = time.perf_counter_ns()
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(pairs):
            pair()
        out.append((time.perf_counter_ns() - t0) / pairs)
    return out, time.perf_counter_ns() - start


def summarize(per_pair, pairs, threads, timed_ns):
    """median/p10/p90 over batches (of every thread); mean: the timed phases' summed time / pairs."""
    per_pair = sorted(per_pair)
    q = statistics.quantiles(per_pair, n=10) if len(per_pair) >= 2 else [per_pair[0]] * 9
    total = len(per_pair) * pairs
    return {"median_ns": round(statistics.median(per_pair), 1), "p10_ns": round(q[0], 1),
            "p90_ns": round(q[-1], 1), "mean_ns": round(timed_ns / total, 1), "pairs": total,
            "threads": threads}


# --- cases ----------------------------------------------------------------------------------------

def case_floor(api, s):
    def pair():
        api.free(api.alloc(0))
    return run_single(pair, s)


def case_cache_hit(api, s):
    keep = [api.alloc(BYTES), api.alloc(BYTES), api.alloc(BYTES)]
    api.free(keep.pop(1))  # a hole between two live blocks

    def pair():
        api.free(api.alloc(BYTES))
    out = run_single(pair, s)
    for h in keep:
        api.free(h)
    return out


def case_split(api, s):
    api.free(api.alloc(BYTES))  # leaves a cached, empty small segment

    def pair():
        api.free(api.alloc(BYTES))
    return run_single(pair, s)


def case_cross_stream(api, s, torch):
    if api.record is None:
        return {"status": "n/a", "why": "the raw API has no record_stream"}
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def pair():
        h = api.alloc(BYTES)
        api.record(h, s2)
        api.free(h)
    with torch.cuda.stream(s1):
        return run_single(pair, s)


def case_multi_thread(api, s, torch, cuda):
    threads = s["threads"]
    results = [None] * threads
    errors = []
    barrier = threading.Barrier(threads + 1)

    def work(i):
        try:
            stream = torch.cuda.Stream() if cuda else None
            ctx = torch.cuda.stream(stream) if cuda else _nullcontext()
            with ctx:
                keep = [api.alloc(BYTES), api.alloc(BYTES), api.alloc(BYTES)]
                api.free(keep.pop(1))

                def pair():
                    api.free(api.alloc(BYTES))
                barrier.wait()
                results[i] = time_batches(pair, s["batches"], s["pairs"])
                for h in keep:
                    api.free(h)
        except Exception as e:  # reported, never a hang: the barrier is aborted
            errors.append(f"{type(e).__name__}: {e}")
            barrier.abort()

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    for t in pool:
        t.join()
    if errors:
        return {"status": "error", "why": errors[0]}
    per_pair = [x for r in results for x in r[0]]
    return dict(summarize(per_pair, s["pairs"], threads, sum(r[1] for r in results)), status="ok")


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_single(pair, s):
    per_pair, timed = time_batches(pair, s["batches"], s["pairs"])
    return dict(summarize(per_pair, s["pairs"], 1, timed), status="ok")


# --- one subject, in this process -----------------------------------------------------------------

def run_subject(s):
    """Installs the subject's allocator, runs every case; returns the records."""
    api_kind, with_spillway, _ = SUBJECTS[s["subject"]]
    if with_spillway:
        import spillway  # before torch touches CUDA
        spillway.install()
    import torch
    cuda = s["device"] == "cuda"
    api = (RawAPI if api_kind == "raw" else TensorAPI)(torch, s["device"])
    if cuda:
        torch.cuda.init()
        api.free(api.alloc(BYTES))  # the first allocation sets the allocator up; not timed
    records = []
    for case in s["cases"]:
        try:
            if case == "floor":
                r = case_floor(api, s)
            elif case == "cache_hit":
                r = case_cache_hit(api, s)
            elif case == "split":
                r = case_split(api, s)
            elif case == "cross_stream":
                r = case_cross_stream(api, s, torch) if cuda else {"status": "n/a", "why": "CPU has no streams"}
            else:
                r = case_multi_thread(api, s, torch, cuda)
        except Exception as e:
            r = {"status": "error", "why": f"{type(e).__name__}: {e}"}
        records.append(dict(r, subject=s["subject"], case=case))
    if cuda and with_spillway:
        import spillway
        records.append({"subject": s["subject"], "case": "stats", "status": "info",
                        "spillway_stats": {k: v for k, v in spillway.stats().items()
                                           if k.startswith(("num_", "reserved_bytes.all.peak"))}})
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
            "records": records}


def run_in_subprocess(s, timeout):
    env = dict(os.environ)
    conf = SUBJECTS[s["subject"]][2]
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(s)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"records": [{"subject": s["subject"], "case": c, "status": "error",
                             "why": f"timeout after {timeout} s"} for c in s["cases"]]}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    why = f"exit status {p.returncode}: {p.stderr.strip()[-600:]}"
    return {"records": [{"subject": s["subject"], "case": c, "status": "error", "why": why} for c in s["cases"]]}


# --- parent ---------------------------------------------------------------------------------------

def cuda_available():
    """Asked in a subprocess, so this process never creates a CUDA context."""
    code = "import torch, json; print(json.dumps(torch.cuda.is_available()))"
    try:
        p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except Exception:
        return False


def print_table(records):
    print(f"{'subject':18} {'case':13} {'median ns':>10} {'p10 ns':>9} {'p90 ns':>9} {'mean ns':>9} {'pairs':>8} thr")
    for r in records:
        if r.get("status") == "ok":
            print(f"{r['subject']:18} {r['case']:13} {r['median_ns']:10.1f} {r['p10_ns']:9.1f} {r['p90_ns']:9.1f} "
                  f"{r['mean_ns']:9.1f} {r['pairs']:8d} {r['threads']}")
        elif r.get("status") != "info":
            print(f"{r['subject']:18} {r['case']:13} {r.get('status')}: {r.get('why')}")


def git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def positive(name, value):
    if value < 1:
        raise ValueError(f"{name} {value} is invalid: expected an int >= 1")
    return value


def parse_subjects(text):
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if item not in SUBJECTS:
            raise ValueError(f"subject {item!r} is unknown: expected one of {', '.join(SUBJECTS)}")
    if not items:
        raise ValueError(f"--subjects {text!r} is empty: expected one of {', '.join(SUBJECTS)}")
    return items


def parse_cases(text):
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if item not in CASES:
            raise ValueError(f"case {item!r} is unknown: expected one of {', '.join(CASES)}")
    if not items:
        raise ValueError(f"--cases {text!r} is empty: expected one of {', '.join(CASES)}")
    return items


def main(argv=None):
    p = argparse.ArgumentParser(description="alloc+free pairs through PyTorch: its caching allocator "
                                            "against spillway's.")
    p.add_argument("--subjects", default=",".join(DEFAULT_SUBJECTS),
                   help=f"comma-separated, from {', '.join(SUBJECTS)} (default: %(default)s)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated (default: all)")
    p.add_argument("--batches", type=int, default=200, help="timed batches per case (default 200)")
    p.add_argument("--pairs", type=int, default=1000, help="pairs per batch (default 1000)")
    p.add_argument("--threads", type=int, default=2, help="threads of multi_thread (default 2)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per subject (default 600)")
    p.add_argument("--json", metavar="FILE", help="write the results document here")
    p.add_argument("--smoke", action="store_true", help="5 batches of 100 pairs (for ctest)")
    p.add_argument("--cpu-harness", action="store_true",
                   help="check the harness with CPU tensors (native-torch only; the figures mean nothing here)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        out = run_subject(json.loads(a.worker))
        print(RESULT_MARK + json.dumps(out), flush=True)
        return 0
    try:
        subjects = parse_subjects(a.subjects)
        cases = parse_cases(a.cases)
        positive("--batches", a.batches), positive("--pairs", a.pairs), positive("--threads", a.threads)
        positive("--timeout", a.timeout)
    except ValueError as e:
        p.error(str(e))
    if a.smoke:
        a.batches, a.pairs = 5, 100
    device = "cuda"
    if a.cpu_harness:
        device, subjects = "cpu", ["native-torch"]
    elif not cuda_available():
        print("SKIPPED: no CUDA device (torch_alloc_bench times CUDA allocators)")
        if a.json:
            write_json(a.json, {"tool": "torch_alloc_bench", "skipped": "no CUDA device", "commit": git_commit()})
        return 0
    records, devices = [], set()
    for subject in subjects:
        spec = {"subject": subject, "device": device, "cases": cases, "batches": a.batches, "pairs": a.pairs,
                "threads": a.threads}
        out = run_in_subprocess(spec, a.timeout)
        records += out["records"]
        if out.get("device"):
            devices.add(out["device"])
        print(f"torch_alloc_bench: {subject} done", file=sys.stderr)
    print_table(records)
    if a.json:
        write_json(a.json, {"tool": "torch_alloc_bench", "device": sorted(devices), "host": platform.node(), "commit": git_commit(),
                            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "bytes": BYTES,
                            "batches": a.batches, "pairs": a.pairs, "threads": a.threads,
                            "cpu_harness": a.cpu_harness, "results": records})
    failed = [r for r in records if r.get("status") == "error"]
    return 1 if failed else 0


def write_json(path, doc):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())

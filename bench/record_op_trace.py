#!/usr/bin/env python3
"""record_op_trace: records operator traces (docs/op_trace_format.md) of one training step
(forward + backward) of real models under PyTorch's dispatch mode, for spillway-evict-sim.

    python3 bench/record_op_trace.py [--out bench/op_traces] [--models mlp,resnet50,gpt2,bert,unet]
                                     [--device auto|cpu|cuda] [--batch-scale S] [--warmup 1] [--seed 1]

Needs torch (>= 1.13: TorchDispatchMode, StorageWeakRef; run with 1.13 and 2.11), torchvision for
resnet50, densenet121 and inception_v3, and transformers for gpt2 and bert (run with torchvision
0.26, transformers 5.23); the U-Net comes from record_torch_traces.py and the MLP is defined here.
Every model has random weights: nothing is downloaded. Each model runs in its own subprocess.

How it records. A TorchDispatchMode (torch.utils._python_dispatch) sees every aten op after
autograd, in the forward and in the backward (the mode is part of the thread-local state the
autograd engine carries to its threads). For each op on the recording device it:
  - names buffers by *storage*: the key is untyped_storage().data_ptr(), the size nbytes(), and a
    StorageWeakRef (torch.multiprocessing.reductions) tells whether the storage that had that
    address is still alive, so an address reused by a new allocation gets a new buffer id;
  - reads: every tensor argument's storage. A storage first seen as an input was made outside the
    step (weights, the batch, optimizer state): it becomes a `param` buffer;
  - writes: each argument the schema marks as written (alias_info.is_write: in-place ops, out=)
    gets a new version with a new id (single assignment; the old version is freed after the op if
    it was a param, so memory is not counted twice); each return without alias_info is a fresh
    storage. Returns that alias an argument (views) write nothing;
  - times the op: time.perf_counter_ns() around the call on CPU; a pair of torch.cuda.Event around
    it on a GPU, read after one synchronisation at the end of the step.
`phase backward` is written before loss.backward(); after it, the storages of the parameters'
.grad are marked `param` (they must survive the step). Ops that write nothing on the device (views,
detach, t: no kernel runs on a GPU, nothing to recompute) are dropped; their reads are kept by the
ops that read the views. Not recorded: the optimizer step.

Models (batch sizes are for an 80 GB GPU; --batch-scale multiplies them, rounded, at least 1; on
CPU its default is 1/16; GPT-2 and BERT train with their configs' dropout, 0.1):
  mlp       32 x (Linear(1024, 1024) + ReLU), 8192 x 1024 inputs, MSE: the chain
  resnet50  torchvision, 64 x 3 x 224 x 224, cross entropy
  gpt2      transformers GPT2LMHeadModel(GPT2Config()), 8 x 1024 tokens
  bert      transformers BertForMaskedLM(BertConfig()), 16 x 128..512 tokens
  unet      record_torch_traces.py's U-Net, 8 x 3 x 256 x 256
  resnet1202  (only with --models) the CIFAR ResNet of He et al. with 6 x 200 + 2 layers (3 stages of
            200 basic blocks, 16/32/64 channels), 64 x 3 x 32 x 32, cross entropy: the deepest model
            of the DTR prototype's evaluation (batch 64 there too)
  densenet121  (only with --models) torchvision, 84 x 3 x 224 x 224, cross entropy: the DTR
            prototype's DenseNet-121 at its batch
  inception_v3  (only with --models) torchvision (no auxiliary classifier), 64 x 3 x 299 x 299,
            cross entropy: the nearest torchvision has to the DTR prototype's Inception-v4 (batch 64)

Output: <out>/torch-<model>-<device>.optrace.gz and a .json summary next to it. The trace's header
adds timing, torch (version), batch_scale, batch (the input shapes, e.g. x:16x3x224x224,y:16), dtype,
device and, on CPU, threads (torch.get_num_threads()). CPU durations are host times of CPU kernels,
nothing like a GPU's; on CPU, transformers' attention (sdpa) takes the math path, so GPT-2 and BERT
materialise their attention matrices (bmm, softmax, dropout), where a GPU would use a fused kernel.
Exit status: 0 when every model was recorded; 1 when one failed; 2 on bad arguments or no torch.

OpTraceWriter (below) is the bookkeeping without torch: tests/test_record_op_trace.py tests it.
"""

import argparse
import gzip
import io
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("mlp", "resnet50", "gpt2", "bert", "unet")  # recorded by default
EXTRA_MODELS = ("resnet1202", "densenet121", "inception_v3")  # on request (--models): the DTR prototype's models


# --- the trace, without torch ---------------------------------------------------------------------

class OpTraceWriter:
    """Buffers and ops of one step, kept in single-assignment form, written as an op trace.

    Storages are named by a hashable key (an address) with their size and an `alive()` callable:
    while the storage that had the key is alive, the key names the same buffer; once it is not, the
    next storage with that key is a new buffer."""

    def __init__(self, model, source, extra=None):
        self.model, self.source, self.extra = model, source, dict(extra or {})
        self.sizes = []        # per buffer id
        self.param = []        # per buffer id
        self.produced = []     # per buffer id: written by an op
        self.current = {}      # key -> (buffer id, alive)
        self.lines = []        # ("o", name, ns, reads, writes) | ("f", id) | ("phase", name)

    def _new(self, nbytes, param):
        self.sizes.append(int(nbytes))
        self.param.append(bool(param))
        self.produced.append(False)
        return len(self.sizes) - 1

    def _live(self, key):
        entry = self.current.get(key)
        if entry is None or not entry[1]():
            return None
        return entry[0]

    def read(self, key, nbytes, alive):
        """The buffer an input storage holds now; a storage not written in the step is a param."""
        b = self._live(key)
        if b is None:
            b = self._new(nbytes, True)
            self.current[key] = (b, alive)
        return b

    def write(self, key, nbytes, alive, in_place):
        """A new buffer for a storage an op writes. in_place: the storage existed (a new version).
        Returns (new id, old id or None). A fresh storage at the address of a live one is the same
        storage (an alias the schema did not declare): returns (None, None)."""
        old = self._live(key)
        if old is not None and not in_place:
            return None, None
        b = self._new(nbytes, old is not None and self.param[old])
        self.produced[b] = True
        self.current[key] = (b, alive)
        return b, old

    def op(self, name, duration_ns, reads, writes, free_after=()):
        reads = list(dict.fromkeys(r for r in reads if r is not None))
        writes = list(dict.fromkeys(w for w in writes if w is not None))
        reads = [r for r in reads if r not in writes]
        if not writes:
            return  # views, detach, t: nothing to recompute, no kernel on a GPU
        self.lines.append(("o", name.replace(" ", "_"), max(0, int(duration_ns)), reads, writes))
        for b in dict.fromkeys(free_after):
            self.lines.append(("f", b))

    def phase(self, name):
        self.lines.append(("phase", name))

    def keep(self, key):
        """The buffer a storage holds now must survive the step (a parameter's gradient)."""
        b = self._live(key)
        if b is not None:
            self.param[b] = True

    def set_durations(self, durations):
        """Replaces op durations in order (GPU timing is read after the step)."""
        it = iter(durations)
        self.lines = [(l[0], l[1], next(it), l[3], l[4]) if l[0] == "o" else l for l in self.lines]

    def text(self):
        head = f"# spillway-op-trace v1 model={self.model} source={self.source}"
        for k, v in self.extra.items():
            head += f" {k}={str(v).replace(' ', '_')}"
        out = io.StringIO()
        out.write(head + "\n")
        # A param that an op writes after it was read would break single assignment; the versions
        # above never do that, but check what we write anyway.
        seen_read = set()
        for line in self.lines:
            if line[0] == "o":
                seen_read.update(r for r in line[3] if not self.produced[r])
                for w in line[4]:
                    assert w not in seen_read, f"buffer {w} written after it was read as a param"
        for b, size in enumerate(self.sizes):
            out.write(f"b {b} {size}{' param' if self.param[b] else ''}\n")
        for line in self.lines:
            if line[0] == "o":
                _, name, ns, reads, writes = line
                out.write(f"o {name} {ns} in{''.join(f' {r}' for r in reads)} out{''.join(f' {w}' for w in writes)}\n")
            elif line[0] == "f":
                out.write(f"f {line[1]}\n")
            else:
                out.write(f"phase {line[1]}\n")
        return out.getvalue()

    def save(self, path):
        data = self.text().encode()
        if path.endswith(".gz"):
            with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
                f.write(data)  # no name, no time: the same trace always gives the same bytes
        else:
            with open(path, "wb") as f:
                f.write(data)

    def summary(self):
        ops = sum(1 for l in self.lines if l[0] == "o")
        return {"ops": ops, "buffers": len(self.sizes), "params": sum(self.param),
                "param_bytes": sum(s for s, p in zip(self.sizes, self.param) if p)}


# --- the dispatch mode (torch is imported inside) --------------------------------------------------

def storage_of(t):
    """(key, nbytes, storage) of a dense tensor's storage, or None (no storage, empty, meta)."""
    try:
        s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage().untyped()  # torch < 2.0
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    n = s.nbytes()
    if n == 0 or s.data_ptr() == 0:
        return None
    return s.data_ptr(), n, s


def make_recorder(torch, writer, device):
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    on_gpu = device.type == "cuda"

    def tensors(x):
        return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]

    def alive_fn(storage):
        ref = StorageWeakRef(storage)
        return lambda: not ref.expired()

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.events = []  # (start, end) per recorded op, on a GPU

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            schema = func._schema
            written = set()  # id() of argument tensors the op writes into
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(a.name)
                    written.update(id(t) for t in tensors(value))
            inputs = [t for t in tensors((args, kwargs)) if t.device == device]
            reads = []
            for t in inputs:
                st = storage_of(t)
                if st is not None:
                    reads.append(writer.read(st[0], st[1], alive_fn(st[2])))
            if on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = func(*args, **kwargs)
                end.record()
            else:
                t0 = time.perf_counter_ns()
                out = func(*args, **kwargs)
                ns = time.perf_counter_ns() - t0
            writes, frees = [], []
            for t in inputs:
                if id(t) in written:
                    st = storage_of(t)
                    if st is not None:
                        b, old = writer.write(st[0], st[1], alive_fn(st[2]), in_place=True)
                        writes.append(b)
                        if old is not None and writer.param[old]:
                            frees.append(old)
            results = out if len(schema.returns) > 1 else (out,)
            for ret, value in zip(schema.returns, results):
                if ret.alias_info is not None:
                    continue  # a view or the written argument itself
                for t in tensors(value):
                    if t.device != device:
                        continue
                    st = storage_of(t)
                    if st is not None:
                        writes.append(writer.write(st[0], st[1], alive_fn(st[2]), in_place=False)[0])
            before = len(writer.lines)
            writer.op(str(func), 0 if on_gpu else ns, reads, writes, frees)  # "aten.addmm.default"
            if on_gpu and len(writer.lines) > before and writer.lines[before][0] == "o":
                self.events.append((start, end))
            return out

        def durations_ns(self):
            torch.cuda.synchronize()
            return [int(s.elapsed_time(e) * 1e6) for s, e in self.events]

    return Recorder()


# --- models ----------------------------------------------------------------------------------------

def make_mlp(torch, layers=32, width=1024):
    nn = torch.nn
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    mse = nn.MSELoss()

    def batch(step, b=8192):
        return {"x": torch.randn(b, width), "y": torch.randn(b, width)}

    return model, lambda m, d: mse(m(d["x"]), d["y"]), batch, f"MLP chain {layers} x Linear({width}) + ReLU"


def make_resnet_cifar(torch, blocks_per_stage=200):
    """He et al.'s CIFAR ResNet (6n + 2 layers, option B shortcuts: 1x1 conv + BN when the shape changes)."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                          if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.short(x))

    layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(blocks_per_stage):
            layers.append(Block(cin, cout, stride if i == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
    model = nn.Sequential(*layers)
    ce = nn.CrossEntropyLoss()

    def batch(step, b=64):
        return {"x": torch.randn(b, 3, 32, 32), "y": torch.randint(0, 10, (b,))}

    depth = 6 * blocks_per_stage + 2
    return model, lambda m, d: ce(m(d["x"]), d["y"]), batch, f"CIFAR ResNet-{depth}, 3x32x32"


def describe_batch(batch):
    """One word for a batch's tensors: "x:16x3x224x224,y:16" (the trace header's `batch`)."""
    return ",".join(f"{k}:{'x'.join(str(int(d)) for d in v.shape)}" for k, v in batch.items())


def record_one(name, args):
    """Runs in the subprocess: records one model. Returns the summary dict."""
    import torch
    sys.path.insert(0, HERE)
    from record_torch_traces import make_model, scaled

    want = args.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device visible to torch")
    device = torch.device("cuda", 0) if want == "cuda" else torch.device("cpu")
    scale = args.batch_scale if args.batch_scale else (1.0 if want == "cuda" else 1.0 / 16)
    torch.manual_seed(args.seed)
    if want == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    if name == "mlp":
        model, loss_fn, make_batch, description = make_mlp(torch)
    elif name == "resnet1202":
        model, loss_fn, make_batch, description = make_resnet_cifar(torch)
    else:
        model, loss_fn, make_batch, description = make_model(name, torch)
    make_batch = scaled(make_batch, scale)
    model = model.to(device).train()

    def step(i):
        batch = {k: v.to(device) for k, v in make_batch(i).items()}
        return batch, loss_fn(model, batch)

    for i in range(args.warmup):  # lazy initialisation, cuDNN autotuning
        _, loss = step(i)
        loss.backward()
        model.zero_grad(set_to_none=True)
    if want == "cuda":
        torch.cuda.synchronize()

    batch = {k: v.to(device) for k, v in make_batch(args.warmup).items()}  # made outside: params
    source = f"torch:{name}:{want}"
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    extra = {"timing": want, "torch": torch.__version__.split("+")[0], "batch_scale": round(scale, 4),
             "batch": describe_batch(batch), "dtype": dtype,
             "device": torch.cuda.get_device_name(device).replace(" ", "_") if want == "cuda" else "cpu"}
    if want == "cpu":
        extra["threads"] = torch.get_num_threads()
    writer = OpTraceWriter(name, source, extra)
    recorder = make_recorder(torch, writer, device)
    start = time.time()
    with recorder:
        loss = loss_fn(model, batch)
        writer.phase("backward")
        loss.backward()
    if want == "cuda":
        writer.set_durations(recorder.durations_ns())
    seconds = time.time() - start
    for p in model.parameters():
        if p.grad is not None:
            st = storage_of(p.grad)
            if st is not None:
                writer.keep(st[0])

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"torch-{name}-{want}")
    writer.save(stem + ".optrace.gz")
    summary = {"model": name, "description": description, "device": extra["device"], "torch": torch.__version__,
               "batch_scale": scale, "batch": extra["batch"], "dtype": dtype, "threads": extra.get("threads"),
               "seconds": round(seconds, 3), "loss": float(loss.detach()),
               "trace": stem + ".optrace.gz", **writer.summary()}
    with open(stem + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    return summary


# --- driver ----------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "op_traces"), help="output directory (default bench/op_traces)")
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated: " + ", ".join(MODELS + EXTRA_MODELS) + " (default: " + ",".join(MODELS) + ")")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--batch-scale", type=float, default=0.0, help="multiply every batch size (default 1 on a GPU, 1/16 on CPU)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded steps first (default 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: record this model in this process
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS + EXTRA_MODELS]
    if unknown or not models:
        p.error(f"--models: unknown {unknown}; expected some of {', '.join(MODELS + EXTRA_MODELS)}")
    if args.batch_scale < 0 or args.warmup < 0:
        p.error("--batch-scale must be > 0 and --warmup >= 0")
    args.models = models
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        print(json.dumps(record_one(args.one, args)))
        return 0
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        print("record_op_trace: torch is not installed (pip install torch torchvision transformers)", file=sys.stderr)
        return 2
    failed = []
    for name in args.models:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--out", args.out, "--device", args.device,
               "--batch-scale", str(args.batch_scale), "--warmup", str(args.warmup), "--seed", str(args.seed)]
        print(f"record_op_trace: {name} ...", file=sys.stderr, flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        sys.stderr.write(run.stderr)
        if run.returncode != 0:
            failed.append(name)
            print(f"record_op_trace: {name} FAILED (exit {run.returncode})", file=sys.stderr)
            continue
        s = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"record_op_trace: {name}: {s['ops']} ops, {s['buffers']} buffers -> {s['trace']} ({s['seconds']} s)",
              file=sys.stderr)
    if failed:
        print(f"record_op_trace: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""record_torch_traces: records PyTorch caching-allocator traces of real training steps on a GPU and
converts them into spillway traces (docs/trace_format.md).

    python3 bench/record_torch_traces.py [--out bench/traces] [--models resnet50,vit_b_16,gpt2,bert,unet]
                                         [--steps 6] [--max-entries 2000000] [--precision bf16|fp32]
                                         [--keep-snapshots]

Needs a CUDA GPU, torch >= 2.1, torchvision (resnet50, vit_b_16) and transformers (gpt2, bert); the
U-Net is defined here. Every model has random weights: nothing is downloaded. Each model runs in its
own subprocess, so every recording starts from an empty allocator and an empty history.

For each model it: turns on torch.cuda.memory._record_memory_history(max_entries=...); builds the
model on cuda:0; trains --steps steps (AdamW, autocast, zero_grad(set_to_none=True)), with batches
copied from pinned host memory on a side stream and handed over with record_stream, as data
prefetchers do; dumps the snapshot (torch.cuda.memory._dump_snapshot); converts it with
snapshot_to_trace.py into <out>/torch-<model>.trace.gz (device_capacity = the GPU's memory,
torch_peak_reserved = PyTorch's peak over the window, and torch.cuda.max_memory_reserved /
max_memory_allocated as extra header fields); and writes <out>/torch-<model>.json with the run's
details. spillway-replay then replays them side by side with PyTorch's figures:

    build/bench/spillway-replay --trace bench/traces/torch-resnet50.trace.gz --device sim

Models (batch sizes fit an 80 GB GPU with room to spare; --batch-scale changes them all):
  resnet50   torchvision, 64 x 3 x 224 x 224, cross entropy, cudnn.benchmark on
  vit_b_16   torchvision, 64 x 3 x 224 x 224, cross entropy
  gpt2       transformers GPT2LMHeadModel(GPT2Config()) (124M), 8 x 1024 tokens, LM loss
  bert       transformers BertForMaskedLM(BertConfig()) (base), 16 x 128..512 tokens per batch
             (dynamic padding, a multiple of 8), 15% masked
  unet       a 4-level U-Net (64..512 channels, 31M parameters), 8 x 3 x 256 x 256, BCE on a mask

Exit status: 0 when every requested model was recorded and converted; 1 when one failed (the
others still run; no GPU makes every one fail); 2 on bad arguments or when torch is not installed.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("resnet50", "vit_b_16", "gpt2", "bert", "unet")


# --- models and batches (run inside the per-model subprocess, where torch is imported) -----------

def build_unet(nn):
    """A plain U-Net: 4 down levels (double 3x3 conv + BatchNorm + ReLU, max pool), a bottleneck, and 4
    up levels (2x2 transposed conv, concatenation with the skip, double conv), 1 output channel."""

    def double_conv(cin, cout):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    class UNet(nn.Module):
        def __init__(self, widths=(64, 128, 256, 512)):
            super().__init__()
            self.down = nn.ModuleList()
            cin = 3
            for w in widths:
                self.down.append(double_conv(cin, w))
                cin = w
            self.pool = nn.MaxPool2d(2)
            self.bottom = double_conv(widths[-1], widths[-1] * 2)
            self.up = nn.ModuleList()
            self.up_conv = nn.ModuleList()
            cin = widths[-1] * 2
            for w in reversed(widths):
                self.up.append(nn.ConvTranspose2d(cin, w, 2, stride=2))
                self.up_conv.append(double_conv(2 * w, w))
                cin = w
            self.head = nn.Conv2d(widths[0], 1, 1)

        def forward(self, x):
            import torch
            skips = []
            for block in self.down:
                x = block(x)
                skips.append(x)
                x = self.pool(x)
            x = self.bottom(x)
            for up, conv, skip in zip(self.up, self.up_conv, reversed(skips)):
                x = conv(torch.cat([up(x), skip], dim=1))
            return self.head(x)

    return UNet()


# torchvision classifiers: constructor arguments, image side, batch. densenet121 and inception_v3
# (no auxiliary head) are the DTR prototype's models at its batch sizes (it ran Inception-v4, which
# torchvision does not have); record_op_trace.py records them on request.
TORCHVISION = {
    "resnet50": ({}, 224, 64),
    "vit_b_16": ({}, 224, 64),
    "densenet121": ({}, 224, 84),
    "inception_v3": ({"aux_logits": False, "init_weights": True}, 299, 64),
}


def make_model(name, torch):
    """(model, loss_fn(model, batch) -> loss, make_batch(step) -> dict of CPU tensors, description)."""
    nn = torch.nn
    if name in TORCHVISION:
        import torchvision
        kwargs, side, b0 = TORCHVISION[name]
        model = getattr(torchvision.models, name)(weights=None, **kwargs)
        ce = nn.CrossEntropyLoss()

        def batch(step, b=b0):
            return {"x": torch.randn(b, 3, side, side), "y": torch.randint(0, 1000, (b,))}

        return model, lambda m, d: ce(m(d["x"]), d["y"]), batch, f"torchvision {name}, 3x{side}x{side}"
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config()
        model = GPT2LMHeadModel(config)

        def batch(step, b=8, s=1024):
            ids = torch.randint(0, config.vocab_size, (b, s))
            return {"input_ids": ids, "labels": ids}

        return model, lambda m, d: m(**d).loss, batch, "transformers GPT2LMHeadModel(GPT2Config()), 1024 tokens"
    if name == "bert":
        from transformers import BertConfig, BertForMaskedLM
        config = BertConfig()
        model = BertForMaskedLM(config)
        gen = torch.Generator().manual_seed(1234)

        def batch(step, b=16):
            s = 8 * int(torch.randint(16, 65, (1,), generator=gen))  # 128..512: dynamic padding
            ids = torch.randint(0, config.vocab_size, (b, s), generator=gen)
            masked = torch.rand(b, s, generator=gen) < 0.15
            labels = torch.where(masked, ids, torch.full_like(ids, -100))
            return {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long), "labels": labels}

        return model, lambda m, d: m(**d).loss, batch, "transformers BertForMaskedLM(BertConfig()), 128..512 tokens"
    if name == "unet":
        model = build_unet(nn)
        bce = nn.BCEWithLogitsLoss()

        def batch(step, b=8):
            return {"x": torch.randn(b, 3, 256, 256), "y": (torch.rand(b, 1, 256, 256) > 0.5).float()}

        return model, lambda m, d: bce(m(d["x"]), d["y"]), batch, "U-Net 64..512, 3x256x256"
    raise ValueError(f"unknown model {name}")


def scaled(make_batch, scale):
    """make_batch with every batch size multiplied by `scale` (at least 1)."""
    import inspect
    default_b = inspect.signature(make_batch).parameters["b"].default
    b = max(1, int(round(default_b * scale)))
    return lambda step: make_batch(step, b=b)


class Prefetcher:
    """Copies each batch from pinned host memory on a side stream; the compute stream waits for the
    copy and record_stream tells the allocator that the compute stream uses the tensors."""

    def __init__(self, torch, make_batch, device):
        self.torch, self.make_batch, self.device = torch, make_batch, device
        self.stream = torch.cuda.Stream(device)
        self.next = None

    def load(self, step):
        torch = self.torch
        host = {k: v.pin_memory() for k, v in self.make_batch(step).items()}
        with torch.cuda.stream(self.stream):
            self.next = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}

    def get(self):
        torch = self.torch
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        batch = self.next
        for t in batch.values():
            t.record_stream(torch.cuda.current_stream(self.device))
        self.next = None
        return batch


def record_one(name, args):
    """Runs in the subprocess: records and converts one model. Returns the summary dict."""
    import torch
    sys.path.insert(0, HERE)
    import snapshot_to_trace

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 1):
        raise RuntimeError(f"torch {torch.__version__} is too old: _record_memory_history(max_entries=...) needs 2.1")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True
    props = torch.cuda.get_device_properties(device)

    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=args.max_entries)
    torch.cuda.reset_peak_memory_stats(device)
    model, loss_fn, make_batch, description = make_model(name, torch)
    make_batch = scaled(make_batch, args.batch_scale)
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.precision]

    prefetcher = Prefetcher(torch, make_batch, device)
    prefetcher.load(0)
    start = time.time()
    losses = []
    for step in range(args.steps):
        batch = prefetcher.get()
        if step + 1 < args.steps:
            prefetcher.load(step + 1)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        del batch, loss
    torch.cuda.synchronize(device)
    seconds = time.time() - start

    stem = os.path.join(args.out, f"torch-{name}")
    snapshot_path = stem + ".pickle"
    torch.cuda.memory._dump_snapshot(snapshot_path)
    torch.cuda.memory._record_memory_history(enabled=None)
    max_reserved = torch.cuda.max_memory_reserved(device)
    max_allocated = torch.cuda.max_memory_allocated(device)

    snapshot = snapshot_to_trace.load_snapshot(snapshot_path)
    source = f"pytorch:{name}:torch-{torch.__version__}:{props.name}"
    header, events, info = snapshot_to_trace.convert(snapshot, device=0, capacity=props.total_memory, source=source)
    header["torch_max_memory_reserved"] = max_reserved
    header["torch_max_memory_allocated"] = max_allocated
    header["steps"] = args.steps
    snapshot_to_trace.write_trace(stem + ".trace.gz", snapshot_to_trace.format_trace(header, events))
    if not args.keep_snapshots:
        os.remove(snapshot_path)

    summary = {
        "model": name, "description": description, "torch": torch.__version__, "gpu": props.name,
        "gpu_memory": props.total_memory, "steps": args.steps, "precision": args.precision,
        "batch_scale": args.batch_scale, "seconds": round(seconds, 3), "losses": losses,
        "max_memory_reserved": max_reserved, "max_memory_allocated": max_allocated,
        "trace": stem + ".trace.gz", "trace_events": len(events), "snapshot_events": info["window_events"],
        "max_entries": args.max_entries, "window_complete": info["window_events"] < args.max_entries,
        "seeded": info["seeded"], "torch_peak_reserved_in_window": header["torch_peak_reserved"],
        "streams": info["streams"],
    }
    with open(stem + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    # When the window holds every event since the reset, the two peaks are the same number.
    if summary["window_complete"] and header["torch_peak_reserved"] != max_reserved:
        print(f"record_torch_traces: {name}: peak reserved from the trace {header['torch_peak_reserved']} "
              f"!= torch.cuda.max_memory_reserved() {max_reserved}", file=sys.stderr)
    return summary


# --- driver ---------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "traces"), help="output directory (default bench/traces)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--steps", type=int, default=6, help="training steps per model (default 6)")
    p.add_argument("--max-entries", type=int, default=2_000_000, help="allocator history ring size")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="autocast dtype (default bf16)")
    p.add_argument("--batch-scale", type=float, default=1.0, help="multiply every batch size (default 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep-snapshots", action="store_true", help="keep the .pickle snapshots")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: record this model in this process
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        p.error(f"--models: unknown {unknown}; expected some of {', '.join(MODELS)}")
    if args.steps < 1 or args.max_entries < 1000 or args.batch_scale <= 0:
        p.error("--steps must be >= 1, --max-entries >= 1000, --batch-scale > 0")
    args.models = models
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        summary = record_one(args.one, args)
        print(json.dumps(summary))
        return 0

    import importlib.util
    if importlib.util.find_spec("torch") is None:
        print("record_torch_traces: torch is not installed (pip install torch torchvision transformers)",
              file=sys.stderr)
        return 2
    failed = []
    for name in args.models:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--out", args.out,
               "--steps", str(args.steps), "--max-entries", str(args.max_entries),
               "--precision", args.precision, "--batch-scale", str(args.batch_scale), "--seed", str(args.seed)]
        if args.keep_snapshots:
            cmd.append("--keep-snapshots")
        print(f"record_torch_traces: {name} ...", file=sys.stderr, flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        sys.stderr.write(run.stderr)
        if run.returncode != 0:
            failed.append(name)
            print(f"record_torch_traces: {name} FAILED (exit {run.returncode})", file=sys.stderr)
            continue
        s = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"record_torch_traces: {name}: {s['trace_events']} events -> {s['trace']}; PyTorch max reserved "
              f"{s['max_memory_reserved'] / 2**30:.2f} GiB, allocated {s['max_memory_allocated'] / 2**30:.2f} GiB"
              f"{'' if s['window_complete'] else ' (history ring wrapped: raise --max-entries)'}",
              file=sys.stderr)
    if failed:
        print(f"record_torch_traces: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""train_bench: training under a GPU memory budget, spillway against PyTorch's ways of saving memory.

NEVER RUN ON A GPU YET. Every mode below except --smoke needs a CUDA device; the only runs made so
far are --smoke (CPU) and --list. No figure this script prints has been measured on a GPU.

    python3 bench/train_bench.py --json out/train_bench.json            # the budget suite (GPU)
    python3 bench/train_bench.py --max-batch --models resnet50 --memory 11GiB --json out/maxb.json
    python3 bench/train_bench.py --spill-bandwidth --json out/bandwidth.json
    python3 bench/train_bench.py --smoke                                 # CPU, under a minute
    python3 bench/train_bench.py --list                                  # the plan, nothing run

The spillway package must be importable (PYTHONPATH=<build>/python). ResNet-50 and ViT-B/16 need
torchvision, GPT-2 medium and BERT-base need transformers; a model whose package is missing is
recorded as skipped; without --models, "transformer" (GPT-2-medium-sized, torch only) is then
added so that the run still measures something. "transformer" and "mlp" need nothing else.
Every model has random weights; nothing is downloaded.

Contract
- Budget suite (default mode). For each model: an unconstrained run on PyTorch's allocator gives
  the peak reserved bytes P (torch.cuda.max_memory_reserved) and the step time T. Then at every
  ratio r of --budgets (default 1.0,0.7,0.5,0.3) each configuration of --configs runs with a cap of
  r x P reserved bytes:
    native           PyTorch's allocator, no eviction (set_per_process_memory_fraction)
    checkpoint       torch.utils.checkpoint(use_reentrant=False) around every block (fraction cap)
    save-on-cpu      torch.autograd.graph.save_on_cpu(pin_memory=True) around the forward (fraction cap)
    compile-budget   torch.compile with torch._functorch.config.activation_memory_budget = r
                     (fraction cap); where torch.compile fails, the error is the result
    spillway-alloc   spillway.install(budget=r x P), no activations manager (the allocator alone)
    spillway-spill   spillway.install(budget=...), spillway.activations(mode="spill"); blocks are
                     not wrapped (a spillway.checkpoint segment keeps its inputs resident)
    spillway-drop    ... activations(mode="drop"), every block wrapped in spillway.checkpoint
    spillway-hybrid  ... activations(mode="hybrid"), every block wrapped in spillway.checkpoint
  Each configuration runs in its own subprocess (spillway.install must precede any CUDA use; the
  parent never touches CUDA). A run does --warmup steps, then --steps timed steps (synchronised
  wall time per step); its result is one JSON object (fields in RESULT_FIELDS): status ok / oom /
  error / timeout / crashed / skipped, median step time, peak reserved and allocated bytes, the
  allocator's OOMs and retries, and spillway's evictions (spills, drops, restores, recomputes and
  their bytes) over the timed steps. The parent adds the overhead against T.
- --max-batch: per model, precision (--precision fp32,amp) and configuration, the largest batch
  whose training step runs under a fixed cap (--memory, default 11GiB: MegEngine's ResNet-50
  figure), found by doubling then bisection, each probe a subprocess; with the per-sample time at
  that batch. Then PyTorch's allocator with gradient accumulation at its own largest batch, with
  as many micro-batches as reach spillway's largest batch: the per-sample time of the usual
  alternative.
- --spill-bandwidth: (1) the pinned host<->device copy limit: large copies of pinned buffers, each
  direction alone and both at once on two streams; (2) spillway spilling: a model trained in
  mode "spill" at --spill-ratio of its unconstrained peak; one step is profiled (CUPTI through
  torch.profiler) and its device<->pinned copies give the bandwidth the spills achieve and the
  fraction of copy time overlapped by kernels; spillway.stats() gives the bytes per step.
- --smoke: a tiny MLP on CPU (no torchvision or transformers), under a minute on two cores. The
  pressure is spillway.activations(max_resident=r x the saved-activation bytes) instead of an
  allocator budget; the PyTorch baselines that run on CPU (checkpoint, save-on-cpu) run as well;
  native-at-a-budget and compile-budget are recorded as skipped. GPU-only fields are null. (The
  manager's resident bytes include parameters autograd saves, which are never evictable, so on CPU
  the pressure is at least what the ratio says: a harness check, not a measurement.) It
  checks that every configuration ran, that each spillway mode evicted, that every loss is
  bit-identical to the unconstrained run's, and the search and trace-analysis helpers; exit 1 if not.
- Output: one JSON line per configuration on stdout as it finishes; --json FILE gets the whole
  document (metadata, results, summary), rewritten after every configuration so a cut-off run
  leaves a valid file; --resume reuses the results already in that file (ok, oom and error ones;
  timed-out and crashed configurations run again), so a long suite can run in several sittings.
  Progress (configurations done / total, elapsed, ETA) goes to stderr (--no-progress: none).
- --timeline adds one untimed step per configuration with samples at every block boundary
  (allocated and reserved bytes, spillway's counters): bench/plot_results.py --train draws it.
  --amp runs the suite under bf16 autocast.
- compile-budget is not like for like: activation_memory_budget is a fraction of the activations
  the default partition saves, not of the whole peak; r is passed as that fraction and the cap
  r x P is enforced as for the others.
- Without a CUDA device every GPU mode prints "SKIPPED: no CUDA device" and exits 0.
- Bad arguments exit 2 with a message naming the value.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

# torch warns at import when numpy is missing; nothing here needs numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_MARK = "TRAIN_BENCH_RESULT "

CONFIGS = ("native", "checkpoint", "save-on-cpu", "compile-budget", "spillway-alloc",
           "spillway-spill", "spillway-drop", "spillway-hybrid")
SPILLWAY_MODES = {"spillway-spill": "spill", "spillway-drop": "drop", "spillway-hybrid": "hybrid"}
WRAPPED = {"checkpoint", "spillway-drop", "spillway-hybrid"}   # blocks wrapped per configuration
CPU_CONFIGS = ("checkpoint", "save-on-cpu", "spillway-spill", "spillway-drop", "spillway-hybrid")

# model name -> (package needed, default batch, description). Batches were chosen without a GPU
# to give peaks of roughly 10-40 GB at fp32 on an 80 GB device; adjust with --batch.
MODELS = {
    "resnet50": ("torchvision", 128, "torchvision ResNet-50, 3x224x224, 1000 classes, SGD"),
    "gpt2-medium": ("transformers", 8, "GPT-2 medium (24 x 1024, 16 heads), 1024 tokens, LM loss, AdamW"),
    "bert-base": ("transformers", 32, "BERT-base MLM (BertConfig()), 512 tokens, 15% masked, AdamW"),
    "vit-b16": ("torchvision", 64, "torchvision ViT-B/16, 3x224x224, 1000 classes, AdamW"),
    "transformer": (None, 8, "24 pre-LN nn.TransformerEncoderLayer(1024, 16 heads, 4096), 1024 tokens, "
                             "vocab 32000, LM-style loss, AdamW (GPT-2-medium-sized, torch only)"),
    "mlp": (None, 256, "4 residual blocks Linear(256,1024)-GELU-Dropout-Linear(1024,256), MSE, SGD "
                       "(the smoke test's model)"),
}
DEFAULT_MODELS = ("resnet50", "gpt2-medium", "bert-base", "vit-b16")
DEFAULT_BUDGETS = (1.0, 0.7, 0.5, 0.3)

RESULT_FIELDS = (
    "model", "config", "ratio", "budget_bytes", "max_resident_bytes", "batch", "precision", "accum",
    "status", "error", "device", "step_ms_median", "step_ms", "first_step_ms", "samples_per_s",
    "ms_per_sample", "peak_reserved", "peak_allocated", "saved_activation_bytes", "alloc_retries",
    "ooms", "spills", "drops", "restores", "recomputes", "evictions", "prefetches", "bytes_spilled",
    "bytes_dropped", "bytes_restored", "pressure_calls", "losses", "timeline", "wall_s")
COUNTERS = ("spills", "drops", "restores", "recomputes", "evictions", "prefetches", "bytes_spilled",
            "bytes_dropped", "bytes_restored")


# ================================================================================================
# Argument parsing
# ================================================================================================

class ArgError(Exception):
    pass


def parse_size(text):
    """Bytes from '11GiB', '512MiB', '2.5GB', '1e9' (binary with iB, decimal with B)."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "m": 1 << 20, "mib": 1 << 20,
             "mb": 10 ** 6, "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9, "t": 1 << 40, "tib": 1 << 40,
             "tb": 10 ** 12}
    s = text.strip()
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    number, unit = s[:i], s[i:].lower()
    try:
        value = float(number)
    except ValueError:
        raise ArgError(f"size {text!r} is invalid: expected a number with an optional unit "
                       "(KiB, MiB, GiB, TiB, KB, MB, GB, TB)") from None
    if unit not in units or value <= 0 or not math.isfinite(value):
        raise ArgError(f"size {text!r} is invalid: expected a positive number with an optional unit "
                       "(KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    return int(value * units[unit])


def parse_list(text, allowed, what):
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ArgError(f"{what} {text!r} is empty: expected a comma-separated list of {', '.join(allowed)}")
    for item in items:
        if item not in allowed:
            raise ArgError(f"{what} {item!r} is unknown: expected one of {', '.join(allowed)}")
    return items


def parse_ratios(text):
    out = []
    for t in text.split(","):
        try:
            r = float(t)
        except ValueError:
            raise ArgError(f"budget ratio {t.strip()!r} is invalid: expected a number in (0, 1], "
                           "e.g. --budgets 1.0,0.7,0.5,0.3") from None
        if not 0 < r <= 1:
            raise ArgError(f"budget ratio {t.strip()!r} is out of range: expected a number in (0, 1]")
        out.append(r)
    return out


def parse_batches(items):
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or name not in MODELS:
            raise ArgError(f"--batch {item!r} is invalid: expected MODEL=N with MODEL one of "
                           f"{', '.join(MODELS)}")
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ArgError(f"--batch {item!r} is invalid: the batch must be an int >= 1")
        out[name] = n
    return out


def positive_int(name, value, minimum=1):
    if value < minimum:
        raise ArgError(f"{name} {value} is invalid: expected an int >= {minimum}")
    return value


def build_parser():
    p = argparse.ArgumentParser(
        description="Training under a memory budget: spillway against PyTorch's native allocator, "
                    "torch.utils.checkpoint, save_on_cpu and torch.compile's activation budget. "
                    "Never run on a GPU yet.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="CPU harness check with a tiny MLP (< 1 min)")
    mode.add_argument("--max-batch", action="store_true", help="largest batch at a fixed memory size")
    mode.add_argument("--spill-bandwidth", action="store_true", help="copy limit and spill bandwidth")
    mode.add_argument("--list", action="store_true", help="print the configurations, run nothing")
    mode.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)} (default: %(default)s)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--budgets", default=",".join(str(b) for b in DEFAULT_BUDGETS),
                   help="ratios of the unconstrained peak reserved bytes (default: %(default)s)")
    p.add_argument("--batch", action="append", metavar="MODEL=N", help="batch size of a model (repeatable)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--amp", action="store_true", help="bf16 autocast in the budget suite")
    p.add_argument("--policy", default="dtr", help="spillway eviction policy: dtr, lru, largest")
    p.add_argument("--spillway-conf", default="", metavar="K:V,...",
                   help="extra spillway.install settings, SPILLWAY_CONF syntax (e.g. expandable_segments:True)")
    p.add_argument("--timeline", action="store_true",
                   help="record a memory timeline of one extra step per configuration (for plot_results.py)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per configuration (default 900)")
    p.add_argument("--json", metavar="FILE", help="write the JSON document here (rewritten as results come)")
    p.add_argument("--resume", action="store_true", help="reuse the results already in --json FILE")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    # --max-batch
    p.add_argument("--memory", default="11GiB", help="--max-batch: the memory cap (default %(default)s)")
    p.add_argument("--precision", default="fp32,amp", help="--max-batch: fp32, amp or both (default %(default)s)")
    p.add_argument("--search-configs", default="native,spillway-hybrid",
                   help="--max-batch: configurations searched (default %(default)s)")
    p.add_argument("--start-batch", type=int, default=8, help="--max-batch: first probe (default 8)")
    p.add_argument("--max-batch-limit", type=int, default=4096, help="--max-batch: largest probe (default 4096)")
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="--max-batch: stop bisecting when the bracket is within this fraction (default 0.03)")
    # --spill-bandwidth
    p.add_argument("--copy-sizes", default="64MiB,256MiB,1GiB", help="--spill-bandwidth: copy sizes")
    p.add_argument("--copy-iters", type=int, default=10, help="--spill-bandwidth: copies per size")
    p.add_argument("--spill-model", default="transformer", help="--spill-bandwidth: model trained (default %(default)s)")
    p.add_argument("--spill-ratio", type=float, default=0.5,
                   help="--spill-bandwidth: budget as a ratio of the unconstrained peak (default 0.5)")
    return p


def check_args(a):
    """Validates and normalises the parsed arguments; raises ArgError naming the bad value."""
    a.models = parse_list(a.models, tuple(MODELS), "model")
    a.configs = parse_list(a.configs, CONFIGS, "configuration")
    a.budgets = parse_ratios(a.budgets)
    a.batches = parse_batches(a.batch)
    positive_int("--steps", a.steps)
    positive_int("--warmup", a.warmup, 0)
    positive_int("--copy-iters", a.copy_iters)
    positive_int("--start-batch", a.start_batch)
    positive_int("--max-batch-limit", a.max_batch_limit, a.start_batch)
    if a.policy not in ("dtr", "lru", "largest", "dtr-frag"):
        raise ArgError(f"--policy {a.policy!r} is unknown: expected dtr, lru, largest or dtr-frag")
    if a.timeout <= 0:
        raise ArgError(f"--timeout {a.timeout} is invalid: expected seconds > 0")
    if not 0 < a.tolerance < 1:
        raise ArgError(f"--tolerance {a.tolerance} is invalid: expected a fraction in (0, 1)")
    if not 0 < a.spill_ratio <= 1:
        raise ArgError(f"--spill-ratio {a.spill_ratio} is invalid: expected a ratio in (0, 1]")
    if a.spill_model not in MODELS:
        raise ArgError(f"--spill-model {a.spill_model!r} is unknown: expected one of {', '.join(MODELS)}")
    if a.resume and not a.json:
        raise ArgError("--resume needs --json FILE: the results are resumed from that file")
    a.memory_bytes = parse_size(a.memory)
    a.precisions = parse_list(a.precision, ("fp32", "amp"), "precision")
    a.search_configs = parse_list(a.search_configs, CONFIGS, "--search-configs entry")
    a.copy_sizes = [parse_size(s) for s in a.copy_sizes.split(",") if s.strip()]
    a.spillway_settings = parse_conf(a.spillway_conf)
    return a


def parse_conf(text):
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition(":")
        if not sep or not key.strip():
            raise ArgError(f"--spillway-conf entry {item!r} is invalid: expected key:value")
        out[key.strip()] = value.strip()
    return out


# ================================================================================================
# Worker: one configuration in this process (spec from the parent)
# ================================================================================================

def import_torch():
    import torch
    return torch


def gpu_fields_null(result):
    for k in ("peak_reserved", "peak_allocated", "alloc_retries", "ooms", "budget_bytes"):
        result[k] = None


class BlockWrapper:
    """Factory of an nn.Module running its inner block through a checkpoint function."""

    @staticmethod
    def make(torch, inner, run):
        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, *args, **kwargs):
                return run(self.inner, *args, **kwargs)
        return Wrapped()


def build_model(torch, name, device):
    """(model, blocks, make_batch, loss_fn): blocks are (parent, attribute) pairs of the model's
    repeated blocks; make_batch(bs, gen) -> batch on device; loss_fn(model, batch) -> loss."""
    if name == "mlp":
        return _mlp(torch, device)
    if name == "transformer":
        return _transformer(torch, device)
    if name in ("resnet50", "vit-b16"):
        return _torchvision(torch, name, device)
    return _hf(torch, name, device)


def _image_batch(torch, device, classes=1000):
    def make(bs, gen):
        x = torch.randn(bs, 3, 224, 224, generator=gen).to(device)
        y = torch.randint(0, classes, (bs,), generator=gen).to(device)
        return x, y
    return make


def _mlp(torch, device):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))

        def forward(self, x):
            return x + self.body(x)

    model = nn.Sequential(*[Block() for _ in range(4)], nn.LayerNorm(256)).to(device)
    blocks = [(model, str(i)) for i in range(4)]

    def make(bs, gen):
        return (torch.randn(bs, 256, generator=gen).to(device), torch.randn(bs, 256, generator=gen).to(device))

    return model, blocks, make, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])


def _transformer(torch, device, width=1024, layers=24, heads=16, vocab=32000, seq=1024):
    nn = torch.nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.layers = nn.ModuleList([nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1,
                                                                    batch_first=True, norm_first=True)
                                         for _ in range(layers)])
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, ids):
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h))

    model = LM().to(device)
    blocks = [(model.layers, str(i)) for i in range(layers)]

    def make(bs, gen):
        return (torch.randint(0, vocab, (bs, seq), generator=gen).to(device),)

    def loss(m, b):
        logits = m(b[0])
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), b[0][:, 1:].reshape(-1))
    return model, blocks, make, loss


def _torchvision(torch, name, device):
    import torchvision
    if name == "resnet50":
        model = torchvision.models.resnet50(weights=None).to(device)
        blocks = [(getattr(model, f"layer{i}"), str(j)) for i in range(1, 5)
                  for j in range(len(getattr(model, f"layer{i}")))]
    else:
        model = torchvision.models.vit_b_16(weights=None).to(device)
        blocks = [(model.encoder.layers, n) for n, _ in model.encoder.layers.named_children()]
    return model, blocks, _image_batch(torch, device), \
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _hf(torch, name, device):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers
    if name == "gpt2-medium":
        cfg = transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, use_cache=False)
        model = transformers.GPT2LMHeadModel(cfg).to(device)
        blocks = [(model.transformer.h, str(i)) for i in range(cfg.n_layer)]
        seq = 1024

        def make(bs, gen):
            ids = torch.randint(0, cfg.vocab_size, (bs, seq), generator=gen)
            return (ids.to(device),)

        return model, blocks, make, lambda m, b: m(input_ids=b[0], labels=b[0]).loss
    cfg = transformers.BertConfig()
    model = transformers.BertForMaskedLM(cfg).to(device)
    blocks = [(model.bert.encoder.layer, str(i)) for i in range(cfg.num_hidden_layers)]
    seq = 512

    def make(bs, gen):
        ids = torch.randint(0, cfg.vocab_size, (bs, seq), generator=gen)
        masked = torch.rand(bs, seq, generator=gen) < 0.15
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return ids.to(device), labels.to(device)

    return model, blocks, make, lambda m, b: m(input_ids=b[0], labels=b[1]).loss


def make_optimizer(torch, name, model):
    if name in ("resnet50", "mlp"):
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def wrap_blocks(torch, blocks, config):
    if config not in WRAPPED:
        return
    if config == "checkpoint":
        from torch.utils.checkpoint import checkpoint

        def run(m, *a, **k):
            return checkpoint(m, *a, use_reentrant=False, **k)
    else:
        import spillway

        def run(m, *a, **k):
            return spillway.checkpoint(m, *a, **k)
    for parent, attr in blocks:
        setattr(parent, attr, BlockWrapper.make(torch, getattr(parent, attr), run))


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


def install_for(spec):
    """Installs spillway (CUDA, spillway configurations) or sets the memory fraction (CUDA,
    PyTorch configurations with a budget). Must run before anything touches CUDA."""
    torch = import_torch()
    config, device, budget = spec["config"], spec["device"], spec.get("budget_bytes")
    if config.startswith("spillway"):
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
    if spec["device"] != "cuda":
        gpu_fields_null(result)
        return
    try:
        ms = torch.cuda.memory_stats()
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


# ================================================================================================
# Parent: subprocesses, progress, the JSON document
# ================================================================================================

def run_subprocess(spec, timeout):
    """Runs `--worker spec` in a fresh interpreter; returns its result, or a status record."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return dict(_base(spec), status="timeout", error=f"no result within {timeout:.0f} s",
                    stderr_tail=tail, wall_s=round(time.perf_counter() - start, 3))
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    return dict(_base(spec), status="crashed", error=f"worker exited with status {p.returncode} without a result",
                stderr_tail=p.stderr[-2000:], wall_s=round(time.perf_counter() - start, 3))


def _base(spec):
    out = {k: spec.get(k) for k in RESULT_FIELDS}
    out.update(status=None, error=None, timeline=None)
    return out


def fmt_duration(s):
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Configurations done / total, elapsed and ETA on stderr, one line per event."""

    def __init__(self, total, enabled=True, stream=None):
        self.total, self.enabled = total, enabled  # total None: not known in advance (no ETA)
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self.spent = 0.0  # seconds of the configurations actually run (resumed ones cost nothing)
        self.ran = 0

    def _write(self, text):
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()

    def _count(self, n):
        return f"[{n}/{self.total}]" if self.total else f"[{n}]"

    def starting(self, label):
        self._write(f"{self._count(self.done + 1)} {label} ...")

    def finished(self, label, result, seconds, note=None):
        self.done += 1
        if note is None:
            self.spent += seconds
            self.ran += 1
        elapsed = time.perf_counter() - self.start
        left = (self.total or 0) - self.done
        eta = "?" if self.ran == 0 or not self.total else fmt_duration(self.spent / self.ran * left)
        self._write(f"{self._count(self.done)} {label}: {describe(result)}"
                    f"{' (' + note + ')' if note else ''} | elapsed {fmt_duration(elapsed)}, ETA {eta}")


def describe(r):
    status = r.get("status")
    if status == "ok" and r.get("step_ms_median") is not None:
        extra = []
        if r.get("peak_reserved"):
            extra.append(f"peak {r['peak_reserved'] / 2 ** 30:.2f} GiB")
        if r.get("evictions"):
            extra.append(f"{r['spills']} spills, {r['drops']} drops")
        return f"ok {r['step_ms_median']:.1f} ms/step" + (f", {', '.join(extra)}" if extra else "")
    return f"{status}: {r.get('error') or ''}"[:160]


def result_key(r):
    """What identifies a configuration's result, for --resume (a --max-batch probe is also keyed
    by its memory cap)."""
    return (r.get("model"), r.get("config"), r.get("ratio"), r.get("batch"), r.get("precision"),
            r.get("accum") or 1, r.get("kind", "train"), r.get("search"),
            r.get("budget_bytes") if r.get("search") else None)


class Document:
    """The JSON document of a run: metadata and results, rewritten after every result."""

    def __init__(self, path, mode, argv, meta, resume):
        self.path = path
        self.data = {"tool": "train_bench", "mode": mode, "argv": argv,
                     "note": "train_bench.py had never run on a GPU before this version; check a first "
                             "GPU run's figures before quoting them",
                     "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit(),
                     "environment": meta, "results": []}
        self.previous = {}
        if resume and path and os.path.exists(path):
            with open(path) as f:
                for r in json.load(f).get("results", []):
                    self.previous[result_key(r)] = r

    def reuse(self, key):
        return self.previous.get(key)

    def add(self, result):
        self.data["results"].append(result)
        self.previous.pop(result_key(result), None)
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        self.save()

    def all_results(self):
        """This run's results, then the earlier run's that this run has not redone (with --resume,
        a run over fewer models or budgets keeps the others' results)."""
        return self.data["results"] + list(self.previous.values())

    def save(self):
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(self.data, results=self.all_results()), f, indent=1)
            f.write("\n")
        os.replace(tmp, self.path)


def git_commit():
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def spec_for(a, model, config, ratio, base_bytes, device, **extra):
    spec = {"kind": "train", "model": model, "config": config, "ratio": ratio, "device": device,
            "batch": a.batches.get(model, MODELS[model][1]), "precision": "amp" if a.amp else "fp32",
            "accum": 1, "steps": a.steps, "warmup": a.warmup, "policy": a.policy,
            "spillway_settings": a.spillway_settings, "timeline": a.timeline, "seed": 0}
    if ratio is not None and base_bytes:
        if device == "cuda":
            spec["budget_bytes"] = int(ratio * base_bytes)
        else:
            spec["max_resident_bytes"] = int(ratio * base_bytes)
    spec.update(extra)
    return spec


def missing_package(meta, model):
    pkg = MODELS[model][0]
    return pkg if pkg and not meta.get(pkg) else None


def label_of(spec):
    if spec.get("kind", "train") != "train":
        return f"{spec['kind']} {spec.get('model') or ''}".strip()
    if spec.get("search"):
        return (f"{spec['model']} {spec['precision']} {spec['config']} batch {spec['batch']}"
                f"{' x ' + str(spec['accum']) if spec.get('accum', 1) > 1 else ''}")
    ratio = "unconstrained" if spec.get("ratio") is None else f"r={spec['ratio']:.2f}"
    return f"{spec['model']} {ratio} {spec['config']}"


def run_one(doc, progress, spec, timeout):
    key = result_key(spec)
    old = doc.reuse(key)
    label = label_of(spec)
    if old is not None and old.get("status") in ("ok", "oom", "error"):  # timeouts and crashes run again
        doc.add(old)
        progress.finished(label, old, 0, note="from the earlier run")
        return old
    progress.starting(label)
    t0 = time.perf_counter()
    result = run_subprocess(spec, timeout)
    result.setdefault("kind", spec.get("kind", "train"))
    doc.add(result)
    progress.finished(label, result, time.perf_counter() - t0)
    return result


def skip(doc, progress, spec, why):
    r = dict(_base(spec), status="skipped", error=why, kind=spec.get("kind", "train"))
    doc.add(r)
    progress.finished(label_of(spec), r, 0, note="")  # not counted in the ETA
    return r


def budget_suite(a, meta, doc, device, smoke=False):
    """Runs the unconstrained configuration, then every (ratio, configuration) per model."""
    configs = [c for c in a.configs]
    total = len(a.models) * (1 + len(a.budgets) * len(configs))
    progress = Progress(total, not a.no_progress)
    for model in a.models:
        base_spec = spec_for(a, model, "native", None, None, device, measure_saved=(device != "cuda"),
                             deterministic=smoke)
        pkg = missing_package(meta, model)
        if pkg:
            skip(doc, progress, base_spec, f"{pkg} is not installed")
            for ratio in a.budgets:
                for config in configs:
                    skip(doc, progress, spec_for(a, model, config, ratio, None, device), f"{pkg} is not installed")
            continue
        base = run_one(doc, progress, base_spec, a.timeout)
        base_bytes = base.get("peak_reserved") if device == "cuda" else base.get("saved_activation_bytes")
        for ratio in a.budgets:
            for config in configs:
                spec = spec_for(a, model, config, ratio, base_bytes, device, deterministic=smoke)
                why = skip_reason(spec, base, base_bytes, device)
                if why:
                    skip(doc, progress, spec, why)
                else:
                    run_one(doc, progress, spec, a.timeout)
    doc.data["summary"] = summarize(doc.all_results())
    doc.save()


def skip_reason(spec, base, base_bytes, device):
    if base.get("status") != "ok" or not base_bytes:
        return f"the unconstrained run did not complete ({base.get('status')})"
    if device != "cuda" and spec["config"] not in CPU_CONFIGS:
        return ("on CPU a budget cannot be enforced for this configuration"
                if spec["config"] in ("native", "spillway-alloc") else "GPU only (not run in --smoke)")
    return None


def summarize(results):
    """Per model: the unconstrained reference and, per ratio and configuration, the status, step
    time, overhead against the reference, peak and evictions."""
    out = {}
    train = [r for r in results if r.get("kind", "train") == "train" and r.get("model") is not None
             and not r.get("search")]
    for r in train:  # the references first: with --resume they may come after their runs
        m = out.setdefault(r["model"], {"unconstrained": None, "runs": []})
        if r.get("ratio") is None:
            m["unconstrained"] = {k: r.get(k) for k in ("status", "step_ms_median", "peak_reserved",
                                                        "saved_activation_bytes", "losses")}
    for r in train:
        if r.get("ratio") is None:
            continue
        m = out[r["model"]]
        ref = m["unconstrained"] or {}
        row = {k: r.get(k) for k in ("ratio", "config", "status", "step_ms_median", "peak_reserved",
                                     "budget_bytes", "max_resident_bytes", "spills", "drops", "recomputes")}
        if r.get("status") == "ok" and ref.get("step_ms_median"):
            row["overhead"] = round(r["step_ms_median"] / ref["step_ms_median"] - 1, 4)
        if r.get("losses") and ref.get("losses"):
            n = min(len(r["losses"]), len(ref["losses"]))
            row["loss_max_abs_diff"] = max((abs(x - y) for x, y in zip(r["losses"][:n], ref["losses"][:n])),
                                           default=None)
        m["runs"].append(row)
    return out


# ================================================================================================
# --max-batch
# ================================================================================================

def largest_fitting(fits, start, limit, tolerance):
    """The largest b in [1, limit] with fits(b), fits being monotone (true up to some batch):
    doubling from `start`, then bisection until the bracket is within `tolerance` of its low end.
    Returns (largest, probes) with probes the (batch, fitted) pairs in order; largest 0 when even 1
    does not fit."""
    probes = []

    def probe(b):
        ok = fits(b)
        probes.append((b, ok))
        return ok

    lo, hi, b = 0, limit + 1, start
    while b <= limit:
        if probe(b):
            lo = b
            b *= 2
        else:
            hi = b
            break
    if lo == 0 and start > 1:
        lo_b = 1
        if probe(lo_b):
            lo = 1
        else:
            return 0, probes
    while hi - lo > max(1, int(lo * tolerance)):
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def max_batch(a, meta, doc):
    progress = Progress(None, not a.no_progress)
    summary = {}
    for model in a.models:
        pkg = missing_package(meta, model)
        if pkg:
            doc.add({"kind": "max-batch", "model": model, "status": "skipped", "error": f"{pkg} is not installed"})
            continue
        for precision in a.precisions:
            found = {}
            for config in a.search_configs:
                found[config] = search_one(a, doc, progress, model, precision, config)
            summary[f"{model}/{precision}"] = compare_batches(found)
            accumulation_point(a, doc, progress, model, precision, found, summary[f"{model}/{precision}"])
    doc.data["summary"] = summary
    doc.save()


def search_one(a, doc, progress, model, precision, config):
    results = {}

    def fits(b):
        spec = {"kind": "train", "model": model, "config": config, "ratio": None, "device": "cuda",
                "batch": b, "precision": precision, "accum": 1, "steps": 2, "warmup": 1,
                "budget_bytes": a.memory_bytes, "policy": a.policy, "spillway_settings": a.spillway_settings,
                "search": "max-batch"}
        r = run_one(doc, progress, spec, a.timeout)
        results[b] = r
        return r.get("status") == "ok"

    best, probes = largest_fitting(fits, a.start_batch, a.max_batch_limit, a.tolerance)
    r = results.get(best, {})
    return {"config": config, "precision": precision, "memory_bytes": a.memory_bytes, "max_batch": best,
            "ms_per_sample": r.get("ms_per_sample"), "step_ms_median": r.get("step_ms_median"),
            "probes": probes}


def compare_batches(found):
    """Per configuration: its largest batch and per-sample time, and against PyTorch's allocator
    ("native"): the batch gain and the per-sample slowdown (DTR's +9% at 2.2-3x, MegEngine's 2x)."""
    native = found.get("native", {})
    out = {}
    for config, f in found.items():
        row = {k: v for k, v in f.items() if k != "probes"}
        if config != "native" and native.get("max_batch"):
            row["batch_gain"] = round(f["max_batch"] / native["max_batch"], 3)
            if f.get("ms_per_sample") and native.get("ms_per_sample"):
                row["per_sample_slowdown"] = round(f["ms_per_sample"] / native["ms_per_sample"] - 1, 4)
        out[config] = row
    return out


def accumulation_point(a, doc, progress, model, precision, found, summary):
    """PyTorch's allocator at its largest batch with gradient accumulation up to spillway's."""
    native = found.get("native", {}).get("max_batch") or 0
    target = max((f["max_batch"] for c, f in found.items() if c.startswith("spillway")), default=0)
    if native < 1 or target <= native:
        return
    accum = math.ceil(target / native)
    spec = {"kind": "train", "model": model, "config": "native", "ratio": None, "device": "cuda",
            "batch": native, "precision": precision, "accum": accum, "steps": 2, "warmup": 1,
            "budget_bytes": a.memory_bytes, "search": "accumulation"}
    r = run_one(doc, progress, spec, a.timeout)
    summary["native+accumulation"] = {"micro_batch": native, "accum": accum, "status": r.get("status"),
                                      "ms_per_sample": r.get("ms_per_sample")}


# ================================================================================================
# --spill-bandwidth
# ================================================================================================

def spill_bandwidth(a, meta, doc):
    progress = Progress(3, not a.no_progress)
    limit = run_one(doc, progress, {"kind": "copy-limit", "model": None, "config": "copy-limit",
                                    "sizes": a.copy_sizes, "iters": a.copy_iters}, a.timeout)
    model = a.spill_model
    pkg = missing_package(meta, model)
    if pkg:
        doc.add({"kind": "spill-profile", "model": model, "status": "skipped", "error": f"{pkg} is not installed"})
        return
    base = run_one(doc, progress, spec_for(a, model, "native", None, None, "cuda"), a.timeout)
    if base.get("status") != "ok":
        return
    spec = spec_for(a, model, "spillway-spill", a.spill_ratio, base["peak_reserved"], "cuda",
                    kind="spill-profile", timeline=False)
    prof = run_one(doc, progress, spec, a.timeout)
    doc.data["summary"] = {"copy_limit": limit.get("sizes"), "spill": {k: prof.get(k) for k in (
        "bytes_spilled", "bytes_restored", "profiled_step_ms", "spill_rate_over_step_gbps", "copies")}}
    doc.save()


# ================================================================================================
# --smoke (CPU)
# ================================================================================================

def smoke(a):
    """The harness on CPU: budget suite on the tiny MLP, checks; returns the exit status."""
    t0 = time.perf_counter()
    a.models, a.configs, a.budgets = ["mlp"], ["native", "compile-budget"] + list(CPU_CONFIGS), [0.3]
    a.steps, a.warmup, a.timeout = 2, 1, 120  # --timeline is kept: it exercises the timeline path
    a.batches = {"mlp": 64}
    failures = check_helpers()
    meta = probe_device()  # in this process: on CPU the parent may import torch
    if not meta.get("spillway"):
        print(f"train_bench smoke: FAILED: the spillway package is not importable "
              f"({meta.get('spillway_error')}); set PYTHONPATH=<build>/python", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        path = a.json or os.path.join(tmp, "smoke.json")
        doc = Document(path, "smoke", sys.argv[1:], meta, resume=False)
        budget_suite(a, meta, doc, "cpu", smoke=True)
        with open(path) as f:
            results = json.load(f)["results"]
    failures += check_smoke(results)
    elapsed = time.perf_counter() - t0
    ran = sum(1 for r in results if r["status"] != "skipped")
    for f in failures:
        print(f"train_bench smoke: {f}", file=sys.stderr)
    verdict = "FAILED" if failures else "PASSED"
    print(f"train_bench smoke: {verdict}: {ran} configurations run in subprocesses, "
          f"{len(results) - ran} skipped, {elapsed:.1f} s", file=sys.stderr)
    return 1 if failures else 0


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
        for field in ("peak_reserved", "peak_allocated", "budget_bytes"):
            if r.get(field) is not None:
                failures.append(f"{name}: GPU-only field {field} is {r[field]} on CPU, not null")
        mode = SPILLWAY_MODES.get(r["config"])
        if mode and r["ratio"] is not None:
            want = {"spill": ("spills",), "drop": ("drops", "recomputes"), "hybrid": ("evictions",)}[mode]
            for k in want:
                if not r.get(k):
                    failures.append(f"{name}: expected {k} > 0 under max_resident, got {r.get(k)}")
    return failures


def check_helpers():
    """The pure parts the GPU modes rely on, checked on synthetic inputs."""
    failures = []
    for limit_fit in (1, 5, 37, 100, 4096):
        best, probes = largest_fitting(lambda b, n=limit_fit: b <= n, 8, 4096, 0.0)
        if best != limit_fit:
            failures.append(f"largest_fitting: got {best} for a limit of {limit_fit} ({probes})")
    best, _ = largest_fitting(lambda b: False, 8, 4096, 0.0)
    if best != 0:
        failures.append(f"largest_fitting: got {best} when nothing fits")
    events = [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "kernel", "ts": 150, "dur": 100},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 50, "dur": 200,
               "args": {"bytes": 1 << 20}},
              {"ph": "X", "cat": "Memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 300, "dur": 10,
               "args": {"bytes": 1 << 20}},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0, "dur": 5,
               "args": {"bytes": 4}}]
    got = analyze_copy_trace(events)
    d2h, h2d = got.get("d2h", {}), got.get("h2d", {})
    if d2h.get("copies") != 1 or d2h.get("overlap_fraction") != 0.75 or h2d.get("overlap_fraction") != 0.0 \
            or abs(d2h.get("gbps", 0) - (1 << 20) / 200e-6 / 1e9) > 1e-3:
        failures.append(f"analyze_copy_trace: unexpected {got}")
    return failures


# ================================================================================================
# Entry
# ================================================================================================

def list_plan(a):
    for model in a.models:
        pkg, batch, what = MODELS[model]
        print(f"{model}: {what}; batch {a.batches.get(model, batch)}"
              f"{'; needs ' + pkg if pkg else ''}")
        print("  unconstrained native -> P (peak reserved), T (step time)")
        for ratio in a.budgets:
            print(f"  r={ratio:.2f} (cap {ratio:.2f} x P): {', '.join(a.configs)}")
    n = len(a.models) * (1 + len(a.budgets) * len(a.configs))
    print(f"{n} configurations, each in its own subprocess; {a.warmup} warm-up + {a.steps} timed steps")
    return 0


def add_fallback_model(a, argv, meta):
    """Without --models, when a default model's package is missing (an offline GPU machine), the
    torch-only "transformer" is added, so that the run still measures something."""
    given = any(x == "--models" or x.startswith("--models=") for x in argv)
    missing = sorted({missing_package(meta, m) for m in a.models} - {None})
    if not given and missing and "transformer" not in a.models:
        a.models.append("transformer")
        print(f"train_bench: {', '.join(missing)} not installed: their models are skipped and the "
              "torch-only 'transformer' model is added", file=sys.stderr)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.worker:
        return worker_main(a.worker)
    try:
        check_args(a)
    except ArgError as e:
        parser.error(str(e))
    if a.list:
        return list_plan(a)
    if a.smoke:
        return smoke(a)
    meta = run_subprocess({"kind": "probe"}, 300)
    mode = "max-batch" if a.max_batch else "spill-bandwidth" if a.spill_bandwidth else "budget-suite"
    if meta.get("status") in ("crashed", "timeout"):
        print(f"train_bench: could not start torch: {meta.get('error')}\n{meta.get('stderr_tail', '')}",
              file=sys.stderr)
        return 1
    if not meta.get("cuda_available"):
        print(f"SKIPPED: no CUDA device (train_bench {mode} needs a GPU; --smoke runs on CPU)")
        if a.json:
            doc = Document(a.json, mode, argv, meta, resume=False)
            doc.data["skipped"] = "no CUDA device"
            doc.save()
        return 0
    if not meta.get("spillway"):
        print(f"train_bench: the spillway package is not importable ({meta.get('spillway_error')}); "
              "set PYTHONPATH=<build>/python", file=sys.stderr)
        return 1
    add_fallback_model(a, argv, meta)
    doc = Document(a.json, mode, argv, meta, resume=a.resume)
    if a.max_batch:
        max_batch(a, meta, doc)
    elif a.spill_bandwidth:
        spill_bandwidth(a, meta, doc)
    else:
        budget_suite(a, meta, doc, "cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())

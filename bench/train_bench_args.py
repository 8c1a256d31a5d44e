"""train_bench_args: bench/train_bench.py's command line: the parser, and the checks that turn
its strings into values. No torch, no subprocess.

Contract
- build_parser(): the argparse parser of every mode (--smoke, --max-batch, --spill-bandwidth,
  --list, and the hidden --worker SPEC); its help is train_bench.py --help.
- check_args(a): validates and normalises the parsed namespace in place and returns it: a.models,
  a.configs, a.budgets, a.precisions and a.search_configs become lists, a.batches a dict from
  --batch, a.memory_bytes and a.copy_sizes bytes, a.spillway_settings a dict from --spillway-conf.
  A bad value raises ArgError with a message naming it; train_bench.py's main turns that into
  parser.error (exit 2).
- parse_size, parse_list, parse_ratios, parse_batches, positive_int, parse_conf: the pieces, each
  raising ArgError on a bad value.
"""

import argparse
import math

from train_bench_models import CONFIGS, DEFAULT_MODELS, MODELS

DEFAULT_BUDGETS = (1.0, 0.7, 0.5, 0.3)


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
                    "torch.utils.checkpoint, save_on_cpu and torch.compile's activation budget.",
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
    p.add_argument("--smoke-ratio", type=float, default=0.7,
                   help="--smoke: the budget, a ratio of the unconstrained peak (default 0.7)")
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
    if not 0 < a.smoke_ratio <= 1:
        raise ArgError(f"--smoke-ratio {a.smoke_ratio} is invalid: expected a ratio in (0, 1]")
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

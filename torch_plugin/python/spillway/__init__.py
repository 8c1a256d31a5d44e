"""spillway: run PyTorch training inside a GPU memory budget.

    import spillway
    spillway.install(budget="8GiB", policy="dtr")     # before the first CUDA use
    with spillway.activations():                     # saved activations become evictable
        loss = model(x).sum()
        loss.backward()
    spillway.stats()

The allocator
- install(budget=..., policy=..., **settings) makes spillway PyTorch's CUDA allocator (the whole
  c10 CUDAAllocator interface: torch.cuda.memory_stats, memory_summary, _snapshot and empty_cache
  keep working). It must run before CUDA memory is first allocated. Its settings are those of the
  SPILLWAY_CONF environment variable (docs/integration.md), which is read and checked when this
  package is imported; keyword arguments override it.
- set_budget(bytes, device=None), the budget(bytes, device=None) context manager and stats(device=None)
  change and read the budget of the installed allocator. Sizes are ints or strings like "8GiB".
- backend "sim" installs spillway on its simulated device instead, detached from torch (no CUDA
  kernel can run there): for tests and tools on machines without a GPU. With cpu_tensors=True the
  simulated device serves torch's CPU tensors, under its budget: a CPU job then runs under a
  budget, and activations() evicts from inside its allocations, as on a GPU.

Activations (spillway.activations, spillway.checkpoint, spillway.Sequential): see saved_activations.py.

Errors: bad settings raise ValueError naming the setting and what was expected; out of memory raises
torch.OutOfMemoryError with spillway's account of the budget; unsupported allocator features
(CUDA graph pools, CUDA IPC) raise NotImplementedError naming the feature.
"""

import contextlib
import math
import os
import warnings

import torch

from . import _C
from .saved_activations import (ActivationManager, Sequential, activations, checkpoint,
                          checkpoint_sequential)

__all__ = ["install", "is_installed", "set_budget", "get_budget", "budget", "stats", "empty_cache",
           "activations", "checkpoint", "checkpoint_sequential", "Sequential", "ActivationManager",
           "parse_size", "ENV_CONF"]

# SPILLWAY_CONF, read once at import and checked now, so that a typo fails at the first line that
# imports spillway rather than at the first allocation.
ENV_CONF = os.environ.get("SPILLWAY_CONF", "")
_env_settings = _C.parse_config(ENV_CONF)

# PyTorch's allocator settings (PYTORCH_ALLOC_CONF, or its older name PYTORCH_CUDA_ALLOC_CONF).
# Under install() the keys spillway has too are honoured, below SPILLWAY_CONF and the keywords;
# the others tune PyTorch's own allocator, which install() replaces: a warning names them.
_TORCH_CONF_VARIABLE = next((v for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
                             if os.environ.get(v, "").strip()), None)
TORCH_CONF = os.environ.get(_TORCH_CONF_VARIABLE, "") if _TORCH_CONF_VARIABLE else ""
_TORCH_CONF_SHARED_KEYS = ("expandable_segments", "max_split_size_mb")


def _conf_items(text):
    """{key: value} of a "key:value,key:value" text (SPILLWAY_CONF's form, and PyTorch's)."""
    items = {}
    for item in text.split(","):
        if item.strip():
            key, _, value = item.partition(":")
            items[key.strip()] = value.strip()
    return items


def _torch_conf_settings():
    """(the settings spillway takes from PyTorch's variable, the keys it ignores)."""
    items = _conf_items(TORCH_CONF)
    settings = {k: v for k, v in items.items() if k in _TORCH_CONF_SHARED_KEYS}
    ignored = [k for k in items if k not in _TORCH_CONF_SHARED_KEYS]
    try:
        _C.parse_config(_conf_text(settings))
    except ValueError as e:
        raise ValueError(f"{_TORCH_CONF_VARIABLE}={TORCH_CONF!r}: {e}") from None
    return settings, ignored


def _size_or_none(value):
    """parse_size without the message's head: ValueError(what is wrong) for a bad value."""
    if value is None:
        return None
    expected = "expected a whole number of bytes >= 0 or a string like '8GiB'"
    if isinstance(value, bool):
        raise ValueError(expected)
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(expected)
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError("expected a non-negative number of bytes")
        return value
    if isinstance(value, str):
        try:
            return _C.parse_bytes(value)
        except ValueError as e:  # 'invalid size "x": what is wrong; the accepted forms'
            raise ValueError(str(e).split(": ", 1)[-1]) from None
    raise ValueError(expected)


def parse_size(value):
    """An int number of bytes, or None for "no limit", from an int, a whole float (8e9) or a size
    string ("8GiB", "1.5GiB", "1e9"). ValueError names a bad value and says what is wrong."""
    try:
        return _size_or_none(value)
    except ValueError as e:
        raise ValueError(f"spillway: size {value!r} is invalid: {e}") from None


def _conf_text(settings):
    def text(v):
        return str(v) if not isinstance(v, bool) else ("True" if v else "False")
    return ",".join(f"{k}:{text(v)}" for k, v in settings.items() if v is not None)


def install(budget=None, policy=None, cpu_tensors=False, **settings):
    """Installs spillway as PyTorch's CUDA allocator (or on the simulated device: backend="sim").

    budget: bytes or a size string, the cap on reserved device memory; budget_fraction=f instead
    caps it at f x device memory. policy: the eviction policy of spillway.activations() ("dtr",
    "lru", "largest"). cpu_tensors (backend "sim" only): torch's CPU tensors are then allocated on
    the simulated device, under its budget, so that a machine without a GPU runs a job under a
    budget, activations() evicting from inside allocations, as on a GPU (for the rest of the
    process). Other keywords are SPILLWAY_CONF keys (expandable_segments, backend, sim_capacity,
    device). Keywords override SPILLWAY_CONF, which overrides the expandable_segments and
    max_split_size_mb of PyTorch's PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF (its other keys
    tune PyTorch's allocator and are ignored, with a warning). Call it once, before the first CUDA
    use.
    """
    merged, ignored = _torch_conf_settings()
    if ignored:
        warnings.warn(f"spillway.install: {_TORCH_CONF_VARIABLE} keys {', '.join(ignored)} tune "
                      "PyTorch's own allocator, which spillway replaces: ignored", stacklevel=2)
    merged.update(_conf_items(ENV_CONF))
    if budget is not None and settings.get("budget_fraction") is not None:
        raise ValueError(f"spillway.install: budget {budget!r} and budget_fraction "
                         f"{settings['budget_fraction']!r} were both given; expected one of them")
    if budget is not None:
        merged.pop("budget_fraction", None)
        merged["budget"] = parse_size(budget)
    if settings.get("budget_fraction") is not None:
        merged.pop("budget", None)
    if policy is not None:
        merged["policy"] = policy
    merged.update({k: v for k, v in settings.items() if v is not None})
    text = _conf_text(merged)
    config = _C.parse_config(text)  # ValueError names a bad key or value
    if config["backend"] == "cuda" and torch.cuda.is_initialized():
        raise RuntimeError("spillway.install: CUDA is already initialised in this process; call "
                           "spillway.install() before the first CUDA use (tensor, model.cuda(), "
                           "torch.cuda.* call), e.g. at the top of the script")
    if not isinstance(cpu_tensors, bool):
        raise ValueError(f"spillway.install: cpu_tensors {cpu_tensors!r} is invalid: expected "
                         "True or False")
    if cpu_tensors and config["backend"] != "sim":
        raise ValueError(f"spillway.install: cpu_tensors=True needs backend 'sim' (the simulated "
                         f"device serves CPU tensors), not {config['backend']!r}")
    _C.install(text)
    if cpu_tensors:
        _C.serve_cpu_tensors()
    from . import saved_activations as _activations
    _activations._set_default_policy(config["policy"] or "dtr")
    return config


def is_installed():
    return _C.is_installed()


def _device_index(device):
    if device is None:
        if _C.is_installed() and _C.backend() == "cuda" and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, torch.device):
        return _device_index(None) if device.index is None else device.index  # "cuda": the current
    if isinstance(device, str):
        return _device_index(torch.device(device))
    return int(device)


def set_budget(bytes, device=None):
    """Sets the budget of `device` (default: the current one); None removes it. Lowering it releases
    cached memory first and then asks the eviction handlers. Returns a dict: budget, reserved,
    released, shortfall (bytes over the new budget still in use; 0 when it was met). A budget below
    the memory that cannot be freed raises ValueError and leaves the old one in force."""
    return _C.set_budget(_device_index(device), parse_size(bytes))


def get_budget(device=None):
    """The budget of `device` in bytes, or None when it has none."""
    return _C.get_budget(_device_index(device))


@contextlib.contextmanager
def budget(bytes, device=None):
    """Within the block, `device` has this budget; the previous one is restored on exit, even when
    the block left more memory in use than it allows (a warning says so: allocations that need new
    memory then wait for frees, as under a memory fraction). An exception from the block goes on
    as it was."""
    index = _device_index(device)
    previous = _C.get_budget(index)
    report = _C.set_budget(index, parse_size(bytes))
    try:
        yield report
    finally:
        restored = _C.set_budget(index, previous, accept_below_live=True)
        if restored["shortfall"] > 0:
            warnings.warn(
                f"spillway: restoring the budget of {previous} bytes on device {index} left "
                f"{restored['shortfall']} bytes reserved above it; allocations that need new "
                "memory will wait for frees", RuntimeWarning, stacklevel=3)


def stats(device=None):
    """spillway's statistics of `device`: the allocator's (keys as torch.cuda.memory_stats(), plus
    budget and pressure counters) and, under "activations.", those of the activation managers."""
    from . import saved_activations as _activations
    out = _C.stats(_device_index(device)) if _C.is_installed() else {}
    for key, value in _activations._totals().items():
        out["activations." + key] = value
    return out


def empty_cache():
    """Releases spillway's cached device memory (torch.cuda.empty_cache() does the same)."""
    return _C.empty_cache()

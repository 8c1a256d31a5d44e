"""Activations saved for backward, evicted under memory pressure and made resident again on use.
The registry is spillway's C++ activation_manager (torch_plugin/activation_manager.hpp), which
LibTorch programs use too; this module is its Python face: the saved-tensor hooks, checkpoint
segments and their replay (what Python must do: run the segment again under recording hooks, with
BatchNorm running statistics kept).

    with spillway.activations():                        # every saved activation is evictable
        y = spillway.checkpoint(block, x)               # ... and this block's can be recomputed
        loss = head(y).sum()
    loss.backward()

Contract
- Within `activations()`, saved-tensor hooks register every tensor autograd saves for backward, by
  *storage*: views and aliases of one storage share one entry. A storage is evictable only when
  nothing but autograd's saved tensors holds it (torch's storage use count equals the number of
  aliases spillway holds), so a tensor the program still uses is never touched.
- Eviction frees a storage's memory and keeps the storage object: every view of it stays
  valid and sees the bytes again once restored. It either spills (copies the bytes to host memory,
  pinned for CUDA, on a copy stream, and frees the device memory in stream order after the copy) or
  drops (frees it; only for activations of a spillway.checkpoint segment, whose lineage is the
  segment). The choice is per storage, by cost: the segment's measured forward time against the
  spill's: its wait behind the copies to host occupying the copy engine, its copy out and its
  copy back, at the link's bandwidth measured per device from the copies of every manager in the
  process (or `link_bandwidth` if given). Modes "spill" and "drop" force one kind.
- Unpack (backward) makes the storage resident: a spilled one is copied back (the compute stream
  waits for the copy); a dropped one is recomputed by re-running its segment with the RNG state
  (CPU and CUDA) of the original forward, BatchNorm running statistics left as they were, and every
  dropped storage of the segment restored from the recomputation, matched by the order in which the
  segment saved them. Bytes are identical to the original when the segment is deterministic.
  A segment may run a backward of its own (a gradient penalty): its replay runs it too. What
  that backward saves on another thread (PyTorch's device thread, on CUDA, which runs with the
  segment's hooks) is not the segment's, in its first run or its replay.
  When none of the segment's outputs is dropped, the replay stops right after the last dropped
  save still in use (as torch.utils.checkpoint's early stop): what backward has consumed already
  is not run again (stats: recomputes_stopped).
- A segment's tensor inputs are held by the manager, not by the replay: a checkpoint boundary is
  evictable once the program lets go of it. Its outputs give a boundary the segment as lineage
  (when not modified in place since), so a boundary can be dropped; a replay restores its inputs
  first, replaying the segments before it (producers first, through every input) when they were
  dropped too.
- After each unpack, the next spilled storages that autograd will unpack, in backward order
  (reverse pack order), start copying back, so that copies overlap compute: as many as the
  prefetch depth, at most `prefetch`, which halves when a storage restored ahead is taken back
  unread and grows by one when an unpack waits for its copy (stats()["prefetch_depth"],
  stats()["unpacks_waiting"]); each only into
  room that max_resident and the budget have (a prefetch never makes the allocator evict). A
  storage restored ahead may be evicted again: stats()["prefetches_unused"] counts those. It
  keeps its host copy until it is unpacked, so evicting it again copies nothing
  (stats()["clean_evictions"]; the kept copies, stats()["kept_host_bytes"], count against
  max_spilled and go first when a spill needs their room).
- Parameters (leaves that require grad) are saved as they are: they are not activations.
- When eviction happens: (a) whenever the resident bytes of evictable saved activations (those
  only autograd holds) exceed `max_resident` (checked at every pack and unpack and when the block
  exits; works with any allocator and on CPU); (b) when spillway is installed, whenever an
  allocation does not fit the budget: the allocator calls the manager, which evicts until the
  request fits or nothing evictable is left.
- Host memory: `max_spilled` caps the bytes spilled copies hold, and those kept by activations
  restored ahead (which go first when a spill needs the room). A spill over it, or one whose
  host buffer cannot be allocated, is not made and nothing is lost: the activation is dropped
  instead when its checkpoint segment can recompute it, else it stays and the next is tried.
- Victims: policy "dtr" (smallest restore cost / (bytes x staleness)), "lru", or "largest".
- Thread-safe (autograd runs backward on its own threads): the manager's lock is taken with the
  GIL released.
- Statistics: stats() per manager; spillway.stats() sums every manager's under "activations.".
"""

import contextlib
import threading
import time

import torch
from torch.utils import _pytree

from . import _C

_default_policy = "dtr"
_active = threading.local()  # .stack: (manager, its hooks) entered on this thread, innermost last
# Segment replays on this thread: .depth, how many are running; .keep, the innermost one's
# keep(module) for running statistics (_running_stats_kept).
_replaying = threading.local()


def _set_default_policy(name):
    global _default_policy
    # dtr-frag needs the allocator's free-range map per block, which a storage-level manager does
    # not have; its choice among activations is plain DTR.
    name = "dtr" if name == "dtr-frag" else name
    _C.check_activation_policy(name)  # ValueError naming a bad policy
    _default_policy = name


def _totals():
    return _C.activation_totals()


def _batch_norms(fn):
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        return []
    return [m for m in owner.modules() if _updates_running_stats(m)]


def _updates_running_stats(m):
    # BatchNorm's and InstanceNorm's (both _NormBase) when they track running statistics.
    return isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats


# One global forward pre-hook serves every replay, there while at least one runs: registered and
# removed under a lock, as torch numbers its hook handles without one (two replays on two device
# threads could otherwise get one id, and one's removal take the other's hook away).
_stats_hook_lock = threading.Lock()
_stats_hook_users = 0
_stats_hook_handle = None


def _keep_stats_before_forward(module, args):
    keep = getattr(_replaying, "keep", None)
    if keep is not None and _updates_running_stats(module):
        keep(module)


@contextlib.contextmanager
def _running_stats_kept(modules):
    """Normalisation running statistics are not updated a second time by a replay. Those of
    `modules` (fn's own, which a replay may run without a module call: fn is a BatchNorm's bound
    forward) are saved up front; those of every other such module the replay calls on this thread
    (one reached through a lambda, a closure or functools.partial) when it is first called, by a
    global forward pre-hook that is there only while replays run and sees the modules of the
    replay on its own thread. What is saved is the statistics tensors a module holds at that
    moment (those swapped in by torch.func.functional_call, say), and those are put back when the
    replay ends, also when it fails or stops early. Running statistics that fn updates by calling
    torch.nn.functional.batch_norm itself are not seen."""
    global _stats_hook_users, _stats_hook_handle
    kept = {}

    def keep(m):
        for b in (m.running_mean, m.running_var, m.num_batches_tracked):
            if b is not None and id(b) not in kept:
                kept[id(b)] = (b, b.detach().clone())

    for m in modules:
        keep(m)
    outer = getattr(_replaying, "keep", None)  # a replay inside a replay: the inner one's
    _replaying.keep = keep
    try:
        with _stats_hook_lock:
            if _stats_hook_users == 0:
                _stats_hook_handle = torch.nn.modules.module.register_module_forward_pre_hook(
                    _keep_stats_before_forward)
            _stats_hook_users += 1
        try:
            yield
        finally:
            with _stats_hook_lock:
                _stats_hook_users -= 1
                if _stats_hook_users == 0:
                    _stats_hook_handle.remove()
                    _stats_hook_handle = None
    finally:
        _replaying.keep = outer
        with torch.no_grad():
            for live, old in kept.values():
                live.copy_(old)


def _autocast_state():
    """The autocast state a segment runs under (per device type, and the cache): its replay, run
    by backward outside the autocast block, must cast as the first run did, or it computes other
    bytes (another dtype: a size mismatch; the same size: silently different values)."""
    return ([(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")],
            torch.is_autocast_cache_enabled())


@contextlib.contextmanager
def _autocast_as(state):
    """Runs its body under `state` (_autocast_state), as torch.autocast blocks would."""
    kinds, cache = state
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in kinds:
            if enabled or torch.is_autocast_enabled(device):  # no CUDA needed to leave it off
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                   cache_enabled=cache))
        yield


def _size_argument(name, value):
    """Bytes (or None) from an argument of activations(); ValueError names it and its value."""
    from . import _size_or_none
    try:
        return _size_or_none(value)
    except ValueError as e:
        raise ValueError(f"spillway.activations: {name} {value!r} is invalid: {e}") from None


def _take_hooks_off(stack, at):
    """Takes stack[at]'s saved-tensor hooks off torch's stack of them, and the entry off `stack`.

    torch's hooks are a stack whose exit pops the top, whoever pushed it. A manager exited before
    managers entered after it (not with `with`, which nests) takes their hooks off first and puts
    them back after its own, so every manager still entered keeps its hooks on. Hooks that are
    not a spillway manager's above its own (saved_tensors_hooks entered after it and still on)
    are refused with an error, and nothing changes."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    taken = []
    try:
        for i in range(len(stack) - 1, at - 1, -1):
            hooks = stack[i][1]
            current = top(False)
            if current is None or current[0] != hooks.pack_hook:
                raise RuntimeError(
                    "spillway.activations: exited while saved-tensor hooks entered after it are "
                    f"still on (the top of torch's stack is {current!r}, not this manager's): "
                    "exit those first")
            hooks.__exit__(None, None, None)
            taken.append(hooks)
    except BaseException:
        for hooks in reversed(taken):
            hooks.__enter__()
        raise
    del stack[at]
    for hooks in reversed(taken[:-1]):  # the managers entered after it, outermost first
        hooks.__enter__()


class ActivationManager:
    """The saved activations of one `activations()` block (see the module docstring)."""

    def __init__(self, max_resident=None, mode="hybrid", policy=None, prefetch=2,
                 min_bytes=1 << 16, link_bandwidth=None, max_spilled=None):
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"spillway.activations: prefetch {prefetch!r} is invalid: expected an "
                             "int >= 0")
        smallest = _size_argument("min_bytes", min_bytes)
        if smallest is None:
            raise ValueError("spillway.activations: min_bytes None is invalid: expected bytes >= 0 "
                             "or a size string like '64KiB'")
        if link_bandwidth is not None and (isinstance(link_bandwidth, bool) or
                                           not isinstance(link_bandwidth, (int, float))):
            raise ValueError(f"spillway.activations: link_bandwidth {link_bandwidth!r} is invalid: "
                             "expected bytes per second > 0, or None to measure it")
        self._m = _C.ActivationManager(_size_argument("max_resident", max_resident), mode,
                                       policy or _default_policy, prefetch, smallest,
                                       None if link_bandwidth is None else float(link_bandwidth),
                                       _size_argument("max_spilled", max_spilled))

    def stats(self):
        return self._m.stats()

    def state_of(self, tensor):
        """"resident", "spilled" or "dropped" for the entry of `tensor`'s storage, or None."""
        return self._m.state_of(tensor)

    def evict(self, nbytes):
        """Evicts up to `nbytes` now; returns (freed, pinned)."""
        return self._m.evict(nbytes)

    def close(self):
        """Stops answering the allocator's pressure. Saved activations stay usable."""
        self._m.close()

    # --- saved-tensor hooks -------------------------------------------------------------------

    def pack(self, tensor):
        handle = self._m.pack(tensor)
        # Kept as it is, detached: a saved output comes to the hook with its grad_fn, and the
        # graph would hold itself through the tensor (a reference cycle no collector can see).
        return tensor.detach() if handle is None else handle

    def unpack(self, handle):
        return handle if isinstance(handle, torch.Tensor) else self._m.unpack(handle)

    def __enter__(self):
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()  # may refuse (saved-tensor hooks disabled): then nothing has changed
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append((self, hooks))  # one entry per entering: a manager may be entered twice
        return self

    def __exit__(self, *exc):
        stack = _active.stack
        # This manager's innermost entry, wherever it is: managers exited out of order leave the
        # others' entries in place.
        at = max(i for i, (m, _) in enumerate(stack) if m is self)
        _take_hooks_off(stack, at)  # refused: still entered, nothing changed
        self._m.end_scope()  # what the last packs could not evict yet; the last segment goes
        return False

    # --- checkpoint segments ------------------------------------------------------------------

    def run_segment(self, fn, args, kwargs):
        # Every tensor argument, in kwargs and inside tuples, lists and dicts too, is the
        # manager's to hold (evictable like saved activations, checked for in-place changes,
        # and handed back resident to the replay): the replay must not keep them alive itself.
        flat, spec = _pytree.tree_flatten((args, kwargs))
        devices = sorted({a.device.index or 0 for a in flat
                          if isinstance(a, torch.Tensor) and a.is_cuda})
        at = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        grads = [flat[i].requires_grad for i in at]
        others = [None if isinstance(a, torch.Tensor) else a for a in flat]
        autocast = _autocast_state()

        def replay(resident, stop_after):
            # stop_after: nothing after that many saves is wanted (None: all, and the outputs);
            # the record hook then stops the run, as torch.utils.checkpoint's early stop does.
            # However the run ends after that (the stop's exception, wrapped by TorchScript's
            # interpreter or caught by the segment's own code, or a normal return), it is a stop:
            # the saves up to it are given back, never what ran after.
            recorded = []
            stop = []  # set once the stop is raised

            replay_thread = threading.get_ident()

            def record(t):
                if stop:
                    raise _ReplayStopped  # the first one was caught: stop again
                if threading.get_ident() != replay_thread:
                    # A save on another thread that runs with the replay's hooks: the device
                    # thread of a backward the segment runs itself (a gradient penalty on CUDA).
                    # The first run's saves there were not the segment's (segments are per
                    # thread), so they are not recorded here either: a recorded save is matched
                    # to the segment's entries by position.
                    return (t,)
                recorded.append(t.detach())
                if len(recorded) == stop_after:
                    stop.append(True)
                    raise _ReplayStopped
                return len(recorded) - 1

            def unpack(i):  # a backward the segment runs itself (a gradient penalty)
                return i[0] if isinstance(i, tuple) else recorded[i]

            leaves = list(others)
            for i, t, g in zip(at, resident, grads):
                leaves[i] = t.detach().requires_grad_(g)
            del resident
            replay_args, replay_kwargs = _pytree.tree_unflatten(leaves, spec)
            del leaves
            _replaying.depth = getattr(_replaying, "depth", 0) + 1  # checkpoint() inside runs fn
            try:
                with _running_stats_kept(_batch_norms(fn)), _autocast_as(autocast), \
                        torch.autograd.graph.saved_tensors_hooks(record, unpack), \
                        torch.enable_grad():
                    out = [t.detach() for t in _tensors_of(fn(*replay_args, **replay_kwargs))]
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:
                if not stop:
                    raise
            finally:
                _replaying.depth -= 1
            if stop:  # nothing is recorded after the stop
                return recorded, [], True
            return recorded, out, False  # the outputs without the replay's graph

        self._m.begin_segment(replay, devices, [flat[i] for i in at])
        del flat
        start = time.perf_counter()
        # Its outputs, so that the next segment's input (or a save after it) can be dropped and
        # recomputed by this one's replay. Whatever fails before end_segment (the run, or memory
        # for the list) ends the segment too: an open one would be every later save's lineage.
        try:
            out = fn(*args, **kwargs)
            outputs = _tensors_of(out)
        except BaseException:
            self._m.end_segment(time.perf_counter() - start)
            raise
        self._m.end_segment(time.perf_counter() - start, outputs)
        return out


class _ReplayStopped(BaseException):
    """Raised by a replay's record hook once it has what the manager asked for (a BaseException,
    so that a segment's `except Exception` does not take it for its own error)."""


def _tensors_of(out):
    """The tensors a segment returned, in order: the output itself, or those of a tuple or list."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def activations(max_resident=None, mode="hybrid", policy=None, prefetch=2, min_bytes=1 << 16,
                link_bandwidth=None, max_spilled=None):
    """A context manager: activations saved for backward inside it are evictable (module docstring).

    max_resident: bytes (or "512MiB") of evictable saved activations kept resident; None: evict only under
    the installed allocator's budget. mode: "hybrid", "spill" or "drop". policy: "dtr", "lru",
    "largest" (default: spillway.install's). prefetch: at most this many spilled activations
    copied back ahead of use (the depth adapts below it).
    min_bytes: bytes (or "64KiB"); smaller tensors are saved as they are. link_bandwidth: host link bytes per second for
    the spill-or-recompute choice; None: measured per device, each way, from the copies of every
    manager in the process (25e9 until the first; stats: spill_bytes_per_s, restore_bytes_per_s).
    max_spilled: bytes (or "4GiB") of host memory (pinned, for CUDA)
    spilled copies, and those kept by activations restored ahead, may hold; None: no cap. A spill over it, or one whose host buffer cannot be
    allocated, is not made: the activation is dropped instead when a checkpoint segment can
    recompute it, else kept and the next one tried. Returns the ActivationManager."""
    return ActivationManager(max_resident, mode, policy, prefetch, min_bytes, link_bandwidth,
                             max_spilled)


def _current_manager():
    stack = getattr(_active, "stack", None)
    return stack[-1][0] if stack else None


def checkpoint(fn, *args, **kwargs):
    """Runs fn(*args, **kwargs) recording it as lineage: its saved activations may be dropped under
    pressure and are recomputed on unpack (torch.utils.checkpoint, by contrast, always recomputes).
    Every tensor in args and kwargs (inside tuples, lists and dicts too) is an input of the
    segment, held and checked for in-place changes; a replay runs under the autocast state the
    first run had, and keeps the running statistics of the BatchNorm and InstanceNorm modules it
    runs (fn's own, and any module it calls however it reaches it, the tensors they hold then;
    not those torch.nn.functional.batch_norm updates).
    Inside spillway.activations() it uses that manager; outside, it behaves like fn."""
    manager = _current_manager()
    # Inside a replay it is fn too: the replay records what fn saves, and a segment opened by it
    # would hold its inputs as entries for nothing.
    if manager is None or getattr(_replaying, "depth", 0):
        return fn(*args, **kwargs)
    return manager.run_segment(fn, args, kwargs)


def _parts(children, segments, who):
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"spillway.{who}: segments {segments!r} is invalid: expected an int >= 1")
    per = max(1, -(-len(children) // segments))
    return [torch.nn.Sequential(*children[i:i + per]) for i in range(0, len(children), per)]


def checkpoint_sequential(module, segments, input):
    """Runs an nn.Sequential (or a list of modules) as `segments` spillway.checkpoint segments."""
    children = list(module.children()) if isinstance(module, torch.nn.Sequential) else list(module)
    x = input
    for part in _parts(children, segments, "checkpoint_sequential"):
        x = checkpoint(part, x)
    return x


class Sequential(torch.nn.Module):
    """nn.Sequential whose forward runs as `segments` spillway.checkpoint segments."""

    def __init__(self, sequential, segments):
        super().__init__()
        self.body = sequential
        self.segments = segments
        self._segment_modules = _parts(list(sequential.children()), segments, "Sequential")

    def forward(self, x):
        for part in self._segment_modules:
            x = checkpoint(part, x)
        return x

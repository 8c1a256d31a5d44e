"""Activations saved for backward, evicted under memory pressure and made resident again on use.

    with spillway.activations():                        # every saved activation is evictable
        y = spillway.checkpoint(block, x)               # ... and this block's can be recomputed
        loss = head(y).sum()
    loss.backward()

Contract
- Within `activations()`, saved-tensor hooks register every tensor autograd saves for backward, by
  *storage*: views and aliases of one storage share one entry. A storage is evictable only when
  nothing but autograd's saved tensors holds it (torch's storage use count equals the number of
  aliases spillway holds), so a tensor the program still uses is never touched.
- Eviction frees a storage's memory and keeps the storage (resize_ to 0): every view of it stays
  valid and sees the bytes again once restored. It either spills (copies the bytes to host memory,
  pinned for CUDA, on a copy stream, and frees the device memory in stream order after the copy) or
  drops (frees it; only for activations of a spillway.checkpoint segment, whose lineage is the
  segment). The choice is per storage, by cost: the segment's measured forward time against
  2 x bytes / the host-link bandwidth. Modes "spill" and "drop" force one kind.
- Unpack (backward) makes the storage resident: a spilled one is copied back (the compute stream
  waits for the copy); a dropped one is recomputed by re-running its segment with the RNG state
  (CPU and CUDA) of the original forward, BatchNorm running statistics left as they were, and every
  dropped storage of the segment restored from the recomputation, matched by the order in which the
  segment saved them. Bytes are identical to the original when the segment is deterministic.
- After each unpack, the next `prefetch` spilled storages in backward order (reverse pack order)
  start copying back, so that copies overlap compute.
- When eviction happens: (a) whenever the resident bytes of saved activations exceed
  `max_resident` (checked at every pack and unpack and when the block exits; works with any
  allocator and on CPU); (b) when spillway is
  installed, whenever an allocation does not fit the budget: the allocator calls the manager, which
  evicts until the request fits or nothing evictable is left.
- Victims: policy "dtr" (smallest restore cost / (bytes x staleness)), "lru", or "largest".
- Thread-safe (autograd runs backward on its own threads): one re-entrant lock per manager.
- Statistics: stats() per manager; spillway.stats() sums every manager's under "activations.".
"""

import bisect
import contextlib
import itertools
import threading
import time
import weakref

import torch

from . import _C

RESIDENT, SPILLED, DROPPED = "resident", "spilled", "dropped"
POLICIES = ("dtr", "lru", "largest")
MODES = ("hybrid", "spill", "drop")

_default_policy = "dtr"
_managers = weakref.WeakSet()
_totals_retired = {}
_active = threading.local()  # .stack: managers entered on this thread


def _set_default_policy(name):
    global _default_policy
    # dtr-frag needs the allocator's free-range map per block, which a storage-level manager does
    # not have; its choice among activations is plain DTR.
    name = "dtr" if name == "dtr-frag" else name
    if name not in POLICIES:
        raise ValueError(f"spillway: eviction policy {name!r} is not one the activations manager "
                         f"implements: expected one of {', '.join(POLICIES)}")
    _default_policy = name


def _totals():
    out = dict(_totals_retired)
    for m in list(_managers):
        for k, v in m.stats().items():
            out[k] = out.get(k, 0) + v
    return out


def _use_count(storage):
    # torch counts the temporary Python storage object `untyped_storage()` returned, once.
    return torch._C._storage_Use_Count(storage._cdata) - 1


class _Entry:
    """One storage saved for backward."""

    __slots__ = ("key", "storage", "nbytes", "device", "aliases", "handles", "state", "host",
                 "event", "segment", "seq", "last_use", "pins")

    def __init__(self, key, storage, device, seq, now):
        self.key = key
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.device = device
        self.aliases = 0      # detached aliases spillway holds (one per _Saved)
        self.handles = 0
        self.state = RESIDENT
        self.host = None      # spilled bytes
        self.event = None     # CUDA: the copy that the next user waits for
        self.segment = None   # the checkpoint segment that made it, if any
        self.seq = seq        # pack order: backward unpacks in roughly the reverse order
        self.last_use = now
        self.pins = 0         # > 0 while a recomputation needs it resident


class _Saved:
    """What autograd keeps instead of the tensor: an alias of the storage, and its entry."""

    __slots__ = ("manager", "entry", "tensor", "__weakref__")

    def __init__(self, manager, entry, tensor):
        self.manager = manager
        self.entry = entry
        self.tensor = tensor

    def __del__(self):
        try:
            self.manager._release(self)
        except Exception:  # interpreter shutdown
            pass


class _Segment:
    """A spillway.checkpoint call: the lineage of the activations it saved."""

    def __init__(self, fn, args, kwargs):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.saved = []        # entry keys in the order the forward saved them
        self.cost_s = 0.0      # measured forward time
        self.cuda_devices = sorted({a.device.index or 0 for a in args
                                    if isinstance(a, torch.Tensor) and a.is_cuda})
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        self.start_event = None
        self.end_event = None


def _batch_norms(fn):
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        return []
    return [m for m in owner.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@contextlib.contextmanager
def _running_stats_kept(modules):
    """BatchNorm running statistics are not updated a second time by a recomputation."""
    kept = [(m, [b.detach().clone() if b is not None else None
                 for b in (m.running_mean, m.running_var, m.num_batches_tracked)]) for m in modules]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (mean, var, count) in kept:
                for live, old in ((m.running_mean, mean), (m.running_var, var),
                                  (m.num_batches_tracked, count)):
                    if live is not None:
                        live.copy_(old)


class ActivationManager:
    """The registry of saved activations of one `activations()` block (see the module docstring)."""

    def __init__(self, max_resident=None, mode="hybrid", policy=None, prefetch=2,
                 min_bytes=1 << 16, link_bandwidth=25e9):
        from . import parse_size
        if mode not in MODES:
            raise ValueError(f"spillway.activations: mode {mode!r} is invalid: expected one of "
                             f"{', '.join(MODES)}")
        policy = policy or _default_policy
        if policy not in POLICIES:
            raise ValueError(f"spillway.activations: policy {policy!r} is invalid: expected one of "
                             f"{', '.join(POLICIES)}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"spillway.activations: prefetch {prefetch!r} is invalid: expected an "
                             "int >= 0")
        if not link_bandwidth or link_bandwidth <= 0:
            raise ValueError(f"spillway.activations: link_bandwidth {link_bandwidth!r} is invalid: "
                             "expected bytes per second > 0")
        self.max_resident = parse_size(max_resident)
        self.mode = mode
        self.policy = policy
        self.prefetch = prefetch
        self.min_bytes = min_bytes
        self.link_bandwidth = float(link_bandwidth)
        self._lock = threading.RLock()
        self._entries = {}
        self._spilled = []     # sorted seqs of spilled entries, for prefetch
        self._by_seq = {}
        self._seq = itertools.count()
        self._segments = []    # open checkpoint segments on this manager (innermost last)
        self._resident_bytes = 0
        self._streams = {}     # device index -> (d2h, h2d) copy streams
        self._callback_id = None
        self._stats = dict(packed=0, evictions=0, spills=0, drops=0, restores=0, recomputes=0,
                           bytes_spilled=0, bytes_dropped=0, bytes_restored=0, prefetches=0)
        _managers.add(self)

    # --- statistics ---------------------------------------------------------------------------

    def stats(self):
        with self._lock:
            out = dict(self._stats)
            out["registered"] = len(self._entries)
            out["resident_bytes"] = self._resident_bytes
            out["spilled_bytes"] = sum(e.nbytes for e in list(self._entries.values()) if e.state == SPILLED)
            out["dropped_bytes"] = sum(e.nbytes for e in list(self._entries.values()) if e.state == DROPPED)
            return out

    def state_of(self, tensor):
        """The state of the entry holding `tensor`'s storage (for tests and debugging), or None."""
        with self._lock:
            entry = self._entries.get(tensor.untyped_storage()._cdata)
            return None if entry is None else entry.state

    # --- saved-tensor hooks -------------------------------------------------------------------

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        with self._lock:
            if storage.nbytes() < self.min_bytes or tensor.device.type not in ("cuda", "cpu"):
                self._note_saved(None)
                return tensor  # saved as it is
            key = storage._cdata
            entry = self._entries.get(key)
            if entry is None:
                seq = next(self._seq)
                entry = _Entry(key, storage, tensor.device, seq, time.perf_counter())
                self._entries[key] = entry
                self._by_seq[seq] = entry
                self._resident_bytes += entry.nbytes
                if self._segments:
                    entry.segment = self._segments[-1]
            self._note_saved(key)
            handle = _Saved(self, entry, tensor.detach())
            entry.aliases += 1
            entry.handles += 1
            self._stats["packed"] += 1
            self._enforce_max_resident()
            return handle

    def _enforce_max_resident(self):
        if self.max_resident is not None and self._resident_bytes > self.max_resident:
            self._evict_bytes(self._resident_bytes - self.max_resident)

    def _note_saved(self, key):
        # Every open segment lists everything saved while it ran, in order (nested segments
        # included): a recomputation saves the same tensors in the same order.
        for segment in self._segments:
            segment.saved.append(key)

    def unpack(self, handle):
        if not isinstance(handle, _Saved):
            return handle  # small tensors are saved as they are
        with self._lock:
            entry = handle.entry
            self._make_resident(entry)
            entry.last_use = time.perf_counter()
            self._prefetch_before(entry.seq)
            if entry.event is not None:  # a copy back (prefetched or not) still in flight
                torch.cuda.current_stream(entry.device).wait_event(entry.event)
                entry.event = None
            # A fresh alias: while autograd uses it, the storage's use count exceeds spillway's
            # aliases, so the storage cannot be evicted under the running backward node.
            used = handle.tensor.detach()
            self._enforce_max_resident()
            return used

    # Iterations over the entries take a copy: a _Saved dropped by the garbage collector in the
    # middle of one (on this thread, under the re-entrant lock) forgets its entry.

    def _release(self, handle):
        with self._lock:
            entry = handle.entry
            entry.handles -= 1
            entry.aliases -= 1
            handle.tensor = None
            if entry.handles == 0:
                self._forget(entry)

    def _forget(self, entry):
        if self._entries.pop(entry.key, None) is None:
            return
        self._by_seq.pop(entry.seq, None)
        if entry.state == RESIDENT:
            self._resident_bytes -= entry.nbytes
        if entry.state == SPILLED:
            self._unspill_index(entry)
        entry.host = None
        entry.storage = None

    # --- eviction -----------------------------------------------------------------------------

    def _evictable(self, entry):
        return (entry.state == RESIDENT and entry.pins == 0 and entry.storage is not None
                and entry.event is None and entry.storage.resizable()
                and _use_count(entry.storage) == entry.aliases
                and (self.mode != "drop" or entry.segment is not None))

    def _restore_cost_s(self, entry):
        transfer = 2.0 * entry.nbytes / self.link_bandwidth
        if entry.segment is None or self.mode == "spill":
            return transfer, "spill"
        if self.mode == "drop":
            return entry.segment.cost_s, "drop"
        recompute = self._segment_cost(entry.segment)
        return (recompute, "drop") if recompute <= transfer else (transfer, "spill")

    def _segment_cost(self, segment):
        if segment.end_event is not None and segment.end_event.query():
            segment.cost_s = segment.start_event.elapsed_time(segment.end_event) / 1e3
            segment.start_event = segment.end_event = None
        return segment.cost_s

    def _choose(self, candidates, now):
        if self.policy == "lru":
            return min(candidates, key=lambda e: e.last_use)
        if self.policy == "largest":
            return max(candidates, key=lambda e: e.nbytes)
        # DTR: h = cost / (size x staleness); a tiny floor keeps free-to-restore victims ordered.
        return min(candidates, key=lambda e: (self._restore_cost_s(e)[0] + 1e-9)
                   / (e.nbytes * max(now - e.last_use, 1e-6)))

    def _evict_bytes(self, wanted, device=None):
        """Evicts until `wanted` bytes are freed or nothing evictable is left; returns (freed, pinned)."""
        freed = 0
        now = time.perf_counter()
        candidates = [e for e in list(self._entries.values())
                      if (device is None or (e.device.index or 0) == device) and self._evictable(e)]
        while freed < wanted and candidates:
            victim = self._choose(candidates, now)
            candidates.remove(victim)
            freed += self._evict(victim)
        pinned = sum(e.nbytes for e in list(self._entries.values())
                     if e.state == RESIDENT and not self._evictable(e))
        return freed, pinned

    def _evict(self, entry):
        _, how = self._restore_cost_s(entry)
        storage = entry.storage
        if how == "spill":
            entry.host, entry.event = self._copy_out(entry)
            bisect.insort(self._spilled, entry.seq)
            entry.state = SPILLED
            self._stats["spills"] += 1
            self._stats["bytes_spilled"] += entry.nbytes
        else:
            entry.state = DROPPED
            self._stats["drops"] += 1
            self._stats["bytes_dropped"] += entry.nbytes
        storage.resize_(0)  # frees the memory; on CUDA in stream order after the copy (record_stream)
        self._resident_bytes -= entry.nbytes
        self._stats["evictions"] += 1
        return entry.nbytes

    def _copy_streams(self, device):
        index = device.index or 0
        if index not in self._streams:
            self._streams[index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[index]

    def _byte_view(self, entry):
        return torch.empty(0, dtype=torch.uint8, device=entry.device).set_(entry.storage)

    def _copy_out(self, entry):
        source = self._byte_view(entry)
        if entry.device.type != "cuda":
            return source.clone(), None
        d2h, _ = self._copy_streams(entry.device)
        host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
        d2h.wait_stream(torch.cuda.current_stream(entry.device))
        with torch.cuda.stream(d2h):
            host.copy_(source, non_blocking=True)
        source.record_stream(d2h)  # the block is not reused before the copy has read it
        event = torch.cuda.Event()
        event.record(d2h)
        return host, event

    # --- restore ------------------------------------------------------------------------------

    def _make_resident(self, entry):
        if entry.state == SPILLED:
            self._copy_in(entry)
        elif entry.state == DROPPED:
            self._recompute(entry.segment)
            if entry.state != RESIDENT:
                raise RuntimeError("spillway: recomputing a checkpoint segment did not restore an "
                                   f"activation of {entry.nbytes} bytes (the segment saved fewer "
                                   "tensors the second time: is it deterministic?)")

    def _unspill_index(self, entry):
        i = bisect.bisect_left(self._spilled, entry.seq)
        if i < len(self._spilled) and self._spilled[i] == entry.seq:
            del self._spilled[i]

    def _copy_in(self, entry):
        entry.storage.resize_(entry.nbytes)
        target = self._byte_view(entry)
        if entry.device.type == "cuda":
            _, h2d = self._copy_streams(entry.device)
            if entry.event is not None:
                h2d.wait_event(entry.event)  # the spill's copy has completed
            h2d.wait_stream(torch.cuda.current_stream(entry.device))  # the new block is ready
            with torch.cuda.stream(h2d):
                target.copy_(entry.host, non_blocking=True)  # the pinned buffer is kept until done
            target.record_stream(h2d)
            entry.event = torch.cuda.Event()
            entry.event.record(h2d)  # unpack makes the compute stream wait for it
        else:
            target.copy_(entry.host)
        entry.host = None
        entry.state = RESIDENT
        self._unspill_index(entry)
        self._resident_bytes += entry.nbytes
        self._stats["restores"] += 1
        self._stats["bytes_restored"] += entry.nbytes

    def _prefetch_before(self, seq):
        earlier = self._spilled[:bisect.bisect_left(self._spilled, seq)]
        for s in earlier[::-1][:self.prefetch]:
            self._copy_in(self._by_seq[s])
            self._stats["prefetches"] += 1

    def _recompute(self, segment):
        """Re-runs `segment` and restores every dropped storage it saved, matched by save order."""
        keys = list(segment.saved)
        entries = [self._entries.get(k) for k in keys]
        for e in entries:
            if e is not None:
                e.pins += 1
        try:
            recorded = []

            def record(t):
                recorded.append(t.detach())
                return None

            args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                    for a in segment.args]
            with torch.random.fork_rng(devices=segment.cuda_devices), \
                    _running_stats_kept(_batch_norms(segment.fn)), \
                    torch.autograd.graph.saved_tensors_hooks(record, lambda _: None), \
                    torch.enable_grad():
                torch.set_rng_state(segment.cpu_rng)
                for d, state in zip(segment.cuda_devices, segment.cuda_rng):
                    torch.cuda.set_rng_state(state, d)
                segment.fn(*args, **segment.kwargs)
            done = set()
            for key, entry, fresh in zip(keys, entries, recorded):
                if entry is None or entry.state != DROPPED or key in done:
                    continue
                source = fresh.untyped_storage()
                if source.nbytes() != entry.nbytes:
                    raise RuntimeError(
                        f"spillway: recomputing a checkpoint segment gave a storage of "
                        f"{source.nbytes()} bytes where the original had {entry.nbytes}: the "
                        "segment is not deterministic in its shapes")
                entry.storage.resize_(entry.nbytes)
                entry.storage.copy_(source)
                entry.state = RESIDENT
                self._resident_bytes += entry.nbytes
                done.add(key)
            self._stats["recomputes"] += 1
        finally:
            for e in entries:
                if e is not None:
                    e.pins -= 1

    # --- checkpoint segments ------------------------------------------------------------------

    def run_segment(self, fn, args, kwargs):
        segment = _Segment(fn, args, kwargs)
        timed_on_cuda = bool(segment.cuda_devices)
        if timed_on_cuda:
            segment.start_event = torch.cuda.Event(enable_timing=True)
            segment.end_event = torch.cuda.Event(enable_timing=True)
            segment.start_event.record()
        start = time.perf_counter()
        self._segments.append(segment)
        try:
            out = fn(*args, **kwargs)
        finally:
            self._segments.pop()
        segment.cost_s = time.perf_counter() - start
        if timed_on_cuda:
            segment.end_event.record()
        return out

    # --- entering -----------------------------------------------------------------------------

    def __enter__(self):
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        if _C.is_installed() and self._callback_id is None:
            self._callback_id = _C.add_pressure_callback(self._on_pressure)
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        _active.stack.pop()
        with self._lock:
            self._enforce_max_resident()  # what the last packs could not evict yet
        # The pressure callback stays until the manager is closed: backward, after the block,
        # still has activations to evict and restore.
        return False

    def close(self):
        """Stops answering allocator pressure. Saved activations stay usable."""
        if self._callback_id is not None:
            _C.remove_pressure_callback(self._callback_id)
            self._callback_id = None

    def __del__(self):
        try:
            self.close()
            for k, v in self.stats().items():
                if k in self._stats:
                    _totals_retired[k] = _totals_retired.get(k, 0) + v
        except Exception:
            pass

    def _on_pressure(self, device, wanted, shortfall):
        # Called by the allocator, with the GIL. Another thread that holds the lock may be waiting
        # for the GIL: waiting for the lock here would deadlock, so a busy manager frees nothing
        # this time (the allocator then tries its other steps).
        if not self._lock.acquire(blocking=False):
            return 0, 0
        try:
            return self._evict_bytes(max(wanted, shortfall, 1), device)
        finally:
            self._lock.release()


def activations(max_resident=None, mode="hybrid", policy=None, prefetch=2, min_bytes=1 << 16,
                link_bandwidth=25e9):
    """A context manager: activations saved for backward inside it are evictable (module docstring).

    max_resident: bytes (or "512MiB") of evictable activations kept resident; None: evict only under
    the installed allocator's budget. mode: "hybrid", "spill" or "drop". policy: "dtr", "lru",
    "largest" (default: spillway.install's). prefetch: spilled activations copied back ahead of use.
    min_bytes: smaller tensors are saved as they are. link_bandwidth: host link bytes per second for
    the spill-or-recompute choice. Returns the ActivationManager."""
    return ActivationManager(max_resident, mode, policy, prefetch, min_bytes, link_bandwidth)


def _current_manager():
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def checkpoint(fn, *args, **kwargs):
    """Runs fn(*args, **kwargs) recording it as lineage: its saved activations may be dropped under
    pressure and are recomputed on unpack (torch.utils.checkpoint, by contrast, always recomputes).
    Inside spillway.activations() it uses that manager; outside, it behaves like fn."""
    manager = _current_manager()
    if manager is None:
        return fn(*args, **kwargs)
    return manager.run_segment(fn, args, kwargs)


def checkpoint_sequential(module, segments, input):
    """Runs an nn.Sequential as `segments` spillway.checkpoint segments."""
    children = list(module.children()) if isinstance(module, torch.nn.Sequential) else list(module)
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"spillway.checkpoint_sequential: segments {segments!r} is invalid: "
                         "expected an int >= 1")
    per = max(1, -(-len(children) // segments))
    x = input
    for start in range(0, len(children), per):
        x = checkpoint(torch.nn.Sequential(*children[start:start + per]), x)
    return x


class Sequential(torch.nn.Module):
    """nn.Sequential whose forward runs as `segments` spillway.checkpoint segments."""

    def __init__(self, sequential, segments):
        super().__init__()
        if not isinstance(segments, int) or segments < 1:
            raise ValueError(f"spillway.Sequential: segments {segments!r} is invalid: expected an "
                             "int >= 1")
        self.body = sequential
        self.segments = segments
        per = max(1, -(-len(sequential) // segments))
        children = list(sequential.children())
        self._parts = [torch.nn.Sequential(*children[i:i + per]) for i in range(0, len(children), per)]

    def forward(self, x):
        for part in self._parts:
            x = checkpoint(part, x)
        return x

#!/usr/bin/env python3
"""snapshot_to_trace: converts a PyTorch memory snapshot into a spillway alloc/free trace.

    bench/snapshot_to_trace.py SNAPSHOT.pickle -o OUT.trace.gz [--device N] [--capacity BYTES]
                               [--free-at completed|requested] [--source NAME]

The snapshot is what torch.cuda.memory._dump_snapshot() writes after
torch.cuda.memory._record_memory_history(max_entries=N): a pickled dict with 'segments' (the state at
the end) and 'device_traces' (per device, the last N allocator events). It holds only dicts, lists,
strings and numbers, so this script needs no torch: the standard pickle module reads it.

What it does (docs/trace_format.md, "From a PyTorch snapshot", has the reasoning):
- alloc events become allocs of their requested size; a block is freed at its free_completed event
  (default) or at its free_requested event (--free-at requested).
- Blocks allocated before the recorded window are seeded with allocs at t=0, in address order: every
  address freed in the window without an alloc before it (size from the free event), and every block
  live at the end (state active_allocated / active_pending_free in 'segments') whose alloc is not in
  the window (size: the block's requested_size).
- PyTorch's own peak reserved bytes over the window go into the header (torch_peak_reserved): the
  reserved bytes at the window's start are those at the end (the segments' total_size) minus the net
  of the window's segment_alloc / segment_free / segment_map / segment_unmap events; the peak is
  the running maximum from there.
- Streams (cudaStream_t values) become 0 (the default stream) and 1, 2, ... in order of first use;
  ids are the lowest free integer; times are nanoseconds since the window's first event (from
  'time_us'; snapshots without timestamps get 1 us per event).

Exit status: 0 on success, 2 on bad arguments or a snapshot that cannot be converted.
"""

import argparse
import gzip
import heapq
import os
import pickle
import re
import sys

FORMAT_HEADER = "# spillway-trace v1"
SEGMENT_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
KNOWN_ACTIONS = {"alloc", "free_requested", "free_completed", "snapshot", "oom"} | set(SEGMENT_DELTA)
LIVE_STATES = ("active_allocated", "active_pending_free")


class ConversionError(Exception):
    """The snapshot cannot be converted; the message says why."""


def _word(text):
    """A header value: one word (no white space)."""
    return re.sub(r"\s+", "_", str(text)) or "unknown"


def load_snapshot(path):
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot or "segments" not in snapshot:
        raise ConversionError(
            f"{path}: not a PyTorch memory snapshot (expected a dict with 'segments' and 'device_traces'; "
            "record one with torch.cuda.memory._record_memory_history() and _dump_snapshot())")
    return snapshot


def pick_device(snapshot, device):
    traces = snapshot["device_traces"]
    if device is None:
        # The device with the most events (device 0 when all are empty).
        device = max(range(len(traces)), key=lambda d: (len(traces[d]), -d)) if traces else 0
    if device < 0 or (traces and device >= len(traces)):
        raise ConversionError(f"--device {device}: the snapshot has traces for {len(traces)} device(s)")
    return device


def _live_blocks_at_end(snapshot, device):
    """(address, requested size, stream, reserved bytes) of the blocks live at the end, and the
    reserved bytes at the end."""
    blocks, reserved = [], 0
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        reserved += seg["total_size"]
        address = seg["address"]
        for block in seg.get("blocks", []):
            block_address = block.get("address", address)  # older snapshots have no block address
            if block.get("state") in LIVE_STATES:
                size = block.get("requested_size") or block["size"]
                blocks.append((block_address, size, seg.get("stream", 0)))
            address = block_address + block["size"]
    return blocks, reserved


def convert(snapshot, device=None, free_at="completed", capacity=0, source="pytorch"):
    """Returns (header: dict of key -> value in order, events: list of tuples, info: dict).

    Events are (t_ns, 'a', id, size, stream), (t_ns, 'f', id, stream)."""
    if free_at not in ("completed", "requested"):
        raise ConversionError(f"--free-at {free_at}: expected completed or requested")
    device = pick_device(snapshot, device)
    window = snapshot["device_traces"][device] if snapshot["device_traces"] else []
    free_action = "free_" + free_at
    have_times = bool(window) and all("time_us" in e for e in window)
    unknown = sorted({e.get("action") for e in window} - KNOWN_ACTIONS)

    # Pass 1: which addresses were live before the window (freed without an alloc before them), and
    # which allocs are still live at the end.
    live, seeds = {}, {}
    for e in window:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live[addr] = e
        elif action == free_action:
            if addr in live:
                del live[addr]
            elif addr not in seeds:
                seeds[addr] = (e["size"], e.get("stream", 0))
    end_blocks, reserved_end = _live_blocks_at_end(snapshot, device)
    for address, size, stream in end_blocks:
        if address not in live and address not in seeds:
            seeds[address] = (size, stream)

    # PyTorch's reserved bytes over the window.
    net = sum(SEGMENT_DELTA[e["action"]] * e["size"] for e in window if e.get("action") in SEGMENT_DELTA)
    reserved = reserved_start = reserved_end - net
    if reserved_start < 0:
        raise ConversionError(
            f"device {device}: the window's segment events reserve {net} bytes net, more than the "
            f"{reserved_end} bytes the snapshot's segments hold at the end; they do not belong together")
    peak_reserved = reserved

    # Pass 2: emit.
    streams = {0: 0}
    free_ids, next_id = [], 0
    ids = {}          # address -> (id, stream) of the live allocation there
    events = []
    extra_frees = 0

    def stream_of(s):
        return streams.setdefault(s, len(streams))

    def new_id():
        nonlocal next_id
        if free_ids:
            return heapq.heappop(free_ids)
        next_id += 1
        return next_id - 1

    def alloc(t, addr, size, stream):
        if size <= 0:
            raise ConversionError(f"an allocation of {size} bytes at address {addr:#x}")
        i, s = new_id(), stream_of(stream)
        ids[addr] = (i, s)
        events.append((t, "a", i, size, s))

    def free(t, addr):
        i, s = ids.pop(addr)
        heapq.heappush(free_ids, i)
        events.append((t, "f", i, s))

    for addr in sorted(seeds):
        alloc(0, addr, *seeds[addr])
    t0 = window[0]["time_us"] if have_times else 0
    last_t = 0
    ooms = 0
    for index, e in enumerate(window):
        action, addr = e.get("action"), e.get("addr")
        t = max(last_t, int((e["time_us"] - t0) * 1000) if have_times else index * 1000)
        last_t = t
        if action == "alloc":
            if addr in ids:  # its free fell between two recorded events: free it first
                free(t, addr)
                extra_frees += 1
            alloc(t, addr, e["size"], e.get("stream", 0))
        elif action == free_action:
            free(t, addr)
        elif action in SEGMENT_DELTA:
            reserved += SEGMENT_DELTA[action] * e["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif action == "oom":
            ooms += 1

    header = {
        "device_capacity": int(capacity),
        "source": _word(source),
        "torch_peak_reserved": peak_reserved,
        "torch_reserved_start": reserved_start,
        "torch_reserved_end": reserved_end,
        "torch_ooms": ooms,
        "free_at": free_at,
        "seeded": len(seeds),
        "device": device,
        "timestamps": "time_us" if have_times else "synthetic",
    }
    info = {"window_events": len(window), "seeded": len(seeds), "extra_frees": extra_frees,
            "unknown_actions": unknown, "streams": len(streams), "live_at_end": len(ids)}
    return header, events, info


def format_trace(header, events):
    parts = [FORMAT_HEADER] + [f"{k}={_word(v)}" for k, v in header.items()]
    lines = [" ".join(parts)]
    for e in events:
        lines.append(" ".join(str(x) for x in e))
    return "\n".join(lines) + "\n"


def write_trace(path, text):
    data = text.encode("ascii")
    if path == "-":
        sys.stdout.write(text)
    elif path.endswith(".gz"):
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(data)  # no name, no time stamp: the same trace gives the same bytes
    else:
        with open(path, "wb") as f:
            f.write(data)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="a pickle from torch.cuda.memory._dump_snapshot()")
    parser.add_argument("-o", "--output", required=True, help="OUT.trace.gz (gzip), OUT.trace (plain) or -")
    parser.add_argument("--device", type=int, default=None, help="device index (default: the one with most events)")
    parser.add_argument("--capacity", type=int, default=0,
                        help="the recording GPU's memory in bytes, for the header (default 0: unknown)")
    parser.add_argument("--free-at", choices=("completed", "requested"), default="completed",
                        help="free a block at its free_completed (default) or free_requested event")
    parser.add_argument("--source", default=None, help="the header's source (default: pytorch:<file name>)")
    args = parser.parse_args(argv)
    try:
        snapshot = load_snapshot(args.snapshot)
        source = args.source or "pytorch:" + os.path.basename(args.snapshot)
        header, events, info = convert(snapshot, args.device, args.free_at, args.capacity, source)
        write_trace(args.output, format_trace(header, events))
    except (ConversionError, OSError, pickle.UnpicklingError, KeyError, TypeError, ValueError) as e:
        print(f"snapshot_to_trace: {e.__class__.__name__ + ': ' if isinstance(e, KeyError) else ''}{e}",
              file=sys.stderr)
        return 2
    if info["unknown_actions"]:
        print(f"snapshot_to_trace: ignored unknown actions {info['unknown_actions']}", file=sys.stderr)
    if info["extra_frees"]:
        print(f"snapshot_to_trace: {info['extra_frees']} alloc(s) of a live address; freed first", file=sys.stderr)
    print(f"snapshot_to_trace: {args.snapshot} -> {args.output}: device {header['device']}, "
          f"{info['window_events']} snapshot events, {len(events)} trace events "
          f"({info['seeded']} seeded at t=0), {info['streams']} stream(s), "
          f"PyTorch peak reserved {header['torch_peak_reserved']} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

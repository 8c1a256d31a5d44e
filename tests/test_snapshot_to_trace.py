#!/usr/bin/env python3
"""test_snapshot_to_trace: bench/snapshot_to_trace.py on a synthetic PyTorch memory snapshot.

It proves, without torch: a pickled snapshot of plain dicts converts; a block freed in the window
without an alloc, and a block live at the end whose alloc fell before the window, are seeded at t=0
in address order; blocks are freed at free_completed (or free_requested with --free-at requested);
streams map to 0, 1, ...; ids are reused lowest first; times are nanoseconds from the first event;
PyTorch's peak reserved is computed from the reserved bytes at the window's start and the segment
events; snapshots without timestamps still convert; inconsistent snapshots are refused. When
SPILLWAY_REPLAY names the spillway-replay binary (CTest sets it), the converted trace is also read
and replayed by the C++ side and the PyTorch figures come back out of its --json report.
"""

import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import snapshot_to_trace as s2t  # noqa: E402

MiB = 1 << 20
A = 0x7F0000000000   # a 20 MiB segment with a block allocated before the window
B = 0x7F0010000000   # a 2 MiB segment reserved and used in the window, live at the end
D = 0x7F0020000000   # a 2 MiB segment on a side stream, used and released in the window
G = 0x7F0030000000   # a 30 MiB segment reserved and released in the window
X = 0x7F0040000000   # a block allocated before the window, freed in it
SIDE = 0x55AA00      # a cudaStream_t


def ev(action, addr, size, stream=0, t=None):
    e = {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}
    if t is not None:
        e["time_us"] = t
    return e


def make_snapshot(times=True):
    def T(t):
        return t if times else None
    trace = [
        ev("free_requested", X, MiB, 0, T(100)),
        ev("free_completed", X, MiB, 0, T(100)),
        ev("segment_free", X, 20 * MiB, 0, T(110)),
        ev("segment_alloc", B, 2 * MiB, 0, T(120)),
        ev("alloc", B, 500, 0, T(130)),
        ev("segment_alloc", D, 2 * MiB, SIDE, T(135)),
        ev("alloc", D, 1000, SIDE, T(140)),
        ev("free_requested", D, 1000, SIDE, T(150)),       # used on another stream: completes later
        ev("segment_alloc", G, 30 * MiB, 0, T(160)),
        ev("alloc", G, 25 * MiB, 0, T(165)),
        ev("free_requested", G, 25 * MiB, 0, T(168)),
        ev("free_completed", G, 25 * MiB, 0, T(168)),
        ev("segment_free", G, 30 * MiB, 0, T(170)),
        {"action": "oom", "device_free": 123, "size": 64 * MiB, "stream": 0, "frames": [],
         **({"time_us": 180} if times else {})},
        ev("free_completed", D, 1000, SIDE, T(200)),
        ev("segment_free", D, 2 * MiB, SIDE, T(210)),
        ev("snapshot", 0, 0, 0, T(220)),
    ]
    segments = [
        {"device": 0, "address": A, "total_size": 20 * MiB, "allocated_size": 4 * MiB, "active_size": 4 * MiB,
         "requested_size": 4 * MiB - 100, "stream": 0, "segment_type": "large", "is_expandable": False,
         "blocks": [
             {"address": A, "size": 4 * MiB, "requested_size": 4 * MiB - 100, "state": "active_allocated",
              "frames": []},
             {"address": A + 4 * MiB, "size": 16 * MiB, "requested_size": 0, "state": "inactive", "frames": []},
         ]},
        {"device": 0, "address": B, "total_size": 2 * MiB, "allocated_size": 512, "active_size": 512,
         "requested_size": 500, "stream": 0, "segment_type": "small", "is_expandable": False,
         "blocks": [
             {"address": B, "size": 512, "requested_size": 500, "state": "active_allocated", "frames": []},
             {"address": B + 512, "size": 2 * MiB - 512, "requested_size": 0, "state": "inactive", "frames": []},
         ]},
        # Another device's segment must not count.
        {"device": 1, "address": 0x1000, "total_size": 100 * MiB, "stream": 0, "blocks": []},
    ]
    return {"segments": segments, "device_traces": [trace, []],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None}}


# Reserved at the end: A (20) + B (2) = 22 MiB. Net of the window's segment events:
# -20 +2 +2 +30 -30 -2 = -18 MiB, so 40 MiB at the start; the running total is
# 40 -> 20 -> 22 -> 24 -> 54 -> 24 -> 22: PyTorch's peak is 54 MiB, inside the window.
TORCH_PEAK = 54 * MiB


class ConvertTest(unittest.TestCase):
    def test_events_seeds_and_torch_peak(self):
        header, events, info = s2t.convert(make_snapshot(), capacity=80 << 30, source="unit test")
        self.assertEqual(header["torch_peak_reserved"], TORCH_PEAK)
        self.assertEqual(header["torch_reserved_start"], 40 * MiB)
        self.assertEqual(header["torch_reserved_end"], 22 * MiB)
        self.assertEqual(header["torch_ooms"], 1)
        self.assertEqual(header["seeded"], 2)
        self.assertEqual(header["device"], 0)
        self.assertEqual(header["source"], "unit_test")
        self.assertEqual(events, [
            (0, "a", 0, 4 * MiB - 100, 0),   # seeded: live at the end, alloc before the window (A < X)
            (0, "a", 1, MiB, 0),             # seeded: freed in the window without an alloc
            (0, "f", 1, 0),                  # X's free_completed, t = 100 us = the window's start
            (30000, "a", 1, 500, 0),         # id 1 reused
            (40000, "a", 2, 1000, 1),        # the side stream becomes stream 1
            (65000, "a", 3, 25 * MiB, 0),
            (68000, "f", 3, 0),
            (100000, "f", 2, 1),             # D freed at its free_completed, 60 us after the request
        ])
        self.assertEqual(info["live_at_end"], 2)  # A and B, as in the snapshot's segments
        self.assertEqual(info["unknown_actions"], [])

    def test_free_at_requested(self):
        header, events, _ = s2t.convert(make_snapshot(), free_at="requested")
        self.assertEqual(header["free_at"], "requested")
        self.assertIn((50000, "f", 2, 1), events)
        self.assertNotIn((100000, "f", 2, 1), events)
        self.assertEqual(header["torch_peak_reserved"], TORCH_PEAK)

    def test_without_timestamps(self):
        header, events, _ = s2t.convert(make_snapshot(times=False))
        self.assertEqual(header["timestamps"], "synthetic")
        times = [e[0] for e in events]
        self.assertEqual(times, sorted(times))
        self.assertEqual(events[-1], (14000, "f", 2, 1))  # the 15th event: 1 us per event
        self.assertEqual(header["torch_peak_reserved"], TORCH_PEAK)

    def test_blocks_without_addresses(self):
        snap = make_snapshot()
        for seg in snap["segments"]:
            for block in seg["blocks"]:
                del block["address"]  # older snapshots: addresses follow from the segment's
        _, events, _ = s2t.convert(snap)
        self.assertEqual(events[0], (0, "a", 0, 4 * MiB - 100, 0))

    def test_inconsistent_snapshot_is_refused(self):
        snap = make_snapshot()
        snap["segments"] = []  # the window reserves more than there is at the end
        snap["device_traces"][0].append(ev("segment_alloc", G, 50 * MiB, 0, 230))
        with self.assertRaises(s2t.ConversionError):
            s2t.convert(snap)
        with self.assertRaises(s2t.ConversionError):
            s2t.convert(make_snapshot(), device=5)

    def test_text(self):
        header, events, _ = s2t.convert(make_snapshot(), capacity=1 << 30, source="s")
        text = s2t.format_trace(header, events)
        first, second = text.splitlines()[:2]
        self.assertTrue(first.startswith("# spillway-trace v1 device_capacity=1073741824 source=s "
                                         f"torch_peak_reserved={TORCH_PEAK} "))
        self.assertEqual(second, f"0 a 0 {4 * MiB - 100} 0")


class CommandLineTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.pickle = os.path.join(self.dir.name, "snap shot.pickle")  # a space on purpose
        with open(self.pickle, "wb") as f:
            pickle.dump(make_snapshot(), f)

    def tearDown(self):
        self.dir.cleanup()

    def test_gzip_output_and_replay(self):
        out = os.path.join(self.dir.name, "out.trace.gz")
        self.assertEqual(s2t.main([self.pickle, "-o", out, "--capacity", str(1 << 30)]), 0)
        with gzip.open(out, "rt") as f:
            lines = f.read().splitlines()
        self.assertIn("source=pytorch:snap_shot.pickle", lines[0])
        self.assertEqual(len(lines), 9)
        with open(out, "rb") as f:
            first = f.read()
        s2t.main([self.pickle, "-o", out, "--capacity", str(1 << 30)])
        with open(out, "rb") as f:
            self.assertEqual(f.read(), first)  # deterministic bytes

        replay = os.environ.get("SPILLWAY_REPLAY")
        if not replay:
            self.skipTest("SPILLWAY_REPLAY is not set (CTest sets it to spillway-replay)")
        run = subprocess.run([replay, "--trace", out, "--device", "sim", "--json"],
                             capture_output=True, text=True, check=False)
        self.assertEqual(run.returncode, 0, run.stderr)
        result = json.loads(run.stdout)["traces"][0]
        self.assertEqual(result["torch"]["peak_reserved"], TORCH_PEAK)
        self.assertEqual(result["events"], 8)
        self.assertEqual(result["ooms"], 0)
        # Live at once: A, then A + B + D + G's 25 MiB block.
        self.assertEqual(result["trace_peak_live_bytes"], 4 * MiB - 100 + 500 + 1000 + 25 * MiB)
        self.assertEqual(result["peak_requested"], result["trace_peak_live_bytes"])
        self.assertAlmostEqual(result["torch"]["fragmentation"], TORCH_PEAK / result["peak_allocated"])

    def test_bad_input(self):
        bad = os.path.join(self.dir.name, "bad.pickle")
        with open(bad, "wb") as f:
            pickle.dump({"something": "else"}, f)
        self.assertEqual(s2t.main([bad, "-o", os.path.join(self.dir.name, "x.trace")]), 2)
        self.assertEqual(s2t.main([os.path.join(self.dir.name, "missing.pickle"), "-o", "-"]), 2)


if __name__ == "__main__":
    unittest.main()

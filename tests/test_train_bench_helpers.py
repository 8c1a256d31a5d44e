#!/usr/bin/env python3
"""test_train_bench_helpers: the pure parts of bench/train_bench.py that its GPU modes rely on,
checked on synthetic inputs, without torch or a GPU.

It proves: largest_fitting finds the largest batch that fits for limits from 1 to its bound, and 0
when nothing fits; analyze_copy_trace counts device-to-pinned and pinned-to-device copies from a
profiler trace (both category spellings), ignores copies of a few bytes, and gives each
direction's bandwidth and the fraction of its time overlapped by kernels; a bad --smoke-ratio is
refused with its value named.
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import train_bench  # noqa: E402
from train_bench_args import ArgError, build_parser, check_args  # noqa: E402
from train_bench_worker import analyze_copy_trace  # noqa: E402


class LargestFitting(unittest.TestCase):
    def test_finds_each_limit(self):
        for limit in (1, 5, 37, 100, 4096):
            best, probes = train_bench.largest_fitting(lambda b, n=limit: b <= n, 8, 4096, 0.0)
            self.assertEqual(best, limit, probes)

    def test_nothing_fits(self):
        best, probes = train_bench.largest_fitting(lambda b: False, 8, 4096, 0.0)
        self.assertEqual(best, 0)
        self.assertEqual(probes, [(8, False), (1, False)])


class AnalyzeCopyTrace(unittest.TestCase):
    def test_bandwidth_and_overlap(self):
        def copy(cat, direction, ts, dur, nbytes):
            return {"ph": "X", "cat": cat, "name": f"Memcpy {direction}", "ts": ts, "dur": dur,
                    "args": {"bytes": nbytes}}
        events = [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 100},
                  {"ph": "X", "cat": "kernel", "ts": 150, "dur": 100},
                  copy("gpu_memcpy", "DtoH (Device -> Pinned)", 50, 200, 1 << 20),
                  copy("Memcpy", "HtoD (Pinned -> Device)", 300, 10, 1 << 20),
                  copy("gpu_memcpy", "DtoH (Device -> Pinned)", 0, 5, 4)]  # too small to count
        got = analyze_copy_trace(events)
        d2h, h2d = got["d2h"], got["h2d"]
        self.assertEqual(d2h["copies"], 1)
        self.assertEqual(d2h["overlap_fraction"], 0.75)  # 150 of its 200 us under a kernel
        self.assertEqual(h2d["overlap_fraction"], 0.0)
        self.assertAlmostEqual(d2h["gbps"], (1 << 20) / 200e-6 / 1e9, places=3)


class Arguments(unittest.TestCase):
    def test_bad_smoke_ratio_is_named(self):
        for bad in ("0", "1.5"):
            with self.assertRaises(ArgError) as caught:
                check_args(build_parser().parse_args(["--smoke", "--smoke-ratio", bad]))
            self.assertIn(f"--smoke-ratio {float(bad)} is invalid", str(caught.exception))


if __name__ == "__main__":
    unittest.main()

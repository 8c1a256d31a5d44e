#!/usr/bin/env python3
"""test_record_op_trace: the bookkeeping of bench/record_op_trace.py (OpTraceWriter), without torch.

It proves: a storage first seen as an input is a param; an op's fresh outputs are new buffers; an
in-place write makes a new version (single assignment), and a param's old version is freed after
the op; an address reused after its storage died is a new buffer, while a "fresh" storage at the
address of a live one is treated as an alias and writes nothing; keep() marks a produced buffer
param (gradients); GPU durations replace CPU ones in order;
ops that write nothing (views) are dropped; gzip output is deterministic; the header's batch
field names every input's shape in one word. When SPILLWAY_OP_TRACE_SYNTH names the spillway-op-trace-synth
binary (CTest sets it), the C++ reader also reads the written trace (--summary) and agrees on its
op count.
"""

import gzip
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import record_op_trace as rot  # noqa: E402


class Storage:
    """A fake storage: an address, a size and a liveness flag."""

    def __init__(self, key, nbytes):
        self.key, self.nbytes, self.live = key, nbytes, True

    def alive(self):
        return self.live


def read(w, s):
    return w.read(s.key, s.nbytes, s.alive)


def write(w, s, in_place=False):
    return w.write(s.key, s.nbytes, s.alive, in_place)


def step():
    """weight W, input X; h = mm(X, W); relu_(h) in place; loss = sum(h); backward: g = ones, ..."""
    w = rot.OpTraceWriter("toy", "test", {"timing": "cpu"})
    W, X, H, L, G = Storage(0x1000, 4096), Storage(0x2000, 1024), Storage(0x3000, 1024), Storage(0x4000, 4), Storage(0x5000, 4)
    h0, _ = write(w, H)
    w.op("aten.mm.default", 100, [read(w, X), read(w, W)], [h0])
    old = read(w, H)
    h1, prev = write(w, H, in_place=True)
    assert prev == old
    w.op("aten.relu_.default", 10, [old], [h1])
    w.op("aten.sum.default", 5, [read(w, H)], [write(w, L)[0]])
    w.phase("backward")
    w.op("aten.ones_like.default", 1, [read(w, L)], [write(w, G)[0]])
    return w, (W, X, H, L, G), (h0, h1)


class WriterTest(unittest.TestCase):
    def test_params_versions_and_text(self):
        w, (W, X, H, L, G), (h0, h1) = step()
        self.assertEqual(w.param, [False, True, True, False, False, False])  # h0, X, W, h1, L, G
        self.assertNotEqual(h0, h1)
        text = w.text().splitlines()
        self.assertEqual(text[0], "# spillway-op-trace v1 model=toy source=test timing=cpu")
        self.assertIn("b 1 1024 param", text)
        self.assertIn("o aten.mm.default 100 in 1 2 out 0", text)
        self.assertIn("o aten.relu_.default 10 in 0 out 3", text)
        self.assertIn("o aten.sum.default 5 in 3 out 4", text)  # reads the new version
        self.assertLess(text.index("phase backward"), text.index("o aten.ones_like.default 1 in 4 out 5"))

    def test_in_place_update_of_a_param_frees_the_old_version(self):
        w = rot.OpTraceWriter("m", "s")
        P = Storage(0x10, 64)
        old = read(w, P)
        new, prev = write(w, P, in_place=True)
        self.assertEqual(prev, old)
        self.assertTrue(w.param[new])  # versions of a param stay params
        w.op("aten.add_.Tensor", 3, [old], [new], free_after=[old])
        self.assertEqual(w.text().splitlines()[-1], f"f {old}")

    def test_reused_address_is_a_new_buffer_and_live_alias_writes_nothing(self):
        w = rot.OpTraceWriter("m", "s")
        A = Storage(0x20, 128)
        a1, _ = write(w, A)
        w.op("aten.empty.memory_format", 1, [], [a1])
        self.assertEqual(write(w, A), (None, None))  # same address, still alive: an alias
        A.live = False
        B = Storage(0x20, 256)  # the allocator reused the address
        b1, prev = write(w, B)
        self.assertIsNone(prev)
        self.assertNotEqual(a1, b1)
        self.assertEqual(w.sizes[b1], 256)
        self.assertEqual(read(w, B), b1)

    def test_keep_marks_gradients_and_empty_ops_are_dropped(self):
        w, (W, X, H, L, G), _ = step()
        w.keep(G.key)
        self.assertTrue(w.param[5])
        n = len(w.lines)
        w.op("aten.detach.default", 1, [None], [None])
        w.op("aten.t.default", 1, [read(w, W)], [])
        self.assertEqual(len(w.lines), n)
        w.set_durations([7, 8, 9, 10])
        self.assertIn("o aten.mm.default 7 in 1 2 out 0", w.text())
        self.assertEqual(w.summary()["ops"], 4)

    def test_describe_batch_is_one_word(self):
        class T:
            def __init__(self, *shape):
                self.shape = shape

        self.assertEqual(rot.describe_batch({"x": T(16, 3, 224, 224), "y": T(16)}), "x:16x3x224x224,y:16")
        w = rot.OpTraceWriter("m", "s", {"batch": rot.describe_batch({"ids": T(1, 1024)}), "dtype": "float32"})
        self.assertEqual(w.text().splitlines()[0], "# spillway-op-trace v1 model=m source=s batch=ids:1x1024 dtype=float32")

    def test_gzip_is_deterministic_and_the_cpp_reader_agrees(self):
        w, _, _ = step()
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "a.optrace.gz"), os.path.join(d, "b.optrace.gz")
            w.save(a)
            w.save(b)
            with open(a, "rb") as fa, open(b, "rb") as fb:
                self.assertEqual(fa.read(), fb.read())
            with gzip.open(a, "rt") as f:
                self.assertEqual(f.read(), w.text())
            tool = os.environ.get("SPILLWAY_OP_TRACE_SYNTH")
            if not tool:
                self.skipTest("SPILLWAY_OP_TRACE_SYNTH not set")
            out = subprocess.run([tool, "--summary", a], capture_output=True, text=True, check=True).stdout
            self.assertIn("4 ops (3 forward, 1 backward)", out)


if __name__ == "__main__":
    unittest.main()

"""Saved storages on CPU tensors: spilled ones come back bit-identical and the link is measured
from the spills; without host memory a segment is dropped instead; entries go once backward is
done; and a storage the program holds is never evicted, a saved output does not keep its graph
alive, and views of one storage share one entry.

Run by ctest with spillway's build tree on PYTHONPATH (tests/CMakeLists.txt).
"""

import copy
import gc
import unittest
import weakref

import torch

import spillway
from torch_activation_checks import assert_identical, mlp, step

torch.use_deterministic_algorithms(True)


class Spill(unittest.TestCase):
    def test_spilled_activations_come_back_identical(self):
        torch.manual_seed(0)
        model = mlp(depth=4)
        x = torch.randn(256, 256)
        reference = step(copy.deepcopy(model), x, lambda m, x: m(x))

        # Activations of 256 KiB (256 x 256 floats). A cap of one leaves room to restore one
        # ahead; a cap of 0 leaves none (a prefetch would be evicted again at once).
        for cap, prefetched in ((256 * 1024, True), (0, False)):
            with self.subTest(max_resident=cap):
                def forward(m, x):
                    with spillway.activations(max_resident=cap, mode="spill", prefetch=1,
                                              min_bytes=0) as acts:
                        y = m(x)
                    forward.acts = acts
                    return y
                got = step(copy.deepcopy(model), x, forward)
                assert_identical(self, reference, got)
                stats = forward.acts.stats()
                self.assertGreater(stats["spills"], 0)
                self.assertEqual(stats["restores"], stats["spills"])
                self.assertEqual(stats["prefetches"] > 0, prefetched)
                self.assertEqual(stats["prefetches_unused"], 0)
                self.assertEqual(stats["drops"], 0)

    def test_without_host_memory_segments_are_dropped_and_the_rest_kept(self):
        # max_spilled=0: no spill can be made; hybrid drops the segment's storages instead (the
        # link is made so fast that it would spill them all), the rest stays resident.
        torch.manual_seed(0)
        model = mlp(depth=4)
        x = torch.randn(256, 256)
        reference = step(copy.deepcopy(model), x, lambda m, x: m(x))

        def forward(m, x):
            with spillway.activations(max_resident=0, mode="hybrid", min_bytes=0, max_spilled=0,
                                      link_bandwidth=1e30) as acts:
                y = spillway.checkpoint(m[:6], x)
                y = m[6:](y)
            forward.acts = acts
            return y
        got = step(model, x, forward)
        assert_identical(self, reference, got)
        stats = forward.acts.stats()
        self.assertEqual(stats["spills"], 0)
        self.assertGreater(stats["spill_fallbacks"], 0)
        self.assertGreater(stats["drops"], 0)
        self.assertGreater(stats["recomputes"], 0)

    def test_the_link_is_measured_from_the_spills_unless_given(self):
        # Each CPU copy is timed; a given link_bandwidth is kept as it is.
        for given in (None, 3e9, 1e30):
            with self.subTest(link_bandwidth=given):
                x = torch.randn(1 << 18, requires_grad=True)
                with spillway.activations(mode="spill", min_bytes=0, link_bandwidth=given) as acts:
                    before = acts.stats()
                    y = (x * 2).sin()  # saves x * 2, which only autograd holds
                    self.assertGreater(acts.evict(1 << 30)[0], 0)
                    y.sum().backward()
                stats = acts.stats()
                self.assertEqual(stats["restores"], stats["spills"])
                if given is None:  # its copies moved the process's estimate; the next starts there
                    self.assertNotEqual(stats["spill_bytes_per_s"], before["spill_bytes_per_s"])
                    self.assertNotEqual(stats["restore_bytes_per_s"], before["restore_bytes_per_s"])
                    nxt = spillway.activations().stats()
                    self.assertEqual(nxt["spill_bytes_per_s"], stats["spill_bytes_per_s"])
                else:  # given: kept (1e30 saturates the counter)
                    self.assertEqual(stats["spill_bytes_per_s"], min(int(given), 2**64 - 1))
                self.assertNotIn("activations.spill_bytes_per_s", spillway.stats())  # per manager

    def test_entries_are_released_after_backward(self):
        model = mlp(depth=2)
        with spillway.activations(max_resident=0, mode="spill", min_bytes=0) as acts:
            loss = model(torch.randn(64, 256)).sum()
        self.assertGreater(acts.stats()["registered"], 0)
        loss.backward()
        del loss
        self.assertEqual(acts.stats()["registered"], 0)
        self.assertEqual(acts.stats()["resident_bytes"], 0)


class Ownership(unittest.TestCase):
    def test_a_small_saved_output_does_not_keep_its_graph_alive(self):
        # Under min_bytes a saved tensor is kept as it is. A saved output comes to the pack hook
        # with its grad_fn: kept undetached, the graph would hold itself through it.
        x = torch.randn(16, requires_grad=True)
        with spillway.activations(min_bytes=1 << 30):
            y = x.exp()  # exp saves its output
            z = y.sum()
        output = weakref.ref(y)
        del y, z
        gc.collect()
        self.assertIsNone(output())

    def test_a_storage_the_program_holds_is_never_evicted(self):
        x = torch.randn(128, 128, requires_grad=True)
        with spillway.activations(max_resident=0, mode="spill", min_bytes=0) as acts:
            h = x.exp()          # saved by exp's backward, and held by `h`
            y = h.sin()          # sin saves h
        self.assertEqual(acts.state_of(h), "resident")
        before = h.clone()
        acts.evict(1 << 30)        # everything evictable goes
        self.assertEqual(acts.state_of(h), "resident")
        self.assertTrue(torch.equal(h, before))
        y.sum().backward()

    def test_views_share_one_entry_and_are_restored_together(self):
        x = torch.randn(64, 64, requires_grad=True)
        with spillway.activations(mode="spill", min_bytes=0) as acts:
            base = x * 2
            a = base[:32].sin()   # saves the view base[:32]
            b = base[32:].cos()   # saves the view base[32:]
        expected = torch.cat([(x * 2)[:32].cos(), -(x * 2)[32:].sin()])
        del base
        self.assertEqual(acts.stats()["registered"], 1)  # the two views share base's storage
        (a.sum() + b.sum()).backward()
        self.assertTrue(torch.allclose(x.grad, 2 * expected))

    def test_view_storage_evicted_once(self):
        x = torch.randn(64, 64, requires_grad=True)
        with spillway.activations(mode="spill", min_bytes=0) as acts:
            base = x.exp()
            a = base[:32].sin()
            b = base[32:].cos()
        del base
        freed, _ = acts.evict(1 << 30)
        self.assertEqual(freed, 64 * 64 * 4)       # base's storage, once for both views
        (a.sum() + b.sum()).backward()
        e = x.detach().exp()
        self.assertTrue(torch.allclose(x.grad, torch.cat([e[:32].cos(), -e[32:].sin()]) * e))


if __name__ == "__main__":
    unittest.main()

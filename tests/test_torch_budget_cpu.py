"""Training under a budget on CPU: spillway's simulated device serves torch's CPU tensors
(spillway.install(backend="sim", cpu_tensors=True)), so that every allocation an operator makes
counts against the budget and, over it, runs the activation manager's pressure handler in the
middle of the operator, as on a GPU with spillway installed.

Proves, for a transformer trained in checkpoint segments with every mode (spill, drop, hybrid) and
with backward on the calling thread and on another thread (CUDA runs backward on autograd's device
thread):
- at 70% and 50% of the unconstrained peak reserved bytes, the step runs, the allocator evicted
  through the manager, and the loss and gradients are bit-identical to a run without a budget;
- at 30%, the step is bit-identical or fails with torch.OutOfMemoryError naming the budget, and
  afterwards the model still trains bit-identically without a budget (nothing lost or corrupted);
- after every step, the memory the step allocated is given back;
- a dropped segment is refilled with the memory of its replay (no second copy of its bytes);
- bad use of cpu_tensors names the value and what was expected.

One process: the allocator is installed once. Run by ctest with spillway's build tree on
PYTHONPATH (tests/CMakeLists.txt).
"""

import gc
import threading
import unittest

import torch

import spillway
from spillway import _C

torch.use_deterministic_algorithms(True)


class BadUse(unittest.TestCase):
    # Before the install below: these fail before anything is installed.
    def test_cpu_tensors_needs_the_simulated_device(self):
        with self.assertRaisesRegex(ValueError, "cpu_tensors=True needs backend 'sim'.*'cuda'"):
            spillway.install(backend="cuda", cpu_tensors=True)
        self.assertFalse(spillway.is_installed())

    def test_cpu_tensors_must_be_a_bool(self):
        with self.assertRaisesRegex(ValueError, "cpu_tensors 'yes' is invalid: expected True or False"):
            spillway.install(backend="sim", cpu_tensors="yes")
        self.assertFalse(spillway.is_installed())


def make_model():
    torch.manual_seed(0)
    layer = lambda: torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.1, batch_first=True)
    return torch.nn.Sequential(*[layer() for _ in range(4)])


class TrainUnderBudget(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        spillway.install(backend="sim", sim_capacity="2GiB", cpu_tensors=True)
        cls.model = make_model()
        cls.x = torch.randn(8, 128, 128)
        cls.reference = cls.step(None, segments=None, other_thread=False)
        spillway.empty_cache()
        cls.baseline = spillway.stats()["allocated_bytes.all.current"]
        # The unconstrained peak of a step with activations(), the way the GPU check measures it.
        spillway.set_budget(None)
        cls.step(dict(mode="spill"), segments=4, other_thread=False)
        cls.peak = spillway.stats()["reserved_bytes.all.peak"]

    @classmethod
    def step(cls, spill, segments, other_thread):
        model = cls.model
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        if spill is None:
            loss = model(cls.x).square().mean()
            manager = None
        else:
            with spillway.activations(**spill) as manager:
                y = spillway.checkpoint_sequential(model, segments, cls.x)
            loss = y.square().mean()
        if other_thread:
            errors = []

            def backward():
                try:
                    loss.backward()
                except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                    errors.append(e)

            t = threading.Thread(target=backward)
            t.start()
            t.join()
            if errors:
                raise errors[0]
        else:
            loss.backward()
        result = (loss.detach().clone(), [p.grad.clone() for p in model.parameters()])
        return result if manager is None else (result, manager.stats())

    def assert_identical(self, got):
        loss, grads = got
        self.assertTrue(torch.equal(loss, self.reference[0]), f"loss {loss} != {self.reference[0]}")
        for a, b in zip(grads, self.reference[1]):
            self.assertTrue(torch.equal(a, b), "a gradient differs")

    def run_under(self, ratio, mode, other_thread):
        spillway.set_budget(None)
        spillway.empty_cache()
        budget = int(self.peak * ratio)
        spillway.set_budget(budget)
        before = spillway.stats()["num_pressure_handler_calls"]
        try:
            return self.step(dict(mode=mode), segments=4, other_thread=other_thread), before
        finally:
            spillway.set_budget(None)

    def test_fits_at_70_and_50_percent_bit_identical(self):
        for ratio in (0.7, 0.5):
            for mode in ("spill", "drop", "hybrid"):
                for other_thread in (False, True):
                    with self.subTest(ratio=ratio, mode=mode, other_thread=other_thread):
                        (got, acts), calls_before = self.run_under(ratio, mode, other_thread)
                        self.assert_identical(got)
                        self.assertGreater(spillway.stats()["num_pressure_handler_calls"], calls_before)
                        self.assertGreater(acts["pressure_calls"], 0)
                        self.assertGreater(acts["evictions"], 0)
                        if mode == "spill":
                            self.assertEqual(acts["drops"], 0)
                        if mode == "drop":
                            self.assertEqual(acts["spills"], 0)
                            self.assertGreater(acts["recomputes"], 0)
                            self.assertGreater(acts["recompute_moves"], 0)
                        del got
                        self.assertLessEqual(spillway.stats()["allocated_bytes.all.current"],
                                             self.baseline)

    def test_30_percent_is_identical_or_a_clean_out_of_memory(self):
        for mode in ("spill", "drop", "hybrid"):
            with self.subTest(mode=mode):
                try:
                    (got, _), _ = self.run_under(0.3, mode, other_thread=True)
                    self.assert_identical(got)
                    del got
                except torch.OutOfMemoryError as e:
                    self.assertIn("budget", str(e))
                # The error's traceback and the frames it holds form a cycle (as after any out of
                # memory in PyTorch): the collector frees the tensors they hold.
                gc.collect()
                self.assertLessEqual(spillway.stats()["allocated_bytes.all.current"], self.baseline)
                self.assert_identical(self.step(None, segments=None, other_thread=True))

    def test_serving_twice_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "already served"):
            _C.serve_cpu_tensors()

    def test_a_request_over_any_device_is_out_of_memory_and_counted(self):
        # As PyTorch reports, and counts, a request no device could hold.
        before = spillway.stats()["num_ooms"]
        with self.assertRaises(torch.OutOfMemoryError):
            torch.empty(1 << 60, dtype=torch.uint8)
        self.assertEqual(spillway.stats()["num_ooms"], before + 1)

    def test_a_cpu_tensor_is_spillway_memory(self):
        before = spillway.stats()["allocated_bytes.all.current"]
        t = torch.empty(1 << 20, dtype=torch.uint8)
        self.assertGreaterEqual(spillway.stats()["allocated_bytes.all.current"], before + (1 << 20))
        del t
        self.assertEqual(spillway.stats()["allocated_bytes.all.current"], before)


if __name__ == "__main__":
    unittest.main()

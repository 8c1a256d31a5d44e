"""Checkpoint replays and normalisation statistics, on CPU tensors: a replay runs the segment
again, and must not update BatchNorm's or InstanceNorm's running statistics a second time,
however the segment reaches the module (a Module, a lambda, functools.partial,
torch.func.functional_call), and must leave a module another thread runs meanwhile alone.

Run by ctest with spillway's build tree on PYTHONPATH (tests/CMakeLists.txt).
"""

import copy
import functools
import threading
import unittest

import torch

import spillway
from torch_activation_checks import assert_identical, assert_updated_once, cnn, step

torch.use_deterministic_algorithms(True)


def cnn_and_reference():
    """A CNN with BatchNorm and dropout, an input, a copy of it stepped once without spillway,
    and that step's loss and gradients."""
    torch.manual_seed(0)
    model = cnn()
    x = torch.randn(8, 3, 16, 16)
    plain = copy.deepcopy(model)
    return model, x, plain, step(plain, x, lambda m, x: m(x))


class ReplayStatistics(unittest.TestCase):
    def check_dropped_and_updated_once(self, model, x, forward, plain, reference):
        """A step of `forward` (which keeps its manager as forward.acts) recomputed something and
        gave the plain step's results, statistics included."""
        got = step(model, x, forward)
        assert_identical(self, reference, got)
        self.assertGreater(forward.acts.stats()["recomputes"], 0)
        assert_updated_once(self, plain, model)

    def test_cnn_with_batchnorm_and_dropout(self):
        model, x, plain, reference = cnn_and_reference()

        wrapped = spillway.Sequential(model, segments=3)

        def forward(m, x):
            with spillway.activations(max_resident=0, mode="drop", min_bytes=0) as acts:
                y = wrapped(x)
            forward.acts = acts
            return y
        self.check_dropped_and_updated_once(model, x, forward, plain, reference)

    def test_batchnorm_reached_through_a_lambda_or_partial_is_updated_once(self):
        # fn is no Module nor a bound method of one: the BatchNorm modules it calls are found as
        # the replay calls them.
        model, x, plain, reference = cnn_and_reference()

        def run(block, t):
            return block(t)

        def forward(m, x):
            with spillway.activations(max_resident=0, mode="drop", min_bytes=0) as acts:
                h = spillway.checkpoint(lambda t: m[:4](t), x)
                h = spillway.checkpoint(functools.partial(run, m[4:7]), h)
                y = spillway.checkpoint(lambda t: m[7:](t), h)
            forward.acts = acts
            return y
        self.check_dropped_and_updated_once(model, x, forward, plain, reference)
        # The global hook that found them is gone with the last replay (it slows every module call).
        self.assertEqual(len(torch.nn.modules.module._global_forward_pre_hooks), 0)

    def test_instance_norm_and_statistics_swapped_in_are_updated_once(self):
        # InstanceNorm tracks running statistics too; and with torch.func.functional_call the
        # statistics a replay updates are the swapped-in tensors, not the module's own: those are
        # what it must put back (putting the module's back wrote the swapped values into them).
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.InstanceNorm2d(8, track_running_stats=True),
            torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        x = torch.randn(4, 3, 8, 8)

        def fresh():
            return {"4.running_mean": torch.zeros(8), "4.running_var": torch.ones(8),
                    "4.num_batches_tracked": torch.tensor(0)}
        plain, plain_swapped = copy.deepcopy(net), fresh()
        torch.func.functional_call(plain, plain_swapped, (x,)).square().mean().backward()

        own = {k: v.clone() for k, v in net.state_dict().items() if k.startswith("4.")}
        swapped = fresh()
        with spillway.activations(max_resident=0, mode="drop", min_bytes=0) as acts:
            y = spillway.checkpoint(lambda t: torch.func.functional_call(net, swapped, (t,)), x)
        y.square().mean().backward()
        self.assertGreater(acts.stats()["recomputes"], 0)
        for k in swapped:
            self.assertTrue(torch.equal(swapped[k], plain_swapped[k]), k)
            self.assertTrue(torch.equal(net.state_dict()[k], own[k]), k)  # not touched
        self.assertTrue(torch.equal(net[1].running_mean, plain[1].running_mean))
        self.assertTrue(torch.equal(net[1].running_var, plain[1].running_var))
        self.assertTrue(torch.equal(net[1].num_batches_tracked, plain[1].num_batches_tracked))

    def test_a_replay_leaves_batchnorm_run_on_another_thread_alone(self):
        # The hook that finds a replay's BatchNorm modules is global while the replay runs: a
        # module another thread runs meanwhile keeps its update.
        torch.manual_seed(0)
        model = cnn()
        other = torch.nn.BatchNorm1d(4)
        runs = []

        def segment(t):
            runs.append(None)
            if len(runs) == 2:  # the first replay (in backward) runs the other thread's module
                worker = threading.Thread(target=lambda: other(torch.randn(16, 4)))
                worker.start()
                worker.join()
            return model(t)

        x = torch.randn(8, 3, 16, 16)
        with spillway.activations(max_resident=0, mode="drop", min_bytes=0) as acts:
            y = spillway.checkpoint(segment, x)
        y.square().mean().backward()
        self.assertGreater(len(runs), 1)
        self.assertGreater(acts.stats()["recomputes"], 0)
        self.assertEqual(int(other.num_batches_tracked), 1)
        self.assertEqual(int(model[1].num_batches_tracked), 1)


if __name__ == "__main__":
    unittest.main()

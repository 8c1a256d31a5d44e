"""spillway.activations / checkpoint on CPU tensors: checkpoint segments dropped and recomputed.

Proves, against a run without spillway, that gradients and losses are bit-identical when saved
activations are dropped and recomputed from checkpoint segments (with dropout, inputs and outputs
modified in place, early stops, nested checkpoints, autocast, threads that carry the segment's
hooks); that managers enter and exit cleanly; and that bad arguments name the value. Eviction is
forced by max_resident, the trigger that works with any allocator. Normalisation statistics under
replay are in test_torch_replay_statistics.py; spills and storage ownership in
test_torch_storages.py.

Run by ctest with spillway's build tree on PYTHONPATH (tests/CMakeLists.txt).
"""

import contextlib
import copy
import threading
import unittest

import torch

import spillway
from torch_activation_checks import assert_identical, mlp, step

torch.use_deterministic_algorithms(True)


class CheckpointRecompute(unittest.TestCase):
    def test_mlp_segments_dropped_and_recomputed_bit_identical(self):
        torch.manual_seed(0)
        model = mlp()
        x = torch.randn(512, 256)
        reference = step(copy.deepcopy(model), x, lambda m, x: m(x))

        def forward(m, x):
            with spillway.activations(max_resident=0, mode="drop", min_bytes=0) as acts:
                y = spillway.checkpoint_sequential(m, 3, x)
            forward.acts = acts
            return y
        got = step(model, x, forward)
        assert_identical(self, reference, got)
        stats = forward.acts.stats()
        self.assertGreater(stats["drops"], 0)
        self.assertGreater(stats["recomputes"], 0)
        self.assertEqual(stats["spills"], 0)
        # The boundaries between segments were dropped too (the manager, not the replay, holds a
        # segment's inputs): a replay restored its input by replaying the segment before first.
        self.assertGreater(stats["nested_recomputes"], 0)
        self.assertGreater(stats["recompute_moves"], 0)  # no copy: only the replay held them
        self.assertEqual(stats["registered"], 0)

    def test_a_boundary_modified_in_place_by_the_next_segment(self):
        # y is registered (the second segment's input) unchanged, taking the first segment as
        # lineage; then that segment doubles it in place. Two ways to get it wrong, both tested:
        # - y dropped and refilled from the first segment's replay: the bytes before the doubling;
        # - the second segment's replay doubling y's own storage again.
        # (The first layer is frozen: an in-place op on a segment input that requires grad fails
        # in its replay, as with torch.utils.checkpoint.)
        torch.manual_seed(0)
        first = torch.nn.Linear(256, 256).requires_grad_(False)

        class Double(torch.nn.Module):
            def forward(self, t):
                return t.mul_(2)
        second = torch.nn.Sequential(Double(), torch.nn.Linear(256, 256))
        x = torch.randn(256, 256)

        def run(use):
            for p in second.parameters():
                p.grad = None
            if use:
                with spillway.activations(mode="drop", min_bytes=1024) as acts:
                    y = spillway.checkpoint(first, x)
                    out = spillway.checkpoint(second, y)
                    del y
                    loss = out.square().sum()
                del out
                acts.evict(1 << 40)
                run.stats = acts.stats()
            else:
                loss = second(first(x)).square().sum()
            loss.backward()
            return [p.grad.clone() for p in second.parameters()]

        reference = run(False)
        got = run(True)
        for a, b in zip(reference, got):
            self.assertTrue(torch.equal(a, b), "a gradient differs")
        # Neither y (changed since it took its lineage) nor the second segment's storages (its
        # replay would double y again) may be dropped: in drop mode nothing is evicted.
        self.assertEqual(run.stats["drops"], 0)

    def test_a_segment_under_inference_mode_is_closed(self):
        # Its output has no version counter. end_segment threw on it and left the segment open:
        # a later save outside any segment took it for lineage, was dropped, and was "refilled"
        # from its replay with other bytes of the same size (wrong gradients).
        torch.manual_seed(0)
        lin = torch.nn.Linear(256, 256)
        x = torch.randn(256, 256)
        x2 = torch.randn(256, 256, requires_grad=True)
        with spillway.activations(mode="drop", min_bytes=1024) as acts:
            with torch.inference_mode():
                spillway.checkpoint(lin, x)
            loss = (x2 * 2).exp().sum()  # exp saves its output, outside any segment
        acts.evict(1 << 40)
        self.assertEqual(acts.stats()["drops"], 0)  # nothing has a segment to recompute it
        loss.backward()
        self.assertTrue(torch.equal(x2.grad, (x2.detach() * 2).exp() * 2))

    def test_an_input_modified_after_its_segment_was_dropped_fails_clearly(self):
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())
        x = torch.randn(256, 256)
        with spillway.activations(mode="drop", min_bytes=1024) as acts:
            y = spillway.checkpoint(block, x)
            loss = y.square().sum()
            del y
        self.assertGreater(acts.evict(1 << 40)[0], 0)  # (freed, pinned)
        x.mul_(2)  # the segment's replay would start from other bytes
        with self.assertRaisesRegex(RuntimeError, "input was modified in place after the segment ran"):
            loss.backward()

    def test_an_output_modified_in_place_is_not_recomputed_from_its_segment(self):
        # Its segment's replay would give the bytes before the change: it takes no lineage, and
        # drop mode keeps it (it was refilled with the old bytes: wrong gradients).
        torch.manual_seed(0)
        model = mlp(depth=4)
        x = torch.randn(512, 256)

        def plain(m, x):
            h = m[:6](x)
            h.mul_(2)
            return m[6:](h)
        reference = step(copy.deepcopy(model), x, plain)

        def forward(m, x):
            with spillway.activations(max_resident=0, mode="drop", min_bytes=0) as acts:
                h = spillway.checkpoint(m[:6], x)
                h.mul_(2)
                y = spillway.checkpoint(m[6:], h)
            forward.acts = acts
            return y
        got = step(model, x, forward)
        assert_identical(self, reference, got)
        self.assertEqual(forward.acts.stats()["nested_recomputes"], 0)

    def test_without_pressure_nothing_is_dropped(self):
        torch.manual_seed(0)
        model = mlp(depth=2)
        x = torch.randn(64, 256)
        with spillway.activations(min_bytes=0) as acts:
            loss = spillway.checkpoint(model, x).sum()
        loss.backward()
        self.assertEqual(acts.stats()["evictions"], 0)
        self.assertEqual(acts.stats()["recomputes"], 0)

    def test_a_replay_stops_after_the_last_save_backward_needs(self):
        # Only the segment's oldest save is dropped (LRU): its replay stops once it has given it
        # back, before the ops whose saves backward has consumed already run again.
        tail = [0]

        def chain(t):
            a = t.sin()  # saves t
            b = a.sin()  # saves a: the last save a replay has to give
            tail[0] += 1
            return b.sin().sin()  # saves b, then b.sin()

        n = 4096
        w0 = torch.randn(n)
        w = w0.clone().requires_grad_()
        chain(w * 3).sum().backward()
        reference, w, tail[0] = w.grad, w0.clone().requires_grad_(), 0
        with spillway.activations(mode="drop", policy="lru", min_bytes=0) as acts:
            loss = spillway.checkpoint(chain, w * 3).sum()
            self.assertEqual(acts.evict(n * 4)[0], n * 4)  # w * 3 has no lineage: a goes
            loss.backward()
        self.assertTrue(torch.equal(w.grad, reference))
        self.assertEqual(acts.stats()["recomputes"], 1)
        self.assertEqual(acts.stats()["recomputes_stopped"], 1)
        self.assertEqual(tail[0], 1)  # the forward's: the replay stopped before it

    def test_a_replay_run_for_another_segments_input_does_not_stop(self):
        # Q reads x, the output of P (nested in R). Restoring Q's input replays R, then P; when P
        # is replayed x is resident and only P's save h dropped, but pressure in P's replay drops
        # x: a replay that stopped after h left x dropped, and the restore failed ("did not
        # restore its output"). Only the last replay of a restore stops early now.
        n = 1024
        state = {"calls": 0, "acts": None}

        def P(v):
            state["calls"] += 1
            if state["calls"] == 3 and state["acts"] is not None:  # P's own replay
                state["acts"].evict(1 << 30)  # as the allocator's pressure would
            h = v.sin()  # saves v
            return h.sin().sum(0).exp()  # saves h, then x (exp saves its result)

        def R(t):
            return spillway.checkpoint(P, t.exp())  # saves v = t.exp()

        def Q(x):
            return x.sin().sin()

        w0 = torch.randn(2, n)
        w = w0.clone().requires_grad_()
        Q(R(w * 3)).sum().backward()
        reference, w = w.grad, w0.clone().requires_grad_()
        state["calls"] = 0
        with spillway.activations(mode="drop", policy="largest", min_bytes=0,
                                  max_resident=n * 4) as acts:
            x = spillway.checkpoint(R, w * 3)
            loss = spillway.checkpoint(Q, x).sum()
            del x
        acts.evict(1 << 30)
        state["acts"] = acts
        loss.backward()
        state["acts"] = None
        self.assertTrue(torch.equal(w.grad, reference))

    def test_a_checkpoint_inside_a_replay_opens_no_segment(self):
        # A replay records what its segment saves; a checkpoint nested in the segment is a plain
        # call there (a segment the replay opened would hold its inputs as entries for nothing).
        def inner(t):
            return t.sin().exp()

        def outer(t):  # cos saves what sin made of inner's output: outer's replay runs inner
            return spillway.checkpoint(inner, t.cos()).sin().cos()

        w0 = torch.randn(256)
        w = w0.clone().requires_grad_()
        outer(w * 2).sum().backward()
        reference, w = w.grad, w0.clone().requires_grad_()
        begun = []
        with spillway.activations(mode="drop", min_bytes=0) as acts:
            real = acts._m

            class Counting:  # counts the segments the manager is asked to open
                def __getattr__(self, name):
                    return getattr(real, name)

                def begin_segment(self, *args):
                    begun.append(1)
                    return real.begin_segment(*args)

            acts._m = Counting()
            loss = spillway.checkpoint(outer, w * 2).sum()
            self.assertEqual(len(begun), 2)  # outer and inner
            acts.evict(1 << 30)
            loss.backward()  # CPU: on this thread, inside the manager's scope
        self.assertGreater(acts.stats()["recomputes"], 0)
        self.assertEqual(len(begun), 2)  # the replays opened none
        self.assertTrue(torch.equal(w.grad, reference))

    def test_a_stop_inside_torchscript_or_caught_by_the_segment_is_a_stop(self):
        # TorchScript's interpreter rethrows the stop as a RuntimeError; a segment's own
        # `except Exception` around an op may catch what reaches it. Either way the replay gives
        # back the saves up to the stop, never what a fallback ran after it.
        @torch.jit.script
        def scripted(t):
            return t.sin().sin().sin().sin()

        state = {"acts": None}

        def falls_back(t):
            if state["acts"] is not None:  # the replay: pressure, as the allocator would apply
                state["acts"].evict(1 << 30)
            a = t.sin()  # saves t
            try:
                b = a * a  # saves a twice: the stop is raised here
            except Exception:  # a fallback the first run never took
                b = a.exp()
            return b.sin().sin()

        n = 4096
        for name, fn in (("scripted", scripted), ("falls_back", falls_back)):
            with self.subTest(fn=name):
                w0 = torch.randn(n)
                w = w0.clone().requires_grad_()
                loss = fn(w * 3).sum()
                loss.backward(retain_graph=True)
                loss.backward()
                reference, w = w.grad, w0.clone().requires_grad_()
                with spillway.activations(mode="drop", policy="lru", min_bytes=0) as acts:
                    loss = spillway.checkpoint(fn, w * 3).sum()
                    acts.evict(n * 4)  # LRU: t.sin(), the oldest save with lineage
                    state["acts"] = acts
                    # The stop is after a's saves; the pressure in the replay drops the saves
                    # after it, which retain_graph keeps for the second backward.
                    loss.backward(retain_graph=True)
                    state["acts"] = None
                    loss.backward()
                self.assertEqual(acts.stats()["recomputes_stopped"], 1)
                self.assertTrue(torch.equal(w.grad, reference))

    def assert_one_replay_identical(self, fn):
        """fn over 4096 floats, run as one checkpoint segment whose saves are all dropped: its one
        replay gives the gradient of a plain run, bit for bit."""
        w0 = torch.randn(4096)
        w = w0.clone().requires_grad_()
        fn(w * 3).sum().backward()
        reference, w = w.grad, w0.clone().requires_grad_()
        with spillway.activations(mode="drop", min_bytes=0) as acts:
            loss = spillway.checkpoint(fn, w * 3).sum()
            self.assertGreater(acts.evict(1 << 30)[0], 0)
            loss.backward()
        self.assertEqual(acts.stats()["recomputes"], 1)
        self.assertTrue(torch.equal(w.grad, reference))

    def test_a_segment_that_runs_a_backward_itself_is_recomputed(self):
        # A gradient penalty inside a segment: its replay runs that backward too, which reads
        # what the replay saved (the replay's unpack hook gave None, and the backward failed).
        def penalised(t):
            h = t.sin()
            g, = torch.autograd.grad(h.sum(), t, create_graph=True)
            return (h * g).sin()

        self.assert_one_replay_identical(penalised)

    def test_saves_on_a_thread_that_carries_the_segments_hooks_are_not_the_segments(self):
        # PyTorch runs a backward on CUDA on its device thread, with the calling thread's
        # saved-tensor hooks (a gradient penalty inside a segment). Saves made there are not the
        # segment's in its first run (segments are per thread), so its replay must not record
        # them either: dropped entries are refilled by save position, and here every save has
        # the same size, so a shifted position refilled the wrong bytes with no error.
        def on_a_device_thread(fn):
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
            out = []

            def run():
                if hooks is not None:
                    torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
                try:
                    out.append(fn())
                finally:
                    if hooks is not None:
                        torch._C._autograd._pop_saved_tensors_default_hooks()
            worker = threading.Thread(target=run)
            worker.start()
            worker.join()
            return out[0]

        def segment(t):
            a = t.sin()                                       # saves t
            b = on_a_device_thread(lambda: (a * 2).exp())     # saves exp's output, elsewhere
            return (b + a).cos()                              # saves b + a

        self.assert_one_replay_identical(segment)

    def test_a_segment_under_autocast_is_replayed_under_it(self):
        # The replay runs in backward, outside the autocast block: it must cast as the first run
        # did. Only exp's fp32 output is dropped, so a replay in fp32 would refill it with bytes
        # of the same size and other values (wrong gradients, no error).
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 256)
        x0 = torch.randn(1024, 64) * 0.1

        def block(x):
            return lin(x).float().exp()

        def run(acts):
            x = x0.clone().requires_grad_()
            lin.zero_grad()
            with acts or contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = spillway.checkpoint(block, x * 3)
                loss = y.sum()
                del y
            if acts is not None:
                self.assertGreater(acts.evict(1 << 30)[0], 0)
            loss.backward()
            return x.grad.clone(), lin.weight.grad.clone()

        reference = run(None)
        acts = spillway.activations(mode="drop", policy="largest", min_bytes=0)
        got = run(acts)
        self.assertGreater(acts.stats()["recomputes"], 0)
        for a, b in zip(reference, got):
            self.assertTrue(torch.equal(a, b))

    def test_tensors_in_kwargs_and_containers_are_inputs(self):
        # Held and checked as the positional ones are: unchanged, the replay is bit-identical;
        # modified in place after the segment was dropped, backward fails clearly (it used to
        # replay from the changed bytes: wrong gradients, no error).
        def block(x, bias=None, extra=()):
            return (x + bias + extra[0]).sin()

        x0 = torch.randn(1 << 14)

        def run(acts, change=None):
            x = x0.clone().requires_grad_()
            bias, extra = torch.ones(1 << 14), torch.ones(1 << 14)
            with acts or contextlib.nullcontext():
                loss = spillway.checkpoint(block, x * 3, bias=bias, extra=(extra,)).sum()
            if acts is not None:
                self.assertGreater(acts.evict(1 << 30)[0], 0)
            if change is not None:
                {"bias": bias, "extra": extra}[change].add_(5.0)
            loss.backward()
            return x.grad

        reference = run(None)
        acts = spillway.activations(mode="drop", min_bytes=0)
        self.assertTrue(torch.equal(run(acts), reference))
        self.assertEqual(acts.stats()["recomputes"], 1)
        for change in ("bias", "extra"):
            with self.subTest(change=change):
                with self.assertRaisesRegex(RuntimeError, "input was modified in place"):
                    run(spillway.activations(mode="drop", min_bytes=0), change)

    def test_a_replays_input_copied_back_is_not_an_unpack(self):
        # x * 3, the segment's input, is spilled (no lineage: hybrid spills it, at a slow link)
        # and exp's result dropped. Backward's one unpack finds its storage dropped; the replay
        # copies its input back. That copy is the replay's, not an unpack that waited: it moves
        # neither unpacks_waiting nor the prefetch depth.
        def block(h):
            return (h + 1).exp()

        x = torch.randn(1 << 16, requires_grad=True)
        acts = spillway.activations(mode="hybrid", min_bytes=0, link_bandwidth=1.0, prefetch=1)
        with acts:
            loss = spillway.checkpoint(block, x * 3).sum()
        acts.evict(1 << 30)
        self.assertEqual((acts.stats()["spills"], acts.stats()["drops"]), (1, 1))
        loss.backward()
        s = acts.stats()
        self.assertEqual((s["recomputes"], s["restores"]), (1, 1))
        self.assertEqual(s["unpacks_waiting"], 0)
        self.assertTrue(torch.equal(x.grad, 3 * (x.detach() * 3 + 1).exp()))

    def test_checkpoint_outside_activations_is_a_plain_call(self):
        model = mlp(depth=1)
        x = torch.randn(4, 256)
        torch.manual_seed(3)
        a = spillway.checkpoint(model, x)
        torch.manual_seed(3)
        b = model(x)
        self.assertTrue(torch.equal(a, b))

    def test_a_manager_that_cannot_be_entered_leaves_no_trace(self):
        # Saved-tensor hooks disabled (torch.func transforms do this): entering fails, and
        # checkpoint after it is not routed to a manager whose scope never began.
        acts = spillway.activations()
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
            with self.assertRaises(RuntimeError):
                with acts:
                    pass
        self.assertIsNone(spillway.saved_activations._current_manager())

    def test_managers_exited_out_of_order_leave_the_other_current(self):
        top = torch._C._autograd._top_saved_tensors_default_hooks
        a, b = spillway.activations(), spillway.activations()
        a.__enter__()
        b.__enter__()
        a.__exit__(None, None, None)  # out of order, as an ExitStack misused could
        self.assertIs(spillway.saved_activations._current_manager(), b)
        # torch's hooks are b's: a's came off, b's stayed on (an exit pops torch's top)
        self.assertEqual(top(False)[0], b.pack)
        b.__exit__(None, None, None)
        self.assertIsNone(spillway.saved_activations._current_manager())
        self.assertIsNone(top(False))

        # Hooks of someone else's entered after a manager: its exit refuses, and changes nothing.
        a.__enter__()
        other = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        other.__enter__()
        with self.assertRaisesRegex(RuntimeError, "exit those first"):
            a.__exit__(None, None, None)
        self.assertEqual(top(False)[0], other.pack_hook)
        self.assertIs(spillway.saved_activations._current_manager(), a)
        other.__exit__()
        a.__exit__(None, None, None)
        self.assertIsNone(top(False))
        self.assertIsNone(spillway.saved_activations._current_manager())
        with a:  # and a manager entered twice, nested, is current until its inner exit
            with a:
                self.assertIs(spillway.saved_activations._current_manager(), a)
            self.assertIs(spillway.saved_activations._current_manager(), a)
        self.assertIsNone(spillway.saved_activations._current_manager())


class BadInput(unittest.TestCase):
    def test_bad_arguments_name_the_value(self):
        with self.assertRaisesRegex(ValueError, "mode 'copy' is invalid"):
            spillway.activations(mode="copy")
        with self.assertRaisesRegex(ValueError, "policy 'mru' is invalid"):
            spillway.activations(policy="mru")
        with self.assertRaisesRegex(ValueError, "prefetch -1 is invalid"):
            spillway.activations(prefetch=-1)
        with self.assertRaisesRegex(ValueError, "max_resident 'lots' is invalid: it does not start with a number"):
            spillway.activations(max_resident="lots")
        with self.assertRaisesRegex(ValueError, "max_spilled -1 is invalid"):
            spillway.activations(max_spilled=-1)
        with self.assertRaisesRegex(ValueError, "min_bytes -1 is invalid"):
            spillway.activations(min_bytes=-1)
        with self.assertRaisesRegex(ValueError, "min_bytes None is invalid"):
            spillway.activations(min_bytes=None)
        with self.assertRaisesRegex(ValueError, "min_bytes 0.5 is invalid: expected a whole number"):
            spillway.activations(min_bytes=0.5)
        with self.assertRaisesRegex(ValueError, "max_resident False is invalid"):
            spillway.activations(max_resident=False)
        with self.assertRaisesRegex(ValueError, "prefetch True is invalid"):
            spillway.activations(prefetch=True)
        with self.assertRaisesRegex(ValueError, "link_bandwidth 'fast' is invalid"):
            spillway.activations(link_bandwidth="fast")
        with self.assertRaisesRegex(ValueError, "link_bandwidth"):
            spillway.activations(link_bandwidth=0.0)

    def test_sizes_may_be_strings_or_whole_floats(self):
        acts = spillway.activations(max_resident="1.5MiB", min_bytes="64KiB", max_spilled=4e6)
        self.assertIsInstance(acts, spillway.ActivationManager)
        acts.close()
        self.assertEqual(spillway.parse_size("64KiB"), 65536)
        self.assertEqual(spillway.parse_size(8e9), 8_000_000_000)
        self.assertIsNone(spillway.parse_size(None))
        for bad, why in ((1.5, "whole number"), (float("nan"), "whole number"), (True, "whole number"),
                         ([1], "whole number"), ("-1MiB", "negative"), (-3, "non-negative")):
            with self.subTest(bad=bad):
                with self.assertRaisesRegex(ValueError, "spillway: size .* is invalid: .*" + why):
                    spillway.parse_size(bad)
        with self.assertRaisesRegex(ValueError, "segments 0 is invalid"):
            spillway.Sequential(mlp(depth=1), 0)

    def test_nondeterministic_shapes_fail_clearly(self):
        calls = []

        def grows(x):
            calls.append(1)
            return (x.repeat(len(calls), 1)).exp()

        x = torch.randn(64, 64, requires_grad=True)
        with spillway.activations(max_resident=0, mode="drop", min_bytes=0):
            y = spillway.checkpoint(grows, x).sum()
        with self.assertRaisesRegex(RuntimeError, "not deterministic"):
            y.backward()


if __name__ == "__main__":
    unittest.main()

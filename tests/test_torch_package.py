"""The spillway Python package on the simulated device: install, SPILLWAY_CONF, budgets, stats and
the allocator's pressure callback to the activations manager. Each case that installs runs in a
fresh interpreter (an allocator is installed once per process).

Run by ctest with spillway's build tree on PYTHONPATH (tests/CMakeLists.txt).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

DECODE_BACKTRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench",
                                "decode_backtrace.py")


def run(code, conf=None, extra_env=None):
    env = dict(os.environ)
    env.pop("SPILLWAY_CONF", None)
    for variable in ("SPILLWAY_CRASH_BACKTRACE", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env.pop(variable, None)
    if conf is not None:
        env["SPILLWAY_CONF"] = conf
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


class Package(unittest.TestCase):
    def check(self, code, conf=None):
        rc, out, err = run(code, conf)
        self.assertEqual(rc, 0, f"stdout:\n{out}\nstderr:\n{err}")
        return out

    def test_install_budget_stats_on_the_simulated_device(self):
        self.check("""
            import spillway, spillway._C as C
            cfg = spillway.install(budget="64MiB", backend="sim", sim_capacity="1GiB")
            assert cfg["budget"] == 64 << 20 and cfg["backend"] == "sim", cfg
            assert spillway.is_installed()
            assert spillway.get_budget() == 64 << 20
            p = C.raw_alloc(8 << 20)
            s = spillway.stats()
            assert s["allocated_bytes.all.current"] == 8 << 20, s
            assert s["budget"] == 64 << 20
            with spillway.budget("32MiB") as report:
                assert report["budget"] == 32 << 20 and report["shortfall"] == 0, report
                assert spillway.get_budget() == 32 << 20
            assert spillway.get_budget() == 64 << 20
            spillway.set_budget(None)
            assert spillway.get_budget() is None
            C.raw_free(p)
            assert spillway.empty_cache() > 0
            assert spillway.stats()["reserved_bytes.all.current"] == 0
            # A block that leaves more in use than the outer budget: restored all the same, with a
            # warning, and the block's own exception goes on as it was.
            import torch, warnings
            spillway.set_budget("64MiB")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with spillway.budget("128MiB"):
                        big = C.raw_alloc(100 << 20)
                        raise KeyError("the block's")
                except KeyError as e:
                    assert "the block's" in str(e), e
            assert spillway.get_budget() == 64 << 20
            assert any("restoring the budget" in str(w.message) for w in caught), caught
            C.raw_free(big)
            assert spillway.get_budget(torch.device("cuda")) == 64 << 20  # the current device
            spillway.set_budget(None)
            for bad in (1, 256, -1):  # one simulated device; 256 is not device 0 in disguise
                try:
                    spillway.stats(bad)
                except ValueError as e:
                    assert str(bad) in str(e), e
                else:
                    raise SystemExit(f"stats({bad}): no error")
        """)

    def test_out_of_memory_is_torch_out_of_memory_error_naming_the_budget(self):
        out = self.check("""
            import torch, spillway, spillway._C as C
            spillway.install(budget="16MiB", backend="sim")
            try:
                C.raw_alloc(64 << 20)
            except torch.OutOfMemoryError as e:
                print(e)
            else:
                raise SystemExit("no error")
            assert spillway.stats()["num_ooms"] == 1
        """)
        self.assertIn("budget 16.00 MiB", out)
        self.assertIn("64.00 MiB", out)

    def test_spillway_conf_is_read_at_import_and_keywords_override_it(self):
        self.check("""
            import spillway
            assert spillway.ENV_CONF.startswith("budget:24MiB")
            cfg = spillway.install(backend="sim")
            assert cfg["budget"] == 24 << 20, cfg
        """, conf="budget:24MiB,backend:cuda")
        self.check("""
            import spillway
            cfg = spillway.install(budget=8 << 20)
            assert cfg["budget"] == 8 << 20 and cfg["backend"] == "sim", cfg
        """, conf="budget:24MiB,backend:sim")

    def test_bad_spillway_conf_fails_at_import_naming_the_key(self):
        rc, out, err = run("import spillway", conf="budget:12 parsecs")
        self.assertNotEqual(rc, 0)
        self.assertIn('bad value "12 parsecs" for key "budget"', err)
        rc, out, err = run("import spillway", conf="budgt:1GiB")
        self.assertNotEqual(rc, 0)
        self.assertIn("budgt", err)

    def test_bad_arguments_and_misuse(self):
        self.check("""
            import spillway
            def raises(kind, text, f, *a, **k):
                try:
                    f(*a, **k)
                except kind as e:
                    assert text in str(e), (text, str(e))
                else:
                    raise AssertionError(f"{f.__name__}{a}{k} did not raise")
            raises(ValueError, "not installed", spillway.set_budget, 1 << 20)
            raises(ValueError, "expandable_segments", spillway.install, backend="sim",
                   expandable_segments="maybe")
            raises(ValueError, 'bad value "tpu" for key "backend"', spillway.install, backend="tpu")
            raises(ValueError, "budget '64MiB' and budget_fraction 0.5 were both given",
                   spillway.install, backend="sim", budget="64MiB", budget_fraction=0.5)
            spillway.install(backend="sim", budget="64MiB")
            raises(ValueError, "already installed", spillway.install, backend="sim")
            raises(ValueError, "size -5 is invalid", spillway.set_budget, -5)
            raises(ValueError, "size 2.5 is invalid: expected a whole number", spillway.set_budget, 2.5)
            raises(ValueError, "size 'lots' is invalid: it does not start", spillway.set_budget, "lots")
            spillway.set_budget(32e6)
            assert spillway.get_budget() == 32_000_000
            raises(ValueError, "invalid device 3", spillway.set_budget, 1 << 20, device=3)
        """)

    def test_backend_cuda_without_a_device_fails_clearly_and_installs_nothing(self):
        # CUDA_VISIBLE_DEVICES="" hides every GPU, so this runs the same with or without one.
        rc, out, err = run("""
            import spillway, torch
            try:
                spillway.install(budget="1GiB")  # backend cuda, the default
            except RuntimeError as e:
                assert "no usable CUDA device" in str(e) and "backend:sim" in str(e), e
            else:
                raise SystemExit("no error")
            assert not spillway.is_installed()
            assert not torch.cuda.is_initialized()
            spillway.install(backend="sim", budget="64MiB")  # nothing was left half-installed
            assert spillway.get_budget() == 64 << 20
        """, extra_env={"CUDA_VISIBLE_DEVICES": ""})
        self.assertEqual(rc, 0, f"stdout:\n{out}\nstderr:\n{err}")

    def test_budget_below_live_memory_is_refused_and_the_old_one_stays(self):
        self.check("""
            import spillway, spillway._C as C
            spillway.install(backend="sim", budget="64MiB")
            p = C.raw_alloc(32 << 20)
            try:
                spillway.set_budget("8MiB")
            except ValueError as e:
                assert "8.00 MiB" in str(e), e
            else:
                raise SystemExit("no error")
            assert spillway.get_budget() == 64 << 20
        """)

    def test_allocator_pressure_calls_the_activations_manager(self):
        # With cpu_tensors the simulated device serves the model's CPU tensors, so a raw
        # allocation over the budget makes the allocator call the manager an activations() block
        # registered, which spills saved activations of that device until the request fits.
        # Storages that are not the device's memory are never evicted for it (nothing is gained).
        self.check("""
            import torch, spillway, spillway._C as C
            spillway.install(backend="sim", budget="16MiB", cpu_tensors=True)
            model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
            with spillway.activations(mode="spill", min_bytes=0) as acts:
                loss = model(torch.randn(256, 512)).sum()
            assert acts.stats()["spills"] == 0
            s = spillway.stats()
            free = s["budget"] - s["allocated_bytes.all.current"]
            held = C.raw_alloc(free - (256 << 10))       # less than 1 MiB is left
            extra = C.raw_alloc(1 << 20)                 # fits once activations are spilled
            s = spillway.stats()
            assert s["num_pressure_handler_calls"] >= 1, s
            spills = acts.stats()["spills"]
            assert spills >= 2, acts.stats()             # two 512 KiB activations at least
            assert s["activations.spills"] >= spills, s
            try:
                C.raw_alloc(8 << 20)                     # nothing can make room for this
            except torch.OutOfMemoryError as e:
                assert "are pinned" in str(e), e         # activations the graph still holds
            else:
                raise SystemExit("no error")
            assert acts.stats()["spills"] == 4, acts.stats()   # every evictable one, no more
            C.raw_free(held)
            C.raw_free(extra)
            loss.backward()                              # spilled activations come back
            assert acts.stats()["restores"] == 4, acts.stats()
            acts.close()
            s = spillway.stats()
            try:
                C.raw_alloc(8 << 20)
            except torch.OutOfMemoryError:
                pass
            assert spillway.stats()["num_pressure_handler_calls"] == s["num_pressure_handler_calls"]
        """)

    def test_pressure_never_evicts_storages_that_are_not_the_devices_memory(self):
        # Without cpu_tensors, CPU tensors are torch's own memory: evicting them would free nothing
        # on the simulated device, so its pressure leaves them resident.
        self.check("""
            import torch, spillway, spillway._C as C
            spillway.install(backend="sim", budget="16MiB")
            model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
            with spillway.activations(mode="spill", min_bytes=0) as acts:
                loss = model(torch.randn(256, 512)).sum()
            held = C.raw_alloc(15 << 20)
            try:
                C.raw_alloc(8 << 20)
            except torch.OutOfMemoryError as e:
                assert "are pinned" not in str(e), e
            else:
                raise SystemExit("no error")
            assert spillway.stats()["num_pressure_handler_calls"] >= 1
            assert acts.stats()["pressure_calls"] >= 1, acts.stats()
            assert acts.stats()["evictions"] == 0, acts.stats()
            loss.backward()
        """)

    def test_pytorch_alloc_conf_shared_keys_are_honoured_below_spillway_conf(self):
        show = """
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import spillway
            c = spillway.install(backend="sim")
        print(c["expandable_segments"], [str(x.message) for x in w if "spillway" in str(x.message)])
        """
        torch_conf = "expandable_segments:True,garbage_collection_threshold:0.6"
        for variable in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            out = self.check_env(show, {variable: torch_conf})
            self.assertTrue(out.startswith("True "), out)
            self.assertIn(f"{variable} keys garbage_collection_threshold tune PyTorch's own", out)
        # SPILLWAY_CONF, then the keywords, win over PyTorch's variable.
        out = self.check_env(show, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                             conf="expandable_segments:False")
        self.assertTrue(out.startswith("False []"), out)
        # max_split_size_mb counts oversize blocks, listed by spillway.stats() under
        # torch.cuda.memory_stats()'s keys.
        out = self.check_env('''
        import spillway, spillway._C as C
        spillway.install(backend="sim", sim_capacity="1GiB")
        p = C.raw_alloc(40 << 20)
        s = spillway.stats()
        print(s["max_split_size"], s["oversize_allocations.current"], s["oversize_segments.current"])
        C.raw_free(p)
        ''', {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:32"})
        self.assertEqual(out.split(), [str(32 << 20), "1", "1"])
        # A bad value of a shared key fails at install, naming PyTorch's variable.
        rc, out, err = run("import spillway; spillway.install(backend='sim')",
                           extra_env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:lots"})
        self.assertNotEqual(rc, 0)
        self.assertIn("PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:lots'", err)
        self.assertIn('bad value "lots" for key "max_split_size_mb"', err)

    def check_env(self, code, extra_env, conf=None):
        rc, out, err = run(code, conf, extra_env)
        self.assertEqual(rc, 0, f"stdout:\n{out}\nstderr:\n{err}")
        return out

    def test_crash_backtrace_prints_the_native_stack_then_the_previous_handler_runs(self):
        segfault = "import ctypes, spillway; ctypes.string_at(0)"
        rc, out, err = run(segfault, extra_env={"SPILLWAY_CRASH_BACKTRACE": "1", "PYTHONFAULTHANDLER": "1"})
        self.assertEqual(rc, -11, err)
        self.assertIn("spillway: fatal signal 11 (fault address 0x0) on thread ", err)
        self.assertIn("; native stack:\n", err)
        # Python's faulthandler, installed first, still runs after it.
        self.assertIn("Fatal Python error: Segmentation fault", err)
        self.assertLess(err.index("spillway: fatal signal"), err.index("Fatal Python error"))
        # bench/decode_backtrace.py names spillway's frames, which the module prints as offsets
        # (hidden symbols), from the JSON a GPU check or benchmark writes its stderr tail into.
        if shutil.which("addr2line"):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "checks.json")
                with open(path, "w") as f:
                    json.dump({"budgets": {"detail": {"50%": {"error": err}}}}, f)
                decoded = subprocess.run([sys.executable, DECODE_BACKTRACE, path], capture_output=True,
                                         text=True, timeout=120).stdout
            self.assertIn(f"== {path}: spillway: fatal signal 11", decoded)
            self.assertRegex(decoded, r"_C\.[^\n]*\(\+0x[0-9a-f]+\)[^\n]*\n +-> spillway::torch_plugin::"
                                      r"[^\n]*on_fatal_signal[^\n]* at [^\n]*crash_backtrace\.cpp:\d+")
        # A signal sent by abort() is sent again once the default action is back.
        rc, out, err = run("import os, spillway; os.abort()", extra_env={"SPILLWAY_CRASH_BACKTRACE": "1"})
        self.assertEqual(rc, -6, err)
        self.assertIn("spillway: fatal signal 6 ", err)
        # Off unless asked for.
        rc, out, err = run(segfault, extra_env={"SPILLWAY_CRASH_BACKTRACE": "0"})
        self.assertEqual(rc, -11, err)
        self.assertNotIn("spillway: fatal signal", err)


if __name__ == "__main__":
    unittest.main()

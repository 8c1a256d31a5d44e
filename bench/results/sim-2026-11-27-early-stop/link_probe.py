# What the activation manager's link meter reads on this machine for CPU tensors served by the
# simulated device: eight 4 MiB storages spilled and copied back, in spill mode, no bandwidth given.
# Usage (from the repository root): PYTHONPATH=build/python .venv/bin/python bench/results/sim-2026-11-27-early-stop/link_probe.py
import torch, spillway
spillway.install(backend="sim", sim_capacity="4GiB", cpu_tensors=True, budget="200MiB")
x = torch.randn(1 << 20, requires_grad=True)
with spillway.activations(mode="spill", min_bytes=0) as acts:
    ys = [(x * i).sin() for i in range(1, 9)]
    acts.evict(1 << 30)
    sum(y.sum() for y in ys).backward()
s = acts.stats()
print({k: s[k] for k in ("spills", "restores", "spill_bytes_per_s", "restore_bytes_per_s")})

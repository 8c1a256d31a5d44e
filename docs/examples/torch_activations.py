"""spillway from Python: the allocator, a budget, and evictable activations.

Runs anywhere: on a GPU spillway becomes PyTorch's CUDA allocator; without one it is installed on
its simulated device (detached from torch) and the activations live on the CPU, where
max_resident is what puts them under pressure. ctest runs it (example_torch_activations).
"""
import torch

import spillway

on_gpu = torch.cuda.is_available()
spillway.install(budget="8GiB", policy="dtr", backend="cuda" if on_gpu else "sim")
device = "cuda" if on_gpu else "cpu"

model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU())
                              for _ in range(8)]).to(device)
x = torch.randn(256, 512, device=device)

with spillway.activations(max_resident="1MiB") as acts:       # saved activations are evictable
    y = spillway.checkpoint_sequential(model, 4, x)           # ... and these can be recomputed
    loss = y.square().mean()
loss.backward()                                               # evicted ones come back on use

print("activations:", {k: acts.stats()[k] for k in ("packed", "spills", "drops", "recomputes")})
with spillway.budget("4GiB") as report:                       # a tighter budget for a while
    print("budget inside:", spillway.get_budget(), "shortfall:", report["shortfall"])
print("budget after:", spillway.get_budget())
assert acts.stats()["evictions"] > 0 and spillway.get_budget() == 8 << 30

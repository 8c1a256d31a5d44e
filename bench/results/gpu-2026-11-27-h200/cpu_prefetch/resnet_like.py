"""A small ResNet-like model (6 residual blocks, BatchNorm, 16 x 3 x 64 x 64) trained with
spillway.activations() and no checkpoint segments, as train_bench trains ResNet-50, with CPU
tensors on the simulated device at 70/50/40% of its unconstrained peak, in each mode.

    PYTHONPATH=build/python .venv/bin/python bench/results/gpu-2026-11-27-h200/cpu_prefetch/resnet_like.py
"""
import sys, torch, spillway
spillway.install(backend="sim", sim_capacity="4GiB", cpu_tensors=True)
torch.manual_seed(0)
class Block(torch.nn.Module):
    def __init__(s, c):
        super().__init__()
        s.c1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False); s.b1 = torch.nn.BatchNorm2d(c)
        s.c2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False); s.b2 = torch.nn.BatchNorm2d(c)
    def forward(s, x):
        y = torch.relu(s.b1(s.c1(x)))
        return torch.relu(x + s.b2(s.c2(y)))
model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
                            *[Block(32) for _ in range(6)], torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                            torch.nn.Linear(32, 10))
x = torch.randn(16, 3, 64, 64)
def step(mode):
    model.zero_grad(set_to_none=True)
    with spillway.activations(mode=mode, min_bytes=0) as acts:
        loss = model(x).square().mean()
    loss.backward()
    return acts.stats()
spillway.set_budget(None); step("spill"); spillway.empty_cache()
spillway.set_budget(None)
import gc; gc.collect(); spillway.empty_cache()
torch_peak = None
s0 = spillway.stats(); 
# peak of one step under no budget
spillway._C.reset_peak_stats(0) if hasattr(spillway._C, "reset_peak_stats") else None
step("spill"); peak = spillway.stats()["reserved_bytes.all.peak"]
print("peak", peak)
for ratio in (0.7, 0.5, 0.4):
    for mode in ("spill", "hybrid", "drop"):
        spillway.set_budget(None); spillway.empty_cache(); spillway.set_budget(int(peak * ratio))
        try:
            st = step(mode)
            keys = ("spills", "drops", "restores", "prefetches", "prefetches_unused")
            if "clean_evictions" in st:  # since 2026-11-27's clean evictions
                keys += ("clean_evictions", "bytes_spilled", "bytes_restored")
            print(ratio, mode, "ok", {k: st[k] for k in keys})
        except torch.OutOfMemoryError as e:
            import traceback; print(ratio, mode, "OOM", "backward" if "backward" in traceback.format_exc() else "forward", str(e)[100:260])
        spillway.set_budget(None)

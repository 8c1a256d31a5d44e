# The transformer of tests/torch_gpu_checks.py (6 layers, d_model 256 here) trained on CPU under
# budgets of 70/50/30/20% of its peak, CPU tensors served by the simulated device
# (cpu_tensors=True). Usage: budget_transformer.py MODE [thread]; PYTHONPATH=<build>/python.
import sys, threading, time, json, torch
import spillway
spillway.install(backend="sim", sim_capacity="8GiB", cpu_tensors=True)
torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
layer = lambda: torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.1, batch_first=True)
model = torch.nn.Sequential(*[layer() for _ in range(6)])
x = torch.randn(8, 128, 256)

def step(spill, segments=None, thread=False):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    if spill is None:
        loss = model(x).float().square().mean()
    else:
        with spillway.activations(**spill):
            y = spillway.checkpoint_sequential(model, segments, x) if segments else model(x)
        loss = y.float().square().mean()
    if thread:
        err = []
        def bw():
            try: loss.backward()
            except BaseException as e: err.append(e)
        t = threading.Thread(target=bw); t.start(); t.join()
        if err: raise err[0]
    else:
        loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]

ref = step(None)
spillway.empty_cache()
s = spillway.stats()
peak = s["reserved_bytes.all.peak"]
print("peak", peak, flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "hybrid"
thread = len(sys.argv) > 2 and sys.argv[2] == "thread"
for ratio in (0.7, 0.5, 0.3, 0.2):
    spillway.set_budget(None); spillway.empty_cache()
    spillway.set_budget(int(peak * ratio))
    try:
        got = step(dict(mode=mode), segments=6, thread=thread)
        same = torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
        print(ratio, mode, "identical" if same else "DIFFERENT", spillway.stats().get("activations.spills"), spillway.stats().get("activations.drops"), flush=True)
    except torch.OutOfMemoryError as e:
        print(ratio, mode, "OOM", str(e)[:200], flush=True)

#!/usr/bin/env python3
"""DenseNet-121 and Inception-v3 at DTR's ratios, compaction off (dtr-models-off/) against on
(dtr-models-on/): per cell (trace, configuration, step, ratio) the best of dtr and dtr-frag, the
cells that fit only one way, and the runs that passed 2x the unconstrained time each way."""
import json, math, os
HERE = os.path.dirname(os.path.abspath(__file__))
runs = {d: json.load(open(os.path.join(HERE, f'dtr-models-{d}', 'results.json')))['runs'] for d in ('off', 'on')}
def cells(rs):
    out = {}
    for r in rs:
        k = (r['trace'], r['config'], r['warmup_steps'], r['ratio'])
        v = r['slowdown'] if r['status'] == 'ok' else math.inf
        out.setdefault(k, []).append(v)
    return {k: min(v) for k, v in out.items()}
off, on = cells(runs['off']), cells(runs['on'])
logs, better, worse, fit_now, lost = [], 0, 0, [], []
for k in sorted(off):
    a, b = off[k], on[k]
    if math.isinf(a) and not math.isinf(b): fit_now.append((k, b))
    elif math.isinf(b) and not math.isinf(a): lost.append((k, a))
    elif not math.isinf(a):
        logs.append(math.log(b / a)); better += b < a * 0.99; worse += b > a * 1.01
print(f'{len(off)} cells (best of dtr, dtr-frag): both fit {len(logs)}, on/off geometric mean '
      f'{math.exp(sum(logs) / len(logs)):.4f}; better by over 1% {better}, worse by over 1% {worse}')
for k, b in fit_now: print(f'  fits only with compaction: {k}: {b:.3f}x')
for k, a in lost: print(f'  out of memory only with compaction: {k}: was {a:.3f}x')
for d in ('off', 'on'):
    over = [r for r in runs[d] if r['status'] == 'ok' and r['slowdown'] > 2]
    print(f'runs over 2x the unconstrained time, compaction {d}: {len(over)} of {len(runs[d])}'
          + ''.join(f"\n  {r['trace']} {r['config']} wu{r['warmup_steps']} {r['policy']} {r['ratio']}: {r['slowdown']:.3f}x" for r in over))
print('At DTR\'s ratios (best of dtr, dtr-frag; DTR: DenseNet-121 1.51x at 0.387, Inception-v3 1.25x at 0.384):')
for k in sorted(off):
    if k[3] in (0.387, 0.384):
        print(f'  {k[0]:13s} {k[1]:26s} {"predicted" if k[2] else "one step":9s} off {off[k]:.3f}  on {on[k]:.3f}')

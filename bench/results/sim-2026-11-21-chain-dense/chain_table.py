#!/usr/bin/env python3
"""The chain target from the dense chain-*.json runs: best drop-only extra compute / rotor's,
at every ratio whose budget is at least rotor's minimum (<= 1.15 is met; out of memory misses)."""
import glob
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
cells = {}   # (trace, ratio) -> {column: text}
mins = {}
columns = []
for path in sorted(glob.glob(os.path.join(here, 'chain-*.json'))):
    name = os.path.basename(path)[len('chain-'):-len('.json')]
    trace, rest = name.split('-fixed-') if '-fixed-' in name else name.split('-expandable-')
    kind = 'fixed' if '-fixed-' in name else 'expandable'
    column = f"{kind}, {'predicted' if rest == 'warmup1' else '1 step'}"
    if column not in columns:
        columns.append(column)
    t = json.load(open(path))['traces'][0]
    rotor = t['rotor']
    mins[(trace, kind)] = rotor['min_ratio']
    for point in rotor['points']:
        ratio = point['ratio']
        runs = [r for r in t['runs'] if r['ratio'] == ratio and r['ok']]
        if ratio * t['peak_reserved'] < rotor['min_budget'] or not point['feasible']:
            text = '(below min)'
        elif not runs:
            text = 'OOM: missed'
        else:
            best = min(runs, key=lambda r: r['extra_compute_ns'])
            x = best['extra_compute_ns'] / point['extra_ns'] if point['extra_ns'] > 0 else (
                0.0 if best['extra_compute_ns'] == 0 else float('inf'))
            text = f"{x:.3f} {best['policy']}" + ('' if x <= 1.15 else ': **missed**')
        cells.setdefault((trace, ratio), {})[column] = text

print('# Chain target at dense budgets (simulated device)\n')
print('Best drop-only extra compute / rotor\'s (dtr, dtr-frag; --verify); met at <= 1.15.')
for trace in sorted({k[0] for k in cells}):
    print(f'\n## {trace}\n')
    print('rotor\'s minimum, ratio of each kind\'s own peak: ' + ', '.join(
        f'{kind} {mins[(trace, kind)]:.3f}' for kind in ('fixed', 'expandable') if (trace, kind) in mins) + '\n')
    print('| ratio | ' + ' | '.join(columns) + ' |')
    print('| --- |' + ' --- |' * len(columns))
    for ratio in sorted(r for t, r in cells if t == trace):
        row = cells[(trace, ratio)]
        print(f'| {ratio} | ' + ' | '.join(row.get(c, '-') for c in columns) + ' |')
    missed = sum('missed' in v for (t, _), row in cells.items() if t == trace for v in row.values())
    total = sum(v != '(below min)' for (t, _), row in cells.items() if t == trace for v in row.values())
    print(f'\nMissed: {missed} of {total} cells at or above rotor\'s minimum.')

#!/usr/bin/env python3
"""Every run here (one step and predicted, per policy) against the same run in
sim-2026-11-21-dependants: the cells whose overhead moved by more than a point, or that ran out of
memory in one and not the other, then the counts. Usage: vs_dependants.py [THIS_DIR] [BEFORE_DIR]"""
import glob
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
before = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, '..', 'sim-2026-11-21-dependants')


def cell(r):
    return 'OOM' if not r['ok'] else f"{100 * r['overhead']:.1f}%"


counts = {'better': 0, 'worse': 0, 'same': 0, 'now runs': 0, 'now OOM': 0}
print('| file | policy | ratio | before | now | |')
print('| --- | --- | --- | --- | --- | --- |')
for path in sorted(glob.glob(os.path.join(before, '*-warmup[01].json'))):
    name = os.path.basename(path)
    mine = os.path.join(here, name)
    if not os.path.exists(mine):
        continue
    old = {(r['policy'], r['ratio']): r for r in json.load(open(path))['traces'][0]['runs']}
    for r in json.load(open(mine))['traces'][0]['runs']:
        a = old.get((r['policy'], r['ratio']))
        if a is None:
            continue
        if a['ok'] and r['ok']:
            d = 100 * (r['overhead'] - a['overhead'])
            tag = 'better' if d < -1 else 'worse' if d > 1 else 'same'
        elif a['ok'] == r['ok']:
            tag = 'same'
        else:
            tag = 'now runs' if r['ok'] else 'now OOM'
        counts[tag] += 1
        if tag != 'same':
            print(f"| {name[:-5]} | {r['policy']} | {r['ratio']} | {cell(a)} | {cell(r)} | {tag} |")
print()
print(', '.join(f'{k}: {v}' for k, v in counts.items()))

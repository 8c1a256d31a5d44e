#!/usr/bin/env python3
"""Compaction's effect: runs of OFF (--no-compact) against ON, matched by file, policy, mode and
ratio. Counts runs that fit / ran out of memory each way, and compares simulated time where both
fit (geometric mean of on/off, and the runs that moved by over 1%), with the moves made."""
import json, math, os, sys
off, on = sys.argv[1], sys.argv[2]
n = both = fit_now = lost = 0
logs = []
moved = []
for f in sorted(os.listdir(off)):
    a = json.load(open(os.path.join(off, f))); b = json.load(open(os.path.join(on, f)))
    for ta, tb in zip(a['traces'], b['traces']):
        for ra, rb in zip(ta['runs'], tb['runs']):
            assert (ra['policy'], ra['mode'], ra['ratio']) == (rb['policy'], rb['mode'], rb['ratio'])
            n += 1
            key = f"{f[:-5]} {ra['policy']}/{ra['mode']} {ra['ratio']}"
            if ra['ok'] and rb['ok']:
                both += 1
                r = rb['time_ns'] / ra['time_ns']
                logs.append(math.log(r))
                if abs(r - 1) > 0.01:
                    moved.append((r, key, ra['extra_compute_ns'] / 1e6, rb['extra_compute_ns'] / 1e6,
                                  rb.get('moves', 0), rb.get('bytes_moved', 0) / 2**20))
            elif rb['ok']:
                fit_now += 1
                print(f"FITS NOW  {key}: {rb['time_ns']/1e6:.3f} ms, {rb.get('moves', 0)} moves")
            elif ra['ok']:
                lost += 1
                print(f"OOM NOW   {key}: was {ra['time_ns']/1e6:.3f} ms")
print(f"{n} runs; both fit {both}; fit only with compaction {fit_now}; out of memory only with it {lost}")
if logs:
    print(f"time on/off where both fit: geometric mean {math.exp(sum(logs)/len(logs)):.4f}, "
          f"{sum(1 for x in logs if x < -0.01)} faster by over 1%, {sum(1 for x in logs if x > 0.01)} slower by over 1%")
for r, key, xa, xb, mv, mb in sorted(moved):
    print(f"  {r:7.3f}x  {key}: extra {xa:.3f} -> {xb:.3f} ms, {mv} moves ({mb:.1f} MiB)")

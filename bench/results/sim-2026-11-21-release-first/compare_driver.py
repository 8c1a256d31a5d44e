#!/usr/bin/env python3
"""driver.sh output before and after: the best (lowest simulated time) drop-only run per segment kind, driver cost and ratio.

    python3 compare_driver.py BEFORE.jsonl AFTER.jsonl   # a markdown table
"""
import json, sys
def load(p):
    best={}
    for l in open(p):
        r=json.loads(l)
        if not r['ok']: continue
        k=(r['expandable'],r['driver_us'],r['ratio'])
        if k not in best or r['time_ns']<best[k]['time_ns']: best[k]=r
    return best
b=load(sys.argv[1]); n=load(sys.argv[2])
print("| segments | driver & sync us | ratio | before: best time ms (policy), syncs, driver allocs | after: best time ms (policy), syncs, driver allocs, releases first | after / before |")
print("|---|---|---|---|---|---|")
for k in sorted(set(b)|set(n)):
    x=b.get(k); y=n.get(k)
    f=lambda r: "%.3f (%s), %d, %d"%(r['time_ns']/1e6,r['policy'],r['device_syncs'],r['device_allocs']) if r else "failed"
    ratio = "%.3f"%(y['time_ns']/x['time_ns']) if x and y else "-"
    print("| %s | %d | %.2f | %s | %s, %s | %s |"%("expandable" if k[0] else "PyTorch's sizes",k[1],k[2],f(x),f(y), y.get('releases_before_eviction','') if y else '', ratio))

#!/usr/bin/env python3
"""Per trace and step setting, drop mode: the geometric mean, worst and best of time after / before
over the runs that fit in both, and the runs lost and won. From the repository root:

    by_trace.py BEFORE.jsonl AFTER.jsonl   (outputs of sim-2026-11-28-sibling-classes/run.sh)
"""
import sys, math, collections
src=open("bench/results/sim-2026-11-28-sibling-classes/compare.py").read()
ns={}; exec(src.split("a=load(sys.argv[1])")[0], ns)
a=ns['load'](sys.argv[1]); b=ns['load'](sys.argv[2])
g=collections.defaultdict(list); lost=collections.Counter(); won=collections.Counter()
for k in a:
    if k not in b or k[3]!='drop': continue
    key=(k[0],k[1])
    if a[k][0]=='ok' and b[k][0]=='ok': g[key].append(math.log((1+b[k][1])/(1+a[k][1])))
    elif a[k][0]=='ok': lost[key]+=1
    elif b[k][0]=='ok': won[key]+=1
for key in sorted(g): print(key, "n=%d geo=%.3f worst=%.3f best=%.3f lost=%d won=%d"%(len(g[key]), math.exp(sum(g[key])/len(g[key])), math.exp(max(g[key])), math.exp(min(g[key])), lost[key], won[key]))

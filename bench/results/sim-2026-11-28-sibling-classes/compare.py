#!/usr/bin/env python3
"""Compares two run.sh outputs (concatenated spillway-evict-sim --json documents), run by run.

    compare.py BEFORE.jsonl AFTER.jsonl

A run is keyed by trace, warm-up steps, policy, mode and budget ratio; it prints the runs that
differ (status, overhead, drops), the counts of runs that fit in each, and the geometric mean of
the time ratio over the runs that fit in both."""
import json
import math
import sys

def load(p):
    txt=open(p).read(); dec=json.JSONDecoder(); i=0; out={}
    while True:
        while i<len(txt) and txt[i].isspace(): i+=1
        if i>=len(txt): break
        o,i=dec.raw_decode(txt,i)
        w=o['warmup_steps']
        for t in o['traces']:
            for r in t['runs']:
                out[(t['name'].split('/')[-1].split('.')[0],w,r['policy'],r['mode'],r['ratio'])]=(r['status'],r['overhead'],r['drops'],r.get('extra_compute_ns'))
    return out
a=load(sys.argv[1]); b=load(sys.argv[2])
same=diff=0; better=worse=0; rows=[]
for k in sorted(a):
    if k not in b: continue
    x,y=a[k],b[k]
    if x==y: same+=1; continue
    diff+=1
    ox=x[1] if x[0]=='ok' else float('inf'); oy=y[1] if y[0]=='ok' else float('inf')
    if oy<ox-1e-9: better+=1
    elif oy>ox+1e-9: worse+=1
    rows.append((k,x,y))
print("same",same,"diff",diff,"better",better,"worse",worse)
for k,x,y in rows:
    f=lambda v: f"{v[0]} {v[1] if v[1] is None else round(v[1],3)} d{v[2]}"
    print(k, f(x), '->', f(y))
oka=sum(1 for v in a.values() if v[0]=='ok'); okb=sum(1 for v in b.values() if v[0]=='ok')
print("runs", len(a), "ok before", oka, "ok after", okb)
both=[(a[k][1],b[k][1]) for k in a if k in b and a[k][0]=='ok' and b[k][0]=='ok']
g=math.exp(sum(math.log((1+y)/(1+x)) for x,y in both)/len(both))
print("ok in both", len(both), "geometric mean of time after / before %.4f" % g)
print("ok -> not ok", sum(1 for k in a if k in b and a[k][0]=='ok' and b[k][0]!='ok'),
      "not ok -> ok", sum(1 for k in a if k in b and a[k][0]!='ok' and b[k][0]=='ok'))

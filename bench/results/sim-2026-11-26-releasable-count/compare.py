import json, os, sys
base, new = sys.argv[1], sys.argv[2]
dev = ['ok', 'time_ns', 'extra_compute_ns', 'stall_ns', 'drops', 'spills', 'recomputes', 'restores', 'evictions',
       'eager_drops', 'bytes_spilled', 'bytes_recomputed', 'peak_reserved', 'decisions', 'upkeep_steps']
runs = same = 0
diff = []
up = {'base': 0.0, 'new': 0.0}
dec = {'base': [], 'new': []}
wall = {'base': 0.0, 'new': 0.0}
for f in sorted(os.listdir(base)):
    a = json.load(open(os.path.join(base, f))); b = json.load(open(os.path.join(new, f)))
    for ta, tb in zip(a['traces'], b['traces']):
        for ra, rb in zip(ta['runs'], tb['runs']):
            runs += 1
            key = (f, ra['policy'], ra['mode'], ra['ratio'])
            assert (rb['policy'], rb['mode'], rb['ratio']) == key[1:]
            d = [k for k in dev if ra.get(k) != rb.get(k)]
            if d: diff.append((key, d))
            else: same += 1
            for n, r in (('base', ra), ('new', rb)):
                up[n] += r.get('upkeep_mean_ns', 0) * r.get('upkeep_steps', 0)
                wall[n] += r.get('wall_seconds', 0)
print(f'{runs} runs, {same} identical in every device-side field ({", ".join(dev)})')
for k, d in diff[:20]: print('DIFF', k, d)
print(f"upkeep total: base {up['base']/1e9:.3f} s, new {up['new']/1e9:.3f} s; wall: base {wall['base']:.2f} s, new {wall['new']:.2f} s")

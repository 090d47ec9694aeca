"""Recompute traces from the committed full benches: each profile's engine profile and every
recompute the daemon calibrated from, in order (-> traces.json, for
`cargo run --release -p kvferry-model --example replay_recompute -- traces.json`)."""
import json, re, glob, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
ansi = re.compile(r'\x1b\[[0-9;]*m')
out = []
for d in sorted(glob.glob(os.path.join(HERE, '..', 'full-2026-12-0*', 'run*', 'runs', '*', ''))):
    prof = d.rstrip('/').split('/')[-1]
    eng = [ansi.sub('', l) for l in open(d + 'region-b-engine.log')]
    dae = [ansi.sub('', l) for l in open(d + 'region-b-daemon.log')]
    a = b = None
    ready = {}
    for l in eng:
        m = re.search(r'a_s_per_token=([0-9.e-]+) b_s_per_pair=([0-9.e-]+)', l)
        if m and a is None: a, b = float(m.group(1)), float(m.group(2))
        m = re.search(r'recompute done session="([^"#]+)#?[^"]*" ready=(\d+) seconds=([0-9.e-]+)', l)
        if m: ready.setdefault(m.group(1), []).append((int(m.group(2)), float(m.group(3))))
    if a is None: continue
    samples = []
    for l in dae:
        m = re.search(r'session="([^"]+)".*?action="recompute".*migration done wall_s=([0-9.e-]+) action=recompute', l)
        if not m: continue
        s = m.group(1)
        if s not in ready: continue
        n, es = ready[s][0]
        samples.append({'session': s, 'n': n, 'wall': float(m.group(2)), 'engine_s': es})
    out.append({'dir': os.path.relpath(d, os.path.join(HERE, '..')), 'profile': prof, 'a': a, 'b': b, 'samples': samples})
json.dump(out, open(os.path.join(HERE, 'traces.json'), 'w'), indent=1)
print(len(out), sum(len(o['samples']) for o in out))
for o in out[:3]: print(o['dir'], [(s['n'], round(s['wall'],3)) for s in o['samples']])

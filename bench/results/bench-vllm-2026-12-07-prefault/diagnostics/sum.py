import re, sys, glob, collections, statistics
for run in sys.argv[1:]:
    log = open(run + ".log").read()
    dec = [l.strip() for l in log.splitlines() if l.startswith("decisions ")]
    print("==", run); [print("  ", d) for d in dec]
    for f in sorted(glob.glob(run + "/runs/*/region-b-engine.log")):
        steps = re.findall(r"kvferry: step (\d+) tokens \d+ pairs ([\d.]+) s", open(f).read())
        by = collections.defaultdict(list)
        for i,(t,s) in enumerate(steps):
            if i < 20: continue  # warm-up
            if int(t) >= 64: by[int(t)].append(float(s))
        rows = []
        for t in sorted(by):
            v = by[t]
            rows.append(f"{t}:{min(v)*1000:.0f}-{max(v)*1000:.0f}ms/{len(v)}")
        print("  ", f.split("/")[-2], " ".join(rows))
    try: print("  ", open(run + ".stats.txt").read().replace("\n", " | "))
    except OSError: pass

import json, datetime
def window_stats(run):
    try: series = json.load(open(run + ".stats.json"))
    except Exception: return
    if not isinstance(series, list): return
    for f in sorted(glob.glob(run + "/runs/*/region-b-daemon.log")):
        ts = re.findall(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z.*migration done", re.sub(r"\x1b\[[0-9;]*m", "", open(f).read()))
        if not ts: continue
        t0 = datetime.datetime.fromisoformat(ts[0]).replace(tzinfo=datetime.timezone.utc).timestamp()
        t1 = datetime.datetime.fromisoformat(ts[-1]).replace(tzinfo=datetime.timezone.utc).timestamp()
        a = min(series, key=lambda s: abs(s[0]-t0)); b = min(series, key=lambda s: abs(s[0]-t1))
        out = []
        for p,(k,u,w) in b[1].items():
            if p in a[1]:
                du = u - a[1][p][1]; dw = w - a[1][p][2]
                if du > 0.05: out.append(f"{k}{p} cpu {du:.1f} wait {dw:.1f}")
        print("   window", f.split("/")[-2], f"{t1-t0:.0f}s:", "; ".join(sorted(out)))
for run in sys.argv[1:]: window_stats(run)

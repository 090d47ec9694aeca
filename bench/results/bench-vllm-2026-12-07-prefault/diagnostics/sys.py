import os, time, sys
def snap():
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit(): continue
        try: tids = os.listdir(f"/proc/{p}/task")
        except OSError: continue
        for t in tids:
            try:
                s = open(f"/proc/{p}/task/{t}/schedstat").read().split()
                comm = open(f"/proc/{p}/task/{t}/comm").read().strip()
                pc = open(f"/proc/{p}/comm").read().strip()
            except OSError: continue
            out[(p, t)] = (pc, comm, int(s[0]), int(s[1]))
    return out
a = snap(); t0 = time.time(); time.sleep(float(sys.argv[1])); b = snap(); dt = time.time() - t0
rows = []
for k, (pc, comm, u, w) in b.items():
    if k in a:
        du, dw = (u - a[k][2]) / 1e9, (w - a[k][3]) / 1e9
        if du > 0.02 or dw > 0.05: rows.append((du, dw, k, pc, comm))
rows.sort(reverse=True)
tot = sum(r[0] for r in rows)
print(f"{dt:.1f}s, total cpu {tot:.2f}s")
for du, dw, k, pc, comm in rows[:25]: print(f"{du:6.2f} cpu {dw:6.2f} wait  {k[0]}/{k[1]} {pc}/{comm}")

import os, sys, time, json
mode = sys.argv[1]  # none | float | cross
out = sys.argv[2]
done = set(); stats = {}; series = []
def tasks(p):
    try: return os.listdir(f"/proc/{p}/task")
    except OSError: return []
def cpu_wait(p):
    u = w = 0
    for t in tasks(p):
        try:
            s = open(f"/proc/{p}/task/{t}/schedstat").read().split()
            u += int(s[0]); w += int(s[1])
        except OSError: pass
    return u/1e9, w/1e9
seen_any = False; idle = 0
while True:
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit(): continue
        try:
            cmd = open(f"/proc/{d}/cmdline","rb").read().replace(b"\0", b" ").decode(errors="replace")
            st = open(f"/proc/{d}/stat").read()
        except OSError: continue
        ppid = int(st.rsplit(")",1)[1].split()[1])
        comm = st.split("(",1)[1].rsplit(")",1)[0]
        if "vllm.entrypoints.openai.api_server" in cmd: procs[int(d)] = ("api", ppid)
        elif comm.startswith("VLLM::EngineCor"): procs[int(d)] = ("engine", ppid)
        elif "kvferry daemon" in cmd: procs[int(d)] = ("daemon", ppid)
        elif "kvferry bench" in cmd: procs[int(d)] = ("bench", ppid)
    if procs: seen_any = True; idle = 0
    elif seen_any:
        idle += 1
        if idle > 10: break
    snap = {}
    for p,(kind,pp) in procs.items():
        stats[p] = (kind,) + cpu_wait(p)
        snap[p] = stats[p]
        if kind == "api" and p not in done and mode != "none":
            kids = [q for q,(k,ppp) in procs.items() if k=="engine" and ppp==p]
            if kids:
                mine = os.sched_getaffinity(kids[0])
                tgt = {0,1} if mode=="float" else ({0,1}-mine or {0,1})
                for t in tasks(p):
                    try: os.sched_setaffinity(int(t), tgt)
                    except OSError: pass
                done.add(p)
    if snap: series.append((time.time(), snap))
    time.sleep(0.5)
json.dump(series, open(out,"w"))
for p,(k,u,w) in sorted(stats.items()): print(p,k,f"cpu {u:.1f}s runq-wait {w:.1f}s")

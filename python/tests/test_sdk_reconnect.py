"""The SDK survives its daemon's restart, over real gRPC on a Unix socket: the other end is a
small Engine servicer playing the daemon (RegisterPool hands out leases, Attach records the
engine's events). The "daemon" is stopped and a new one started on the same socket; the
client must register the same pool again, attach the new lease, and call `on_reattach`, where
the engine publishes again. No kvferry daemon or NIXL needed (the real daemon's side of a
restart is tested with the reference engine in crates/cli/tests/daemon_restart.rs)."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvferry.profile import Fit
from kvferry.sdk import NEVER_RECONNECT, EngineClient, LayoutSpec, ReconnectPolicy
from kvferry.v1 import kvferry_pb2 as pb
from kvferry.v1 import kvferry_pb2_grpc as rpc

SPEC = LayoutSpec(
    kind="vllm_cpu", layers=2, kv_heads=2, head_dim=32, block_size=32, num_blocks=16, dtype="f32"
)


class _Daemon(rpc.EngineServicer):
    """Leases `<name>-<n>`; records registrations and each lease's events; `end()` closes
    every Attach stream and refuses what comes after, as a daemon going away does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.registrations: list[pb.RegisterPoolRequest] = []
        self.events: queue.Queue[pb.EngineEvent] = queue.Queue()
        # Sticky: an Attach that arrives after `end()` (the client attaches on its own thread)
        # ends at once instead of waiting for an end that already happened.
        self._ended = threading.Event()
        self.pool: futures.ThreadPoolExecutor | None = None  # the server's handler threads

    def RegisterPool(self, request, context):
        if self._ended.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is going away")
        self.registrations.append(request)
        return pb.RegisterPoolResponse(lease_id=f"{self.name}-{len(self.registrations)}", lease_ttl_ms=30_000)

    def Attach(self, request_iterator, context):
        def read() -> None:
            try:
                for ev in request_iterator:
                    self.events.put(ev)
            except grpc.RpcError:
                pass

        threading.Thread(target=read, daemon=True).start()
        # Bounded, so that a test that fails before `end()` cannot leave the server's worker
        # (which the interpreter joins at exit) waiting for ever.
        self._ended.wait(timeout=60)
        return
        yield  # a generator: the stream ends when `end()` is called

    def end(self) -> None:
        self._ended.set()


_POOLS: list[futures.ThreadPoolExecutor] = []


@pytest.fixture(autouse=True)
def _shut_the_pools() -> Iterator[None]:
    """Each stand-in daemon's handler threads end with its test: a stopped gRPC server does
    not shut down the executor it was given, whose idle workers otherwise live until it is
    garbage-collected."""
    yield
    while _POOLS:
        _POOLS.pop().shutdown(wait=False, cancel_futures=True)


def _serve(sock: str, name: str) -> tuple[_Daemon, grpc.Server]:
    if os.path.exists(sock):
        os.unlink(sock)
    d = _Daemon(name)
    d.pool = futures.ThreadPoolExecutor(max_workers=8)
    _POOLS.append(d.pool)
    server = grpc.server(d.pool)
    rpc.add_EngineServicer_to_server(d, server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    return d, server


def _event(d: _Daemon, pred, timeout: float = 15.0) -> pb.EngineEvent:
    t = time.time()
    while time.time() - t < timeout:
        try:
            ev = d.events.get(timeout=0.5)
        except queue.Empty:
            continue
        if pred(ev):
            return ev
    raise AssertionError("no such event")


def _register(c: EngineClient):
    return c.register_nixl_pool("e1", "m", SPEC, b'{"agent": "x"}', Fit(1e-4, 0.0, 0))


@pytest.mark.parametrize("how", ["stream closed", "server killed"])
def test_an_engine_registers_again_after_its_daemon_restarts_and_republishes(tmp_path, how):
    sock = str(tmp_path / "engine.sock")
    d1, s1 = _serve(sock, "old")
    c = EngineClient(
        sock, timeout_s=5, reconnect=ReconnectPolicy(initial_s=0.05, max_s=0.2, give_up_after_s=30)
    )
    lease = _register(c)
    reattached: queue.Queue = queue.Queue()

    def republish(new_lease) -> None:
        c.send(pb.EngineEvent(stored=pb.BlockStored(tenant="t", block_hashes=[b"h" * 32], block_ids=[3])))
        reattached.put(new_lease)

    c.attach(lease, on_reattach=republish)
    assert c.attached.is_set()
    assert _event(d1, lambda e: True).lease_id == "old-1"

    # The daemon goes away and a new one comes up on the same socket.
    if how == "stream closed":
        d1.end()
        s1.stop(0)
    else:
        s1.stop(0)
        # The stopped server's handler thread still waits for `end()`; release it, or its
        # executor's worker is joined at interpreter exit and pytest never exits.
        d1.end()
    time.sleep(0.3)  # a moment with no daemon at all: attempts fail and back off
    d2, s2 = _serve(sock, "new")
    new = reattached.get(timeout=15)
    assert new.lease_id == "new-1" and c.lease == new and c.reconnects == 1
    # The same pool was registered again, and the new stream's first event names the new lease.
    assert [r.engine_id for r in d2.registrations] == ["e1"]
    assert d2.registrations[0].nixl.descriptor_json == b'{"agent": "x"}'
    assert d2.registrations[0].layout == SPEC.to_pb()
    assert _event(d2, lambda e: True).lease_id == "new-1"
    # What the engine published again reached the new daemon, on the new lease.
    ev = _event(d2, lambda e: e.WhichOneof("event") == "stored")
    assert (ev.lease_id, list(ev.stored.block_ids)) == ("new-1", [3])
    # Later events go to the new lease too.
    c.report_load(2, 0.5, None)
    assert _event(d2, lambda e: e.WhichOneof("event") == "load").lease_id == "new-1"
    assert not c.detached.is_set()
    c.close()
    assert c.detached.wait(5)
    d2.end()
    s2.stop(0)


def test_a_client_gives_up_after_its_bound_and_never_without_a_registration(tmp_path):
    sock = str(tmp_path / "engine.sock")
    d, s = _serve(sock, "only")
    c = EngineClient(
        sock, timeout_s=5, reconnect=ReconnectPolicy(initial_s=0.05, max_s=0.1, give_up_after_s=0.5)
    )
    c.attach(_register(c))
    d.end()
    s.stop(0)
    assert c.detached.wait(10), "gave up"
    assert c.reconnects == 0
    c.close()
    # Told never to reconnect: detached as soon as the stream ends.
    d, s = _serve(sock, "never")
    c = EngineClient(sock, timeout_s=5, reconnect=NEVER_RECONNECT)
    c.attach(_register(c))
    d.end()
    assert c.detached.wait(5)
    assert len(d.registrations) == 1
    c.close()
    s.stop(0)


def test_the_backoff_doubles_to_its_cap():
    p = ReconnectPolicy(initial_s=0.1, max_s=2.0)
    assert [p.backoff(n) for n in (0, 1, 2, 4, 5, 10_000)] == [0.1, 0.2, 0.4, 1.6, 2.0, 2.0]
    with pytest.raises(ValueError):
        ReconnectPolicy(initial_s=0.0)
    with pytest.raises(ValueError):
        ReconnectPolicy(initial_s=1.0, max_s=0.5)


def test_a_stream_the_daemon_ended_leaves_no_thread_behind(tmp_path):
    # Without close(): the daemon ends the stream and the client, told never to reconnect,
    # detaches. gRPC's thread draining the stream's request iterator must end with it (it
    # used to wait on the event queue for ever, and the interpreter's exit with it).
    sock = str(tmp_path / "engine.sock")
    d, s = _serve(sock, "gone")
    before = set(threading.enumerate())  # the threads themselves: idents are reused
    c = EngineClient(sock, timeout_s=5, reconnect=NEVER_RECONNECT)
    c.attach(_register(c))
    d.end()
    assert c.detached.wait(5)
    s.stop(0).wait(5)
    assert d.pool is not None
    d.pool.shutdown(wait=True)  # the server's own threads: what is left is the client's
    t = time.time()
    while time.time() - t < 10:
        left = [th.name for th in threading.enumerate() if th not in before]
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"threads left by an ended stream: {left}"
    c.close()

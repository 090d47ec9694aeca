"""The SDK's side of CancelRecompute, over a real gRPC Attach stream on a Unix socket: the
stream's other end is a small Engine servicer playing the daemon (it sends a Recompute, then
a CancelRecompute, and records the engine's answers). No kvferry daemon or NIXL needed."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvferry.sdk import EngineClient, Lease
from kvferry.v1 import kvferry_pb2 as pb
from kvferry.v1 import kvferry_pb2_grpc as rpc


class _Daemon(rpc.EngineServicer):
    """Sends `commands` on Attach (the cancel once the recompute is running), records events."""

    def __init__(self) -> None:
        self.commands: queue.Queue[pb.DaemonCommand | None] = queue.Queue()
        self.events: queue.Queue[pb.EngineEvent] = queue.Queue()

    def Attach(self, request_iterator, context):
        def read() -> None:
            try:
                for ev in request_iterator:
                    self.events.put(ev)
            except grpc.RpcError:
                pass  # the engine closed its side at the test's end

        threading.Thread(target=read, daemon=True).start()
        while True:
            try:
                # Bounded: a test that fails before its closing `None` cannot leave the
                # server's worker (which the interpreter joins at exit) waiting for ever.
                cmd = self.commands.get(timeout=60)
            except queue.Empty:
                return
            if cmd is None:
                return
            yield cmd


_POOLS: list[futures.ThreadPoolExecutor] = []


@pytest.fixture(autouse=True)
def _shut_the_pools() -> Iterator[None]:
    """The stand-in daemon's handler threads end with its test (a stopped gRPC server does not
    shut down the executor it was given)."""
    yield
    while _POOLS:
        _POOLS.pop().shutdown(wait=False, cancel_futures=True)


def _serve(tmp_path):
    d = _Daemon()
    pool = futures.ThreadPoolExecutor(max_workers=4)
    _POOLS.append(pool)
    server = grpc.server(pool)
    rpc.add_EngineServicer_to_server(d, server)
    sock = tmp_path / "engine.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    return d, server, str(sock)


def _done(d: _Daemon, timeout: float = 10.0) -> pb.RecomputeDone:
    t = time.time()
    while time.time() - t < timeout:
        ev = d.events.get(timeout=timeout)
        if ev.WhichOneof("event") == "recompute_done":
            return ev.recompute_done
    raise AssertionError("no RecomputeDone")


def _recompute(session: str) -> pb.DaemonCommand:
    return pb.DaemonCommand(recompute=pb.Recompute(session_id=session, tenant="t", token_ids=[1, 2, 3]))


def _cancel(session: str) -> pb.DaemonCommand:
    return pb.DaemonCommand(cancel=pb.CancelRecompute(session_id=session))


def test_a_cancelled_recompute_stops_and_says_so(tmp_path):
    d, server, sock = _serve(tmp_path)
    started, stop = threading.Event(), threading.Event()
    client = EngineClient(sock, timeout_s=5)
    client._lease = Lease("lease-1", b"")

    def handler(cmd: pb.Recompute) -> tuple[int, float, str]:
        started.set()
        stopped = stop.wait(timeout=30)
        return (0, 0.0, "") if stopped else (3, 30.0, "")

    client.attach(client._lease, on_recompute=handler, on_cancel=lambda sid: stop.set())
    d.commands.put(_recompute("s1"))
    assert started.wait(timeout=10)
    t = time.time()
    d.commands.put(_cancel("s1"))
    done = _done(d)
    assert (done.session_id, done.cancelled, done.error) == ("s1", True, "")
    assert time.time() - t < 5, "the cancel is acknowledged when the handler stopped, not at its end"
    # A cancel for a recompute that already answered changes nothing.
    d.commands.put(_cancel("s1"))
    d.commands.put(None)
    client.close()
    server.stop(0)


def test_without_a_cancel_handler_the_recompute_answers_as_usual(tmp_path):
    d, server, sock = _serve(tmp_path)
    go = threading.Event()
    client = EngineClient(sock, timeout_s=5)
    client._lease = Lease("lease-2", b"")

    def handler(cmd: pb.Recompute) -> tuple[int, float, str]:
        go.wait(timeout=30)
        return 3, 0.1, ""

    client.attach(client._lease, on_recompute=handler)
    d.commands.put(_recompute("s2"))
    d.commands.put(_cancel("s2"))
    time.sleep(0.2)
    go.set()
    done = _done(d)
    # No cancel claimed that it did not do.
    assert (done.session_id, done.cancelled, done.tokens) == ("s2", False, 3)
    d.commands.put(None)
    client.close()
    server.stop(0)

"""An engine SDK over kvferry's Engine API (a Unix socket to the local daemon), for any Python
engine: register a pool, hold its lease (the Attach stream), publish stored and withdrawn
blocks (acknowledged), Lookup / Load / Release, report load and a measured prefill profile,
and answer the daemon's Recompute commands.

An engine survives its daemon's restart: when the Attach stream of a pool registered through
this client ends without `close()`, the client registers the same pool again with backoff
(`ReconnectPolicy`), opens a new Attach stream for the new lease with the same handlers, and
calls `on_reattach(lease)`, where the engine publishes again every block it still holds (the
restarted daemon's index starts empty).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from kvferry.profile import Fit
from kvferry.v1 import kvferry_pb2 as pb
from kvferry.v1 import kvferry_pb2_grpc as rpc

log = logging.getLogger("kvferry.sdk")

# Layout kinds the daemon accepts (PoolLayoutSpec.kind).
LAYOUT_KINDS = ("vllm_cpu", "vllm_flash_attn_nhd", "vllm_flash_attn_hnd", "flashinfer_nhd", "flashinfer_hnd")
DTYPES = ("f32", "bf16", "f16", "fp8_e4m3")


class KvferryError(RuntimeError):
    """A daemon call failed; ``code`` is the gRPC status code."""

    def __init__(self, what: str, code: grpc.StatusCode | None, detail: str) -> None:
        super().__init__(f"{what}: {code.name if code else 'error'}: {detail}")
        self.code = code
        self.detail = detail


def _call(what: str, fn: Callable[[], object]) -> object:
    try:
        return fn()
    except grpc.RpcError as e:
        raise KvferryError(what, e.code(), e.details() or "") from e


@dataclass(frozen=True)
class LayoutSpec:
    """`PoolLayoutSpec`: what the pool holds and how (kind and dtype names as the daemon's)."""

    kind: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"layout kind {self.kind!r} is not one of {LAYOUT_KINDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        for k in ("layers", "kv_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, k) <= 0:
                raise ValueError(f"layout {k} must be positive")

    def to_pb(self) -> pb.PoolLayoutSpec:
        return pb.PoolLayoutSpec(
            kind=self.kind,
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
        )

    @property
    def fingerprint_kind(self) -> str:
        """The kind as the fingerprint names it (``vllm_flash_attn_hnd`` → ``vllm_flash_attn/hnd``)."""
        for prefix in ("vllm_flash_attn", "flashinfer"):
            if self.kind.startswith(prefix + "_"):
                return prefix + "/" + self.kind[len(prefix) + 1 :]
        return self.kind


@dataclass(frozen=True)
class Lease:
    lease_id: str
    fingerprint: bytes


@dataclass(frozen=True)
class ReconnectPolicy:
    """How a client whose daemon went away registers again: attempts after `backoff(n)`
    (`initial_s` doubling up to `max_s`) until one succeeds or `give_up_after_s` passed since
    the stream ended; 0 gives up at once (the lease is then gone for good: `detached` is set)."""

    initial_s: float = 0.1
    max_s: float = 2.0
    give_up_after_s: float = 300.0

    def __post_init__(self) -> None:
        if not (self.give_up_after_s >= 0.0 and self.initial_s > 0.0 and self.max_s >= self.initial_s):
            raise ValueError(f"bad reconnect policy {self}")

    def backoff(self, attempt: int) -> float:
        """Seconds before attempt `attempt` (0-based)."""
        return min(self.max_s, self.initial_s * 2.0 ** min(attempt, 62))


NEVER_RECONNECT = ReconnectPolicy(give_up_after_s=0.0)


RecomputeHandler = Callable[[pb.Recompute], tuple[int, float, str]]
"""Runs a recompute: returns (tokens now ready, seconds, error or "")."""

CancelHandler = Callable[[str], None]
"""Stops the running recompute of this session id (the daemon gave up on it at its deadline):
makes its RecomputeHandler return early. The SDK then answers RecomputeDone with `cancelled`."""


class EngineClient:
    """A connection to the local daemon's Engine API."""

    def __init__(
        self, socket_path: str, timeout_s: float = 30.0, reconnect: ReconnectPolicy | None = None
    ) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.reconnect = reconnect if reconnect is not None else ReconnectPolicy()
        # The last RegisterPool request, sent again after the daemon restarted.
        self._registration: pb.RegisterPoolRequest | None = None
        self._closing = threading.Event()
        # Times the pool was registered again after the daemon went away.
        self.reconnects = 0
        # The socket path is no valid :authority for the daemon's HTTP/2 server: name one.
        # gRPC's own reconnect backoff (1 s growing to 120 s by default) would outlast a daemon
        # restart: keep it at the SDK's own scale.
        ms = int(self.reconnect.max_s * 1000)
        self._channel = grpc.insecure_channel(
            f"unix:{socket_path}",
            options=[
                ("grpc.default_authority", "localhost"),
                ("grpc.initial_reconnect_backoff_ms", int(self.reconnect.initial_s * 1000)),
                ("grpc.min_reconnect_backoff_ms", int(self.reconnect.initial_s * 1000)),
                ("grpc.max_reconnect_backoff_ms", ms),
            ],
        )
        self._stub = rpc.EngineStub(self._channel)
        self._events: queue.Queue[pb.EngineEvent | None] | None = None
        self._attach_thread: threading.Thread | None = None
        self._lease: Lease | None = None
        self.attached = threading.Event()
        self.detached = threading.Event()
        # Recomputes running, by session id: whether the daemon cancelled it.
        self._recomputes: dict[str, bool] = {}
        self._recomputes_lock = threading.Lock()

    # ------------------------------------------------------------------ pools and leases

    def register_nixl_pool(
        self,
        engine_id: str,
        model_id: str,
        layout: LayoutSpec,
        descriptor_json: bytes,
        profile: Fit,
    ) -> Lease:
        """`RegisterPool` with NIXL access (DRAM or VRAM, see `kvferry.nixl_pool`)."""
        req = pb.RegisterPoolRequest(
            engine_id=engine_id,
            model_id=model_id,
            layout=layout.to_pb(),
            nixl=pb.NixlAccess(descriptor_json=descriptor_json),
            profile=_profile_pb(profile),
        )
        self._registration = req
        return self._register()

    def _register(self) -> Lease:
        req = self._registration
        assert req is not None
        r = _call("RegisterPool", lambda: self._stub.RegisterPool(req, timeout=max(self.timeout_s, 60.0)))
        assert isinstance(r, pb.RegisterPoolResponse)
        self._lease = Lease(r.lease_id, bytes(r.layout_fingerprint))
        return self._lease

    @property
    def lease(self) -> Lease | None:
        """The lease held now (a new one after each re-registration)."""
        return self._lease

    def attach(
        self,
        lease: Lease,
        on_recompute: RecomputeHandler | None = None,
        on_evict: Callable[[list[bytes]], None] | None = None,
        on_cancel: CancelHandler | None = None,
        on_reattach: Callable[[Lease], None] | None = None,
    ) -> None:
        """Opens the Attach stream (the lease lives as long as it) on a background thread.
        Recompute commands run ``on_recompute`` on their own thread and answer RecomputeDone.
        A CancelRecompute for a running recompute calls ``on_cancel`` (which must make the
        handler return early); its RecomputeDone then carries ``cancelled``. Without
        ``on_cancel`` the recompute runs to its end and answers as usual (never claims a
        cancel it did not do). A recompute cancelled before its thread starts never runs.

        When the stream ends without ``close()`` and the pool was registered through this
        client, the pool is registered again (``reconnect``), a new stream opened with the same
        handlers, and ``on_reattach(new_lease)`` called on the attach thread: publish again
        there every block still held. ``detached`` is set once the client gives up (or closes)."""
        self._lease = lease
        self.attached.clear()
        self.detached.clear()

        def open_stream(
            lease: Lease,
        ) -> tuple[Iterator[pb.DaemonCommand], queue.Queue[pb.EngineEvent | None]]:
            """The new stream and its event queue (the previous stream's queue was ended when
            that stream ended)."""
            events: queue.Queue[pb.EngineEvent | None] = queue.Queue()
            self._events = events
            events.put(pb.EngineEvent(lease_id=lease.lease_id))

            def outgoing() -> Iterator[pb.EngineEvent]:
                while True:
                    ev = events.get()
                    if ev is None:
                        return
                    yield ev

            return self._stub.Attach(outgoing()), events

        def serve(stream: Iterator[pb.DaemonCommand]) -> None:
            for cmd in stream:
                which = cmd.WhichOneof("command")
                if which == "recompute" and on_recompute is not None:
                    with self._recomputes_lock:
                        self._recomputes[cmd.recompute.session_id] = False
                    threading.Thread(
                        target=self._run_recompute,
                        args=(cmd.recompute, on_recompute, on_cancel is not None),
                        daemon=True,
                    ).start()
                elif which == "cancel":
                    sid = cmd.cancel.session_id
                    with self._recomputes_lock:
                        known = sid in self._recomputes
                        if known and on_cancel is not None:
                            self._recomputes[sid] = True
                    log.info("kvferry: the daemon cancelled recompute %r (running: %s)", sid, known)
                    if known and on_cancel is not None:
                        on_cancel(sid)
                elif which == "evict" and on_evict is not None:
                    on_evict(list(cmd.evict.block_hashes))

        def run() -> None:
            lease_now, renewed = lease, False
            try:
                while True:
                    events: queue.Queue[pb.EngineEvent | None] | None = None
                    try:
                        stream, events = open_stream(lease_now)
                        self.attached.set()
                        if renewed and on_reattach is not None:
                            # The new stream's queue is in place: what this publishes rides it.
                            try:
                                on_reattach(lease_now)
                            except Exception:  # the engine's republish; the lease stays attached
                                log.exception("kvferry: on_reattach failed")
                        serve(stream)
                        why = "the daemon closed the Attach stream"
                    except grpc.RpcError as e:
                        why = f"Attach stream ended: {e.code()} {e.details()}"
                        if e.code() == grpc.StatusCode.CANCELLED and self._closing.is_set():
                            return
                    finally:
                        # However the stream ended, its request iterator ends with it: gRPC's
                        # thread that drains it would otherwise wait on the queue for ever, and
                        # be left to the interpreter's finalization.
                        if events is not None:
                            events.put(None)
                    if self._closing.is_set():
                        return
                    log.warning("kvferry: %s", why)
                    again = self._reregister(why)
                    if again is None:
                        return
                    lease_now, renewed = again, True
            finally:
                self.detached.set()

        self._attach_thread = threading.Thread(target=run, name="kvferry-attach", daemon=True)
        self._attach_thread.start()
        self.attached.wait(timeout=self.timeout_s)

    def _reregister(self, why: str) -> Lease | None:
        """Registers the pool again with backoff; the new lease, or None (gave up, closing, or
        nothing to register again)."""
        p = self.reconnect
        if self._registration is None or p.give_up_after_s <= 0.0:
            return None
        t0 = time.monotonic()
        attempt = 0
        while not self._closing.wait(p.backoff(attempt)):
            attempt += 1
            try:
                lease = self._register()
            except KvferryError as e:
                if time.monotonic() - t0 >= p.give_up_after_s:
                    log.error(
                        "kvferry: %s; the daemon did not come back within %.0f s: %s",
                        why,
                        p.give_up_after_s,
                        e,
                    )
                    return None
                log.debug("kvferry: daemon not back yet (attempt %d): %s", attempt, e)
                continue
            self.reconnects += 1
            log.warning("kvferry: registered again with the daemon: lease %s", lease.lease_id)
            return lease
        return None

    def cancelled(self, session_id: str) -> bool:
        """Whether the daemon cancelled the running recompute ``session_id`` (for handlers that
        poll rather than react to ``on_cancel``)."""
        with self._recomputes_lock:
            return self._recomputes.get(session_id, False)

    def _run_recompute(self, cmd: pb.Recompute, handler: RecomputeHandler, cancellable: bool) -> None:
        if cancellable and self.cancelled(cmd.session_id):
            tokens, seconds, error = 0, 0.0, ""
        else:
            try:
                tokens, seconds, error = handler(cmd)
            except Exception as e:  # reported to the daemon, which falls back or fails the session
                tokens, seconds, error = 0, 0.0, f"{type(e).__name__}: {e}"
        with self._recomputes_lock:
            cancelled = self._recomputes.pop(cmd.session_id, False)
        if cancelled:
            error = ""
        self.send(
            pb.EngineEvent(
                recompute_done=pb.RecomputeDone(
                    session_id=cmd.session_id,
                    tokens=tokens,
                    seconds=seconds,
                    error=error,
                    cancelled=cancelled,
                )
            )
        )

    def send(self, ev: pb.EngineEvent) -> None:
        """Queues one event on the Attach stream (unordered w.r.t. unary calls)."""
        if self._events is None or self._lease is None:
            raise KvferryError("Attach", None, "not attached")
        ev.lease_id = self._lease.lease_id
        self._events.put(ev)

    def report_load(self, queue_depth: int, utilization: float, profile: Fit | None) -> None:
        """`LoadReport` on the Attach stream: what is queued now and the measured profile."""
        rep = pb.LoadReport(queue_depth=queue_depth, utilization=utilization)
        if profile is not None:
            rep.profile.CopyFrom(_profile_pb(profile))
        self.send(pb.EngineEvent(load=rep))

    # ------------------------------------------------------------------ acknowledged calls

    def publish(
        self,
        lease_id: str,
        stored: Sequence[tuple[str, Sequence[bytes], Sequence[int]]] = (),
        removed_block_ids: Sequence[int] = (),
        removed_hashes: Sequence[bytes] = (),
        epoch: int = 0,
    ) -> pb.PublishResponse:
        """Withdraws, then stores; returns once the daemon's index changed (see the proto)."""
        req = pb.PublishRequest(
            lease_id=lease_id,
            stored=[pb.BlockStored(tenant=t, block_hashes=list(h), block_ids=list(i)) for t, h, i in stored],
            removed_block_ids=list(removed_block_ids),
            removed_hashes=list(removed_hashes),
            epoch=epoch,
        )
        r = _call("Publish", lambda: self._stub.Publish(req, timeout=self.timeout_s))
        assert isinstance(r, pb.PublishResponse)
        return r

    def lookup(self, lease_id: str, tenant: str, token_ids: Sequence[int]) -> pb.LookupResponse:
        req = pb.LookupRequest(lease_id=lease_id, tenant=tenant, token_ids=list(token_ids))
        r = _call("Lookup", lambda: self._stub.Lookup(req, timeout=self.timeout_s))
        assert isinstance(r, pb.LookupResponse)
        return r

    def load(self, lease_id: str, tenant: str, hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """The daemon writes the ready blocks into ``block_ids``; returns the count loaded
        (all of them, or an error: the blocks are then not valid)."""
        req = pb.LoadRequest(
            lease_id=lease_id, tenant=tenant, block_hashes=list(hashes), block_ids=list(block_ids)
        )
        r = _call("Load", lambda: self._stub.Load(req, timeout=self.timeout_s))
        assert isinstance(r, pb.LoadResponse)
        return r.blocks_loaded

    def release(self, lease_id: str, hashes: Sequence[bytes]) -> None:
        req = pb.ReleaseRequest(lease_id=lease_id, block_hashes=list(hashes))
        _call("Release", lambda: self._stub.Release(req, timeout=self.timeout_s))

    def close(self) -> None:
        """Ends the Attach stream (the lease ends with it) and the channel."""
        self._closing.set()
        if self._events is not None:
            self._events.put(None)
        if self._attach_thread is not None:
            self.detached.wait(timeout=5)
        self._channel.close()


def _profile_pb(p: Fit) -> pb.PrefillProfile:
    return pb.PrefillProfile(
        linear_s_per_token=p.linear_s_per_token,
        attention_s_per_pair=p.attention_s_per_pair,
        samples=p.samples,
        fixed_s=p.fixed_s,
    )

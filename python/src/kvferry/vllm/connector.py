"""`KvferryConnector`: vLLM's KV cache as a kvferry pool.

Scheduler half (in vLLM's EngineCore): asks the local daemon how much of a new request's
prefix is ready beyond vLLM's own hit (`Lookup`), plans the loads into the block ids vLLM
allocated, withdraws every published block vLLM is about to reuse (acknowledged `Publish`,
*before* the step that overwrites it runs), and plans which full blocks to publish.

Worker half (where the KV tensors live): registers them as one pool (NIXL DRAM on CPU, VRAM
on GPU), holds the lease (Attach), loads blocks synchronously before the forward pass that
needs them (a failed, partial or late load is reported through
`get_block_ids_with_load_errors`: vLLM recomputes), publishes the blocks the step completed
after its forward pass (`wait_for_save`; sent from a background thread), times its steps
into a prefill profile and reports it with the queue, and runs the daemon's Recompute
commands through vLLM's own server.

The two halves share only the lease id, through a file in the run dir.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvferry.keys import extend_block_hashes
from kvferry.nixl_pool import NixlPool
from kvferry.profile import Fit, ProfileFit, pairs
from kvferry.republish import LeaseWatch, runs_by_tenant
from kvferry.sdk import EngineClient, KvferryError, Lease, ReconnectPolicy
from kvferry.v1 import kvferry_pb2 as pb
from kvferry.vllm.layout import PoolGeometry, check_config, check_groups, geometry_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so vLLM's logging configuration (handlers, level) applies.
log = logging.getLogger("vllm.kvferry")


class _Announcer:
    """The worker's fire-and-forget traffic to the daemon (stored-block `Publish`), on one
    thread, so vLLM's step never waits on a round trip for it. Safe to delay: each publication
    carries its step's epoch, and the daemon drops a store older than its block id's last
    withdrawal (the scheduler's withdrawals stay synchronous, before the overwriting step)."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client
        self._q: queue.SimpleQueue[tuple[str, list[tuple[str, list[bytes], list[int]]], int] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="kvferry-announce", daemon=True)
        self._thread.start()

    def publish(self, lease_id: str, stored: list[tuple[str, list[bytes], list[int]]], epoch: int) -> None:
        self._q.put((lease_id, stored, epoch))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            lease_id, stored, epoch = item
            try:
                self._client.publish(lease_id, stored=stored, epoch=epoch)
            except KvferryError as e:
                log.warning("kvferry: publishing %d block runs failed: %s", len(stored), e)

    def close(self, timeout_s: float = 5.0) -> None:
        self._q.put(None)
        self._thread.join(timeout_s)


@dataclass
class LoadSpec:
    req_id: str
    tenant: str
    hashes: list[bytes]
    block_ids: list[int]


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    epoch: int = 0
    loads: list[LoadSpec] = field(default_factory=list)
    # (tenant, hashes, block ids) completed by this step, published after its forward pass.
    publish: list[tuple[str, list[bytes], list[int]]] = field(default_factory=list)
    # Prefill shape of the step, for the profile: sum of new tokens and of attention pairs.
    step_tokens: int = 0
    step_pairs: float = 0.0
    queue_depth: int = 0
    # Seconds the scheduler half spent building this metadata (its share of the overhead).
    build_s: float = 0.0


@dataclass
class _Req:
    request: Request
    tenant: str
    local_computed: int
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    published: int = 0


@dataclass
class Settings:
    daemon_socket: str
    engine_id: str
    model_id: str
    run_dir: str
    tenant_default: str
    server_url: str
    served_model: str
    load_timeout_s: float
    report_interval_s: float
    initial_s_per_token: float
    daemon_reconnect_s: float

    @staticmethod
    def of(vllm_config: VllmConfig) -> Settings:
        extra: dict[str, Any] = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        sock = extra.get("daemon_socket") or os.environ.get("KVFERRY_ENGINE_SOCKET", "")
        if not sock:
            raise ValueError(
                "kvferry: kv_connector_extra_config.daemon_socket (the daemon's engine.sock) is required"
            )
        names = vllm_config.model_config.served_model_name
        served = names[0] if isinstance(names, list | tuple) else str(names)
        return Settings(
            daemon_socket=str(sock),
            engine_id=str(extra.get("engine_id", f"vllm-{os.getpid()}")),
            model_id=str(extra.get("model_id", served)),
            run_dir=str(extra.get("run_dir", os.path.dirname(str(sock)))),
            tenant_default=str(extra.get("tenant_default", "")),
            server_url=str(extra.get("server_url", "")),
            served_model=served,
            load_timeout_s=float(extra.get("load_timeout_s", 30.0)),
            report_interval_s=float(extra.get("report_interval_s", 0.25)),
            initial_s_per_token=float(extra.get("initial_s_per_token", 1e-4)),
            daemon_reconnect_s=float(extra.get("daemon_reconnect_s", 300.0)),
        )

    @property
    def lease_file(self) -> str:
        return os.path.join(self.run_dir, f"{self.engine_id}.lease")


class KvferryConnector(KVConnectorBase_V1):
    """An out-of-tree vLLM KV connector backed by the local kvferry daemon."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_config(vllm_config)
        check_groups(kv_cache_config)
        self.s = Settings.of(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        # After a daemon restart the worker registers its pool again (new lease, written to the
        # lease file) and the scheduler half publishes again every block it still lists.
        self.client = EngineClient(
            self.s.daemon_socket,
            timeout_s=self.s.load_timeout_s,
            reconnect=ReconnectPolicy(give_up_after_s=max(0.0, self.s.daemon_reconnect_s)),
        )
        # scheduler state
        self._lease_id: str | None = None
        self._reqs: dict[str, _Req] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._lookup_ext: dict[str, tuple[int, list[bytes]]] = {}
        # Published block id -> (tenant, hash): what the daemon lists for this engine.
        self._published: dict[int, tuple[str, bytes]] = {}
        self._lease_watch = LeaseWatch(self.s.lease_file)
        self._waiting: set[str] = set()
        self._epoch = 0
        self.stats = {"lookups": 0, "withdrawn": 0, "withdraw_calls": 0, "planned_publish": 0}
        # worker state
        self._pool: NixlPool | None = None
        self._geometry: PoolGeometry | None = None
        self._lease: Lease | None = None
        self._announcer: _Announcer | None = None
        self._load_errors: set[int] = set()
        self._step_t0 = 0.0
        self._load_s = 0.0
        self._fit = ProfileFit(skip_first=3)
        self._busy: list[tuple[float, float]] = []
        self._last_report = 0.0
        self._last_queue = -1
        # Time spent in this connector's hooks when nothing is loaded (both halves), per step.
        self.overhead_s = 0.0
        self.overhead_steps = 0
        self.loaded_bytes = 0
        self.loaded_s = 0.0
        log.info(
            "kvferry: connector role %s, daemon %s, engine %s",
            role.name,
            self.s.daemon_socket,
            self.s.engine_id,
        )

    # ============================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        g = geometry_of(kv_caches, self.block_size)
        self._geometry = g
        self._pool = NixlPool(f"{self.s.engine_id}-{os.getpid()}", g.regions, g.mem_type)
        fit = Fit(self.s.initial_s_per_token, 0.0, 0)
        self._lease = self.client.register_nixl_pool(
            self.s.engine_id, self.s.model_id, g.spec, self._pool.descriptor_json(), fit
        )
        self._recompute_conns: dict[str, http.client.HTTPConnection] = {}
        self._recompute_lock = threading.Lock()
        self.client.attach(
            self._lease,
            on_recompute=self._recompute,
            on_cancel=self._cancel_recompute,
            on_reattach=self._reattached,
        )
        self._announcer = _Announcer(self.client)
        self._write_lease_file(self._lease.lease_id)
        log.info(
            "kvferry: registered %s pool (%d layers x %d blocks, %d KV heads, head %d, block %d, %s, "
            "%.1f MiB) "
            "lease %s",
            g.spec.kind,
            g.spec.layers,
            g.spec.num_blocks,
            g.spec.kv_heads,
            g.spec.head_dim,
            g.spec.block_size,
            g.spec.dtype,
            sum(r.length for r in g.regions) / 2**20,
            self._lease.lease_id,
        )

    def _write_lease_file(self, lease_id: str) -> None:
        tmp = self.s.lease_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(lease_id)
        os.replace(tmp, self.s.lease_file)

    def _reattached(self, lease: Lease) -> None:
        """The daemon restarted and the pool is registered again: later loads and publications
        use the new lease; the scheduler half sees the new lease file and publishes again every
        block it still lists (its next step's metadata)."""
        self._lease = lease
        self._write_lease_file(lease.lease_id)
        log.warning("kvferry: registered again with the daemon after it went away: lease %s", lease.lease_id)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step_t0 = time.perf_counter()
        self._load_s = 0.0

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryConnectorMetadata)
        if not meta.loads or self._lease is None:
            return
        t = time.perf_counter()
        for ld in meta.loads:
            try:
                n = self.client.load(self._lease.lease_id, ld.tenant, ld.hashes, ld.block_ids)
                if n != len(ld.block_ids):
                    raise KvferryError("Load", None, f"{n} of {len(ld.block_ids)} blocks loaded")
            except KvferryError as e:
                log.warning(
                    "kvferry: load of %d blocks for %s failed (%s); vLLM recomputes them",
                    len(ld.block_ids),
                    ld.req_id,
                    e,
                )
                self._load_errors.update(ld.block_ids)
        self._load_s = time.perf_counter() - t
        nbytes = sum(len(ld.block_ids) for ld in meta.loads) * (
            self._geometry.block_bytes if self._geometry else 0
        )
        self.loaded_bytes += nbytes
        self.loaded_s += self._load_s
        log.info(
            "kvferry: loaded %d bytes in %.6f s (%.3f GiB/s)",
            nbytes,
            self._load_s,
            nbytes / max(self._load_s, 1e-9) / 2**30,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or self._lease is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryConnectorMetadata)
        now = time.perf_counter()
        try:
            self._after_step(meta, now)
        finally:
            if not meta.loads:
                self._account(time.perf_counter() - now + meta.build_s)

    def _account(self, seconds: float) -> None:
        self.overhead_s += seconds
        self.overhead_steps += 1
        if self.overhead_steps % 200 == 0:
            log.info(
                "kvferry: connector overhead %.1f us/step over %d steps without loads",
                1e6 * self.overhead_s / self.overhead_steps,
                self.overhead_steps,
            )

    def _after_step(self, meta: KvferryConnectorMetadata, now: float) -> None:
        compute_s = now - self._step_t0 - self._load_s
        if meta.publish and self._lease is not None and self._announcer is not None:
            self._announcer.publish(self._lease.lease_id, meta.publish, meta.epoch)
        if meta.step_tokens > 0:
            self._fit.add_sums(meta.step_tokens, meta.step_pairs, compute_s)
            log.debug(
                "kvferry: step %d tokens %.0f pairs %.4f s", meta.step_tokens, meta.step_pairs, compute_s
            )
            self._busy.append((now - compute_s, now))
        self._maybe_report(now, meta.queue_depth)

    def _maybe_report(self, now: float, queue_depth: int) -> None:
        if now - self._last_report < self.s.report_interval_s and queue_depth == self._last_queue:
            return
        window = 5.0
        self._busy = [(a, b) for a, b in self._busy if b > now - window]
        busy = sum(b - max(a, now - window) for a, b in self._busy)
        try:
            self.client.report_load(queue_depth, min(1.0, busy / window), self._fit.fit())
        except KvferryError:
            return
        self._last_report = now
        self._last_queue = queue_depth

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def _recompute(self, cmd: pb.Recompute) -> tuple[int, float, str]:
        """Prefills the prefix in this vLLM through its own server (a one-token completion
        carrying the tenant as cache_salt), so vLLM's prefix cache holds it and the blocks are
        published; answers the tokens now ready."""
        if not self.s.server_url:
            return 0, 0.0, "kvferry: no server_url in kv_connector_extra_config; cannot recompute"
        body: dict[str, Any] = {
            "model": self.s.served_model,
            "prompt": list(cmd.token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
        }
        if cmd.tenant:
            body["cache_salt"] = cmd.tenant
        t = time.perf_counter()
        url = urllib.parse.urlsplit(self.s.server_url.rstrip("/") + "/v1/completions")
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = kind(url.hostname or "127.0.0.1", url.port, timeout=300)
        with self._recompute_lock:
            self._recompute_conns[cmd.session_id] = conn
        try:
            if self.client.cancelled(cmd.session_id):
                return 0, 0.0, ""
            conn.request(
                "POST", url.path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            out = json.loads(conn.getresponse().read())
        except (OSError, http.client.HTTPException):
            if self.client.cancelled(cmd.session_id):
                # The daemon gave up on it: closing the connection made vLLM abort the request.
                return 0, time.perf_counter() - t, ""
            raise
        finally:
            with self._recompute_lock:
                self._recompute_conns.pop(cmd.session_id, None)
            conn.close()
        seconds = time.perf_counter() - t
        if "choices" not in out:
            return 0, seconds, f"kvferry: recompute request failed: {out}"
        ready = (len(cmd.token_ids) // self.block_size) * self.block_size
        return ready, seconds, ""

    def _cancel_recompute(self, session_id: str) -> None:
        """The daemon gave up on a recompute (its deadline passed): close its completion
        request's connection, which makes vLLM abort the request (its OpenAI server cancels a
        request whose client disconnected) and `_recompute` return early."""
        with self._recompute_lock:
            conn = self._recompute_conns.get(session_id)
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: the request ended by itself

    # ============================================================== scheduler side

    def _lease_of_file(self, refresh: bool = False) -> str | None:
        if self._lease_id is None or refresh:
            try:
                with open(self.s.lease_file) as f:
                    self._lease_id = f.read().strip() or None
            except OSError:
                self._lease_id = None
        return self._lease_id

    @staticmethod
    def _tenant(request: Request, default: str) -> str:
        salt = getattr(request, "cache_salt", None)
        return str(salt) if salt else default

    def on_new_request(self, request: Request) -> None:
        self._waiting.add(request.request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tenant = self._tenant(request, self.s.tenant_default)
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None or st.request is not request:
            self._reqs[rid] = _Req(request, tenant, num_computed_tokens)
        else:
            st.local_computed = num_computed_tokens
        bs = self.block_size
        tokens = list(request.prompt_token_ids or [])
        # vLLM must compute at least one token itself: never claim the whole prompt.
        max_blocks = (len(tokens) - 1) // bs if tokens else 0
        start = num_computed_tokens // bs
        if max_blocks <= start or num_computed_tokens % bs:
            return 0, False
        cached = self._lookup_ext.get(rid)
        if cached is not None and cached[0] == num_computed_tokens:
            return len(cached[1]) * bs, False
        lease = self._lease_of_file()
        if lease is None:
            return 0, False
        try:
            r = self.client.lookup(lease, tenant, tokens[: max_blocks * bs])
        except KvferryError as e:
            if e.code is not None and e.code.name == "NOT_FOUND":
                self._lease_of_file(refresh=True)
            log.warning("kvferry: lookup failed (%s); no external tokens", e)
            return 0, False
        self.stats["lookups"] += 1
        ext: list[bytes] = []
        for i in range(start, len(r.block_hashes)):
            if r.in_engine[i]:
                break  # the daemon's view of vLLM's own cache: vLLM did not hit it, so it is gone
            ext.append(bytes(r.block_hashes[i]))
        self._lookup_ext[rid] = (num_computed_tokens, ext)
        return len(ext) * bs, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        cached = self._lookup_ext.pop(rid, None)
        if num_external_tokens <= 0 or cached is None:
            return
        local, hashes = cached
        n = num_external_tokens // self.block_size
        ids = list(blocks.get_block_ids()[0])
        start = local // self.block_size
        if n > len(hashes) or start + n > len(ids):
            log.warning("kvferry: %s: allocation does not cover the planned load; skipping it", rid)
            return
        self._pending_loads[rid] = LoadSpec(
            rid, self._tenant(request, self.s.tenant_default), hashes[:n], ids[start : start + n]
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        t = time.perf_counter()
        meta = self._build(scheduler_output)
        meta.build_s = time.perf_counter() - t
        return meta

    def _build(self, scheduler_output: SchedulerOutput) -> KvferryConnectorMetadata:
        self._epoch += 1
        meta = KvferryConnectorMetadata(epoch=self._epoch)
        bs = self.block_size
        fresh: list[int] = []
        scheduled: list[tuple[_Req, int, int]] = []  # (state, computed before, scheduled now)
        for nr in scheduler_output.scheduled_new_reqs:
            self._waiting.discard(nr.req_id)
            st = self._reqs.get(nr.req_id)
            ids = list(nr.block_ids[0]) if nr.block_ids else []
            local = st.local_computed if st is not None else nr.num_computed_tokens
            fresh.extend(ids[local // bs :])
            if st is not None:
                st.block_ids = ids
                scheduled.append(
                    (st, nr.num_computed_tokens, scheduler_output.num_scheduled_tokens.get(nr.req_id, 0))
                )
        cr = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            new = cr.new_block_ids[i]
            st = self._reqs.get(rid)
            if new is not None:
                fresh.extend(new[0])
                if st is not None:
                    if rid in cr.resumed_req_ids:
                        st.block_ids = list(new[0])
                        st.published = 0
                    else:
                        st.block_ids.extend(new[0])
            if st is not None:
                scheduled.append(
                    (st, cr.num_computed_tokens[i], scheduler_output.num_scheduled_tokens.get(rid, 0))
                )
        # Withdraw every published block vLLM is about to overwrite, acknowledged, now: the
        # worker runs this step's forward pass only after this method returns.
        withdraw = [b for b in fresh if self._published.pop(b, None) is not None]
        if withdraw:
            self._withdraw(withdraw)
        # The worker registered again (the daemon restarted): publish again what is still
        # listed (blocks about to be overwritten were just taken out, so none of them).
        renewed = self._lease_watch.renewed()
        if renewed is not None:
            self._lease_id = renewed
            runs = runs_by_tenant(self._published)
            meta.publish.extend(runs)
            log.warning(
                "kvferry: new lease %s: publishing %d held blocks again",
                renewed,
                sum(len(ids) for _, _, ids in runs),
            )
        for st, before, n in scheduled:
            after = before + n
            meta.step_tokens += n
            meta.step_pairs += pairs(before, n)
            full = min(after, len(st.request.all_token_ids)) // bs
            full = min(full, len(st.block_ids))
            if full <= st.published:
                continue
            toks = list(st.request.all_token_ids[: full * bs])
            extend_block_hashes(st.hashes, st.tenant, toks, bs)
            hs = st.hashes[st.published : full]
            ids = st.block_ids[st.published : full]
            meta.publish.append((st.tenant, hs, ids))
            for b, h in zip(ids, hs, strict=True):
                self._published[b] = (st.tenant, h)
            self.stats["planned_publish"] += len(ids)
            st.published = full
        meta.loads = list(self._pending_loads.values())
        self._pending_loads.clear()
        meta.queue_depth = len(self._waiting)
        return meta

    def _withdraw(self, block_ids: Sequence[int]) -> None:
        lease = self._lease_of_file()
        if lease is None:
            return
        for attempt in range(3):
            try:
                self.client.publish(lease, removed_block_ids=block_ids, epoch=self._epoch)
                self.stats["withdrawn"] += len(block_ids)
                self.stats["withdraw_calls"] += 1
                return
            except KvferryError as e:
                if e.code is not None and e.code.name == "NOT_FOUND":
                    lease = self._lease_of_file(refresh=True) or lease
                log.warning(
                    "kvferry: withdrawing %d reused blocks failed (attempt %d): %s",
                    len(block_ids),
                    attempt + 1,
                    e,
                )
        log.error(
            "kvferry: could not withdraw reused blocks %s; the daemon may still list them (its "
            "owner-side re-check refuses them once they change generation)",
            list(block_ids),
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._lookup_ext.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._waiting.discard(rid)
        return False, None

    def shutdown(self) -> None:
        try:
            if self._announcer is not None:
                self._announcer.close()
                self._announcer = None
            self.client.close()
        finally:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

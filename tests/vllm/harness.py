"""Two kvferry regions on loopback, each a real daemon (`kvferry daemon`) and a real vLLM
OpenAI-compatible server (CPU build) loaded with `KvferryConnector`. Nothing of vLLM is
mocked: requests go through its HTTP API, KV moves through its own cache tensors.

Used by two_region.py (the proof) and bench.py (the measurements).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


# Ports the harness hands out (daemons' listeners, vLLM's API server) come from below the
# kernel's ephemeral range, so nothing that binds port 0 in the meantime (vLLM's
# torch.distributed store and gloo, the other region's vLLM) can take a port chosen here before
# its owner binds it. Each is checked free for TCP and UDP and handed out once per run.
_PORT_LO, _PORT_HI = 20000, 32000
_handed_out: set[int] = set()

# glibc's allocator settings for the vLLM servers (crates/bench/src/vllm.rs has the reasons).
VLLM_MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def _ephemeral_range() -> range:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(lo), int(hi) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port() -> int:
    """A port free for TCP and UDP on loopback, outside the ephemeral range."""
    eph = _ephemeral_range()
    rng = random.Random()
    for _ in range(2000):
        p = rng.randrange(_PORT_LO, _PORT_HI)
        if p in _handed_out or p in eph:
            continue
        try:
            for k in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                with socket.socket(socket.AF_INET, k) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        _handed_out.add(p)
        return p
    raise RuntimeError(f"no free port in {_PORT_LO}..{_PORT_HI}")


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16
    block_size: int
    kv_bytes: int  # vLLM KV cache size


@dataclass
class Region:
    name: str
    root: Path
    bin_dir: Path
    model_dir: Path
    shape: ModelShape
    cpu: str
    peer_name: str = ""
    grpc_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    vllm_port: int = field(default_factory=free_port)
    peer_addr: str = ""
    egress_gbps: float = 0.0
    chunk_bytes: int = 4194304
    # Appended to the daemon's TOML (e.g. a `[faults]` section for fault-injection builds).
    extra_config: str = ""
    # False: a plain vLLM without KvferryConnector (the baseline of the overhead measurement).
    connector: bool = True
    daemon: subprocess.Popen[bytes] | None = None
    vllm: subprocess.Popen[bytes] | None = None

    @property
    def dir(self) -> Path:
        return self.root / self.name

    @property
    def sock(self) -> Path:
        return self.dir / "engine.sock"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.vllm_port}"

    @property
    def router_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def engine_id(self) -> str:
        return f"vllm-{self.name}"

    def write_config(self) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = f"""region = "{self.name}"
trust_domain = "kvferry.vllm"
run_dir = "{self.dir}"
[listen]
grpc = "{self.router_addr}"
peer = "127.0.0.1:{self.peer_port}"
http = "127.0.0.1:{self.http_port}"
[tls]
mode = "dev"
dev_dir = "{self.root / "dev-ca"}"
[[peers]]
region = "{self.peer_name}"
addr = "{self.peer_addr}"
gbps = 10.0
rtt_ms = 1.0
max_egress_gbps = {self.egress_gbps}
[limits]
staging_bytes = 33554432
landing_zone_bytes = 268435456
[transfer]
idle_timeout_ms = 5000
chunk_bytes = {self.chunk_bytes}
{self.extra_config}
"""
        p = self.dir / "kvferry.toml"
        p.write_text(cfg)
        return p

    def start_daemon(self, env: dict[str, str]) -> None:
        cfg = self.write_config()
        log = open(self.dir / "daemon.log", "ab")
        e = dict(env)
        e.setdefault("RUST_LOG", "info")
        self.daemon = subprocess.Popen(
            [str(self.bin_dir / "kvferry"), "daemon", "--config", str(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=e,
            start_new_session=True,
        )
        wait_for(self.daemon_ready, f"daemon {self.name}", 60, [self.daemon], [self.dir / "daemon.log"])

    def daemon_ready(self) -> bool:
        """`/readyz`: every listener bound and serving (engine.sock is bound before the others)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/readyz", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def kv_transfer_config(self) -> str:
        return json.dumps(
            {
                "kv_connector": "KvferryConnector",
                "kv_connector_module_path": "kvferry.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "daemon_socket": str(self.sock),
                    "engine_id": self.engine_id,
                    "model_id": self.shape.name,
                    "server_url": self.url,
                },
            }
        )

    def vllm_cmd(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.shape.name,
            "--dtype",
            self.shape.dtype,
            "--enforce-eager",
            "--max-model-len",
            "2048",
            "--block-size",
            str(self.shape.block_size),
            "--kv-cache-memory-bytes",
            str(self.shape.kv_bytes),
            "--max-num-seqs",
            "8",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.vllm_port),
            *(["--kv-transfer-config", self.kv_transfer_config()] if self.connector else []),
            "--disable-log-stats",
            "--enable-prompt-tokens-details",
        ]

    def start_vllm(self, env: dict[str, str]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "vllm.log", "ab")
        e = dict(env)
        e["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu
        e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The single-process engine ignores VLLM_CPU_OMP_THREADS_BIND (only vLLM's multi-process
        # executor binds): one OpenMP thread on this region's CPU, set here, and glibc's
        # allocator kept from handing each step's memory back to the kernel (the bench's
        # settings, `kvferry_bench::vllm::VLLM_MALLOC_TUNABLES`; see its doc).
        e["OMP_NUM_THREADS"] = "1"
        e["GLIBC_TUNABLES"] = VLLM_MALLOC_TUNABLES
        e.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        cpus = {int(self.cpu)} & os.sched_getaffinity(0) if self.cpu.isdigit() else set()
        self.vllm = subprocess.Popen(
            self.vllm_cmd(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=e,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )

    def wait_vllm(self) -> None:
        def up() -> bool:
            try:
                http_json(self.url + "/v1/models", timeout=2)
                return True
            except (urllib.error.URLError, OSError, ValueError):
                return False

        wait_for(
            up,
            f"vLLM {self.name}",
            240,
            [p for p in (self.vllm, self.daemon) if p],
            [self.dir / "vllm.log", self.dir / "daemon.log"],
        )

    def complete(self, tokens: list[int], max_tokens: int, tenant: str = "", **kw: Any) -> dict[str, Any]:
        """Greedy completion; returns tokens, cached_tokens and wall seconds."""
        body: dict[str, Any] = {
            "model": self.shape.name,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        if tenant:
            body["cache_salt"] = tenant
        body.update(kw)
        t = time.perf_counter()
        out = http_json(self.url + "/v1/completions", body)
        wall = time.perf_counter() - t
        ch = out["choices"][0]
        usage = out.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return {
            "tokens": list(ch.get("token_ids") or []),
            "cached_tokens": int(details.get("cached_tokens") or 0),
            "wall_s": wall,
            "prompt_tokens": usage.get("prompt_tokens"),
        }

    def ttft(self, tokens: list[int], tenant: str = "") -> float:
        """Time to first token of a streamed completion."""
        body = {
            "model": self.shape.name,
            "prompt": tokens,
            "max_tokens": 2,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
        }
        if tenant:
            body["cache_salt"] = tenant
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: ") and b"choices" in line:
                    first = time.perf_counter() - t
                    r.read()
                    return first
        raise RuntimeError("no token streamed")

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=30).read()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str) -> float:
        for line in self.metrics().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self, which: str = "all") -> None:
        for attr in ["vllm", "daemon"] if which == "all" else [which]:
            p = getattr(self, attr)
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            setattr(self, attr, None)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({e})"


def wait_for(
    cond: Any, what: str, timeout: float, procs: list[subprocess.Popen[bytes]], logs: list[Path] | None = None
) -> None:
    """Waits for `cond`; fails when a process exits or the time is up, with the end of each
    log in the error (a CI run keeps only what is printed)."""

    def fail(why: str) -> RuntimeError:
        tails = "".join(f"\n--- last lines of {p} ---\n{log_tail(p)}" for p in logs or [])
        return RuntimeError(f"{what}: {why}{tails}")

    t = time.time()
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise fail(f"a process exited ({p.returncode}) while starting")
        if time.time() - t > timeout:
            raise fail("timed out")
        time.sleep(0.2)


def pair(
    root: Path, bin_dir: Path, model_dir: Path, shape: ModelShape, egress_gbps_a: float = 0.0
) -> tuple[Region, Region]:
    a = Region("region-a", root, bin_dir, model_dir, shape, cpu="0", egress_gbps=egress_gbps_a)
    b = Region("region-b", root, bin_dir, model_dir, shape, cpu="1")
    a.peer_name, b.peer_name = b.name, a.name
    a.peer_addr, b.peer_addr = f"127.0.0.1:{b.peer_port}", f"127.0.0.1:{a.peer_port}"
    return a, b


def copy_bins(target: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for b in ("kvferry", "kvferry-nixl-engine"):
        shutil.copy2(target / b, out / b)
    return out

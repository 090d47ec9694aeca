"""Registers engine memory with NIXL through NIXL's own Python API (what vLLM's NixlConnector
does) and produces the descriptor the daemon's `RegisterPool` accepts (`NixlAccess`).

DRAM (host memory, e.g. vLLM CPU's KV buffer) and VRAM (CUDA device memory: ``mem_type
"VRAM"`` with the device id) go through the same call; the daemon attaches with its own NIXL
agent and moves bytes with UCX.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any


class NixlUnavailable(RuntimeError):
    """NIXL's Python API (PyPI ``nixl-cu12``) cannot be imported or started."""


def _nixl() -> tuple[Any, Any]:
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config  # PyPI nixl-cu12
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config  # other NIXL wheels
        except ImportError as e:  # pragma: no cover - depends on the host
            raise NixlUnavailable(
                "NIXL's Python API is not installed (pip install 'kvferry[nixl]' or deploy/install-nixl.sh)"
            ) from e
    return nixl_agent, nixl_agent_config


@dataclass(frozen=True)
class Region:
    """One registered range: address, length, and (VRAM) the CUDA device."""

    addr: int
    length: int
    device: int = 0


class NixlPool:
    """Memory regions registered with a NIXL agent of this process, for the daemon to reach.

    Keep the object alive (and the memory allocated) as long as the pool's lease: the daemon
    reads and writes these ranges while it is registered.
    """

    def __init__(
        self,
        agent_name: str,
        regions: list[Region],
        mem_type: str = "DRAM",
        progress_interval_s: float = 0.005,
    ) -> None:
        """``progress_interval_s``: how often this agent's UCX worker is progressed (it only
        answers the daemon's connection wire-up; the data path is one-sided). NIXL's Python
        agent would otherwise run a progress thread that spins with no delay — a whole core
        on a CPU host. 0 keeps NIXL's own thread."""
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type {mem_type!r} is not DRAM or VRAM")
        if not regions or any(r.length <= 0 or r.addr <= 0 for r in regions):
            raise ValueError("a NIXL pool needs regions with a non-zero address and length")
        if mem_type == "DRAM" and any(r.device != 0 for r in regions):
            raise ValueError("DRAM regions have device 0")
        nixl_agent, nixl_agent_config = _nixl()
        self.agent_name = agent_name
        self.regions = list(regions)
        self.mem_type = mem_type
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        try:
            own_thread = progress_interval_s <= 0
            self._agent = nixl_agent(
                agent_name, nixl_agent_config(enable_prog_thread=own_thread, backends=["UCX"])
            )
            self._reg = self._agent.register_memory(
                [(r.addr, r.length, r.device, "") for r in self.regions], mem_type
            )
        except Exception as e:  # NIXL raises its own types
            raise NixlUnavailable(f"NIXL agent {agent_name!r}: {e}") from e
        if not own_thread:
            self._ticker = threading.Thread(
                target=self._progress, args=(progress_interval_s,), name="kvferry-nixl-progress", daemon=True
            )
            self._ticker.start()

    def _progress(self, interval_s: float) -> None:
        # get_new_notifs progresses the backends' workers (and drains notifications, which
        # kvferry does not use).
        while not self._stop.wait(interval_s):
            try:
                self._agent.get_new_notifs()
            except Exception:  # NIXL raises its own types; a closed agent ends the ticker
                return

    def descriptor(self) -> dict[str, Any]:
        """kvferry_pool_nixl::NixlPoolDescriptor as a dict."""
        if self._agent is None:
            raise RuntimeError(f"NIXL pool {self.agent_name!r} is closed")
        return {
            "agent_name": self.agent_name,
            "agent_metadata": self._agent.get_agent_metadata().hex(),
            "regions": [
                {"addr": r.addr, "len": r.length, "mem_type": self.mem_type.lower(), "dev": r.device}
                for r in self.regions
            ],
        }

    def descriptor_json(self) -> bytes:
        """The descriptor as the JSON bytes `NixlAccess.descriptor_json` carries."""
        return json.dumps(self.descriptor()).encode()

    def close(self) -> None:
        """Deregisters the memory (after the lease ended)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(1.0)
            self._ticker = None
        reg, self._reg = self._reg, None
        if reg is not None:
            self._agent.deregister_memory(reg)
        # The agent (its UCX worker and threads) goes now, not in the interpreter's
        # finalization, where a teardown that waits on anything can hang the process's exit.
        self._agent = None

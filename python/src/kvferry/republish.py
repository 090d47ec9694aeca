"""What an engine publishes again after its daemon restarted, as pure helpers (no vLLM, no
gRPC): the runs of blocks it still holds (`runs_by_tenant`), and noticing that the worker
registered again under a new lease (`LeaseWatch`, over the lease file the worker rewrites).

A block is republished only while it is in the engine's published set; the engine removes a
block from that set *before* the step that overwrites it (its withdrawal), so a republished
block id always still holds the bytes its hash names."""

from __future__ import annotations

import os
from collections.abc import Mapping


def runs_by_tenant(published: Mapping[int, tuple[str, bytes]]) -> list[tuple[str, list[bytes], list[int]]]:
    """(tenant, hashes, block ids) per tenant, tenants in name order and blocks by id: the
    `stored` argument of a Publish that announces every held block again."""
    by: dict[str, list[tuple[int, bytes]]] = {}
    for block, (tenant, h) in published.items():
        by.setdefault(tenant, []).append((block, h))
    out = []
    for tenant in sorted(by):
        blocks = sorted(by[tenant])
        out.append((tenant, [h for _, h in blocks], [b for b, _ in blocks]))
    return out


class LeaseWatch:
    """Watches the lease file: `renewed()` returns the new lease id once per change of lease
    after the first one seen (a re-registration), else None. A stat per call; the file is read
    only when it changed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self.lease: str | None = None

    def renewed(self) -> str | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            with open(self.path) as f:
                lease = f.read().strip() or None
        except OSError:
            return None
        if lease is None or lease == self.lease:
            return None
        first = self.lease is None
        self.lease = lease
        return None if first else lease

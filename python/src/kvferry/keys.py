"""kvferry's content keys and layout fingerprints, byte-identical to the Rust crate
`kvferry_layout` (`block_hashes`, `LayoutFingerprint::digest`); both are checked against the
same known-answer vectors (crates/layout/testdata/kat.json).

Block keys, version 1 (chained, seedless SHA-256; only full blocks have keys):
- ``h0 = SHA256(u64le(len(salt)) || salt || u64le(n) || u32le(t0) .. u32le(t_{n-1}))``
- ``hi = SHA256(h_{i-1} || u64le(n) || u32le tokens of block i)`` with ``n = block_size``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes


def block_hashes(tenant_salt: bytes | str, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Keys of the full blocks of ``token_ids``, chained from the tenant's salt."""
    if block_size <= 0:
        raise ValueError("block_hashes: block_size must be positive")
    salt = tenant_salt.encode() if isinstance(tenant_salt, str) else tenant_salt
    out: list[BlockHash] = []
    n = len(token_ids) // block_size
    fmt = "<" + "I" * block_size
    size = struct.pack("<Q", block_size)
    for i in range(n):
        h = hashlib.sha256()
        if out:
            h.update(out[-1])
        else:
            h.update(struct.pack("<Q", len(salt)))
            h.update(salt)
        h.update(size)
        h.update(struct.pack(fmt, *token_ids[i * block_size : (i + 1) * block_size]))
        out.append(h.digest())
    return out


def extend_block_hashes(
    parents: list[BlockHash], tenant_salt: bytes | str, token_ids: Sequence[int], block_size: int
) -> list[BlockHash]:
    """``block_hashes(salt, token_ids, bs)`` given its first ``len(parents)`` keys already
    computed (appends to and returns ``parents``): O(new blocks) per call."""
    have = len(parents)
    if have == 0:
        parents.extend(block_hashes(tenant_salt, token_ids, block_size))
        return parents
    size = struct.pack("<Q", block_size)
    fmt = "<" + "I" * block_size
    for i in range(have, len(token_ids) // block_size):
        h = hashlib.sha256(parents[-1])
        h.update(size)
        h.update(struct.pack(fmt, *token_ids[i * block_size : (i + 1) * block_size]))
        parents.append(h.digest())
    return parents


def fingerprint_digest(
    model_id: str, dtype: str, layers: int, kv_heads: int, head_dim: int, block_size: int, kind: str
) -> str:
    """Lowercase hex SHA-256 of a layout fingerprint (``kind`` in its display form, e.g.
    ``vllm_cpu`` or ``vllm_flash_attn/hnd``)."""
    h = hashlib.sha256()

    def field(b: bytes) -> None:
        h.update(struct.pack("<Q", len(b)))
        h.update(b)

    field(b"kvferry-layout-fingerprint-v1")
    field(model_id.encode())
    field(dtype.encode())
    for v in (layers, kv_heads, head_dim, block_size):
        field(struct.pack("<I", v))
    field(kind.encode())
    return h.hexdigest()

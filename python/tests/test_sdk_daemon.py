"""The SDK against a real daemon (no vLLM): a NIXL DRAM pool in the vllm_cpu layout,
acknowledged publish / withdraw, Lookup, and the refusals. Needs the kvferry binaries
(KVFERRY_BIN_DIR, as tests/vllm/run.sh sets) and NIXL's Python API; fails without them."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvferry.keys import block_hashes, fingerprint_digest
from kvferry.nixl_pool import NixlPool, Region
from kvferry.profile import Fit
from kvferry.sdk import EngineClient, KvferryError, LayoutSpec


def _bin_dir() -> Path:
    d = os.environ.get("KVFERRY_BIN_DIR")
    assert d, (
        "set KVFERRY_BIN_DIR to a directory holding kvferry and kvferry-nixl-engine (tests/vllm/run.sh does)"
    )
    return Path(d)


def _port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("daemon")
    cfg = d / "kvferry.toml"
    cfg.write_text(
        f'region = "r"\ntrust_domain = "kvferry.sdk"\nrun_dir = "{d}"\n[listen]\n'
        f'grpc = "127.0.0.1:{_port(socket.SOCK_STREAM)}"\npeer = "127.0.0.1:{_port(socket.SOCK_DGRAM)}"\n'
        f'http = "127.0.0.1:{_port(socket.SOCK_STREAM)}"\n[tls]\nmode = "dev"\ndev_dir = "{d / "ca"}"\n'
    )
    env = dict(os.environ, KVFERRY_NIXL_METADATA_CHECKER=str(_bin_dir() / "kvferry-nixl-engine"))
    log = open(d / "daemon.log", "wb")
    p = subprocess.Popen(
        [str(_bin_dir() / "kvferry"), "daemon", "--config", str(cfg)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    sock = d / "engine.sock"
    t = time.time()
    while not sock.exists():
        assert p.poll() is None, (d / "daemon.log").read_text()
        assert time.time() - t < 60
        time.sleep(0.1)
    yield sock
    p.terminate()
    p.wait(timeout=10)


SPEC = LayoutSpec(
    kind="vllm_cpu", layers=2, kv_heads=2, head_dim=32, block_size=32, num_blocks=16, dtype="f32"
)


def _pool(name: str) -> tuple[NixlPool, ctypes.Array]:
    n = SPEC.layers * SPEC.num_blocks * 2 * SPEC.kv_heads * SPEC.block_size * SPEC.head_dim * 4
    buf = (ctypes.c_char * n)()
    return NixlPool(name, [Region(ctypes.addressof(buf), n)], "DRAM"), buf


def test_register_publish_withdraw_lookup(daemon):
    pool, _buf = _pool("sdk-test-1")
    c = EngineClient(str(daemon))
    lease = c.register_nixl_pool("e1", "m", SPEC, pool.descriptor_json(), Fit(1e-4, 0.0, 0))
    assert lease.fingerprint.hex() == fingerprint_digest("m", "f32", 2, 2, 32, 32, "vllm_cpu")
    c.attach(lease)
    toks = list(range(100, 100 + 4 * 32))
    hs = block_hashes("ten", toks, 32)
    r = c.publish(lease.lease_id, stored=[("ten", hs, [3, 4, 5, 6])], epoch=1)
    assert (r.stored, r.stale) == (4, 0)
    look = c.lookup(lease.lease_id, "ten", toks)
    assert look.ready_tokens == 128 and all(look.in_engine)
    assert c.lookup(lease.lease_id, "other", toks).ready_tokens == 0
    # withdraw block id 4 (the 2nd block): the ready prefix stops before it, acknowledged
    r = c.publish(lease.lease_id, removed_block_ids=[4], epoch=2)
    assert r.removed == 1
    assert c.lookup(lease.lease_id, "ten", toks).ready_tokens == 32
    # a late publication from before the withdrawal is dropped, a later one applies
    r = c.publish(lease.lease_id, stored=[("ten", hs[1:2], [4])], epoch=1)
    assert (r.stored, r.stale) == (0, 1)
    r = c.publish(lease.lease_id, stored=[("ten", hs[1:2], [4])], epoch=3)
    assert r.stored == 1
    assert c.lookup(lease.lease_id, "ten", toks).ready_tokens == 128
    with pytest.raises(KvferryError) as e:
        c.publish(lease.lease_id, stored=[("ten", hs[:1], [SPEC.num_blocks])])
    assert e.value.code is not None and e.value.code.name == "INVALID_ARGUMENT"
    with pytest.raises(KvferryError) as e:
        c.lookup("no-such-lease", "ten", toks)
    assert e.value.code.name == "NOT_FOUND"
    c.close()
    pool.close()


def test_a_pool_too_small_for_its_layout_is_refused(daemon):
    pool, _buf = _pool("sdk-test-2")
    big = LayoutSpec(**{**SPEC.__dict__, "num_blocks": SPEC.num_blocks * 2})
    c = EngineClient(str(daemon))
    with pytest.raises(KvferryError) as e:
        c.register_nixl_pool("e2", "m", big, pool.descriptor_json(), Fit(1e-4, 0.0, 0))
    assert e.value.code.name == "INVALID_ARGUMENT"
    c.close()
    pool.close()


def test_layout_spec_validates():
    with pytest.raises(ValueError):
        LayoutSpec(kind="nope", layers=1, kv_heads=1, head_dim=1, block_size=1, num_blocks=1, dtype="f32")
    assert (
        LayoutSpec(**{**SPEC.__dict__, "kind": "vllm_flash_attn_hnd"}).fingerprint_kind
        == "vllm_flash_attn/hnd"
    )

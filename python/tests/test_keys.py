"""Block keys and fingerprints against the known-answer vectors the Rust tests also check."""

import json
import pathlib

import pytest

from kvferry.keys import block_hashes, extend_block_hashes, fingerprint_digest

KAT = pathlib.Path(__file__).resolve().parents[2] / "crates" / "layout" / "testdata" / "kat.json"


def kat() -> dict:
    return json.loads(KAT.read_text())


def test_block_hashes_match_the_shared_vectors():
    vectors = kat()["block_hashes"]
    assert len(vectors) >= 5
    for v in vectors:
        got = [h.hex() for h in block_hashes(v["tenant"], v["token_ids"], v["block_size"])]
        assert got == v["hashes"], v["tenant"]


def test_incremental_hashing_equals_full():
    for v in kat()["block_hashes"]:
        toks, bs = v["token_ids"], v["block_size"]
        for cut in range(0, len(toks) + 1, max(1, bs // 2)):
            parents = block_hashes(v["tenant"], toks[:cut], bs)
            assert extend_block_hashes(parents, v["tenant"], toks, bs) == block_hashes(v["tenant"], toks, bs)


def test_fingerprints_match_the_shared_vectors():
    for v in kat()["fingerprints"]:
        got = fingerprint_digest(
            v["model_id"], v["dtype"], v["layers"], v["kv_heads"], v["head_dim"], v["block_size"], v["kind"]
        )
        assert got == v["digest"]


def test_tenant_changes_every_key_and_block_size_is_checked():
    a = block_hashes("a", list(range(64)), 16)
    b = block_hashes("b", list(range(64)), 16)
    assert not set(a) & set(b)
    with pytest.raises(ValueError):
        block_hashes("a", [1], 0)

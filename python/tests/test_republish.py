"""The pure helpers behind the vLLM connector's republish after a daemon restart."""

from __future__ import annotations

import os

from kvferry.republish import LeaseWatch, runs_by_tenant


def test_runs_group_blocks_by_tenant_in_id_order():
    published = {7: ("b", b"h7"), 3: ("a", b"h3"), 1: ("a", b"h1"), 9: ("b", b"h9")}
    assert runs_by_tenant(published) == [("a", [b"h1", b"h3"], [1, 3]), ("b", [b"h7", b"h9"], [7, 9])]
    assert runs_by_tenant({}) == []


def _write(path, lease: str) -> None:
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        f.write(lease)
    os.replace(tmp, path)


def test_a_lease_watch_reports_each_new_lease_once_after_the_first(tmp_path):
    p = tmp_path / "e.lease"
    w = LeaseWatch(str(p))
    assert w.renewed() is None, "no file yet"
    _write(p, "lease-1")
    assert w.renewed() is None, "the first lease is no re-registration"
    assert w.lease == "lease-1"
    assert w.renewed() is None, "unchanged"
    _write(p, "lease-2")
    assert w.renewed() == "lease-2"
    assert w.renewed() is None, "reported once"
    _write(p, "lease-2")
    assert w.renewed() is None, "rewritten with the same lease"
    _write(p, "lease-3")
    assert w.renewed() == "lease-3"

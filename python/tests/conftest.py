"""Suite-wide checks.

Every thread a test starts must be gone when the suite ends. A thread left blocked (gRPC's
drain of an Attach stream's request iterator, a NIXL progress ticker, a servicer's handler
waiting on an event) is handed to the interpreter's finalization, and a finalization that
waits on it hangs the process after pytest has printed its summary: CI then runs out of time
with every test passed. This fails the suite instead, naming the threads."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest


def _left(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before]


@pytest.fixture(scope="session", autouse=True)
def no_thread_outlives_the_suite() -> Iterator[None]:
    before = set(threading.enumerate())  # the threads themselves: idents are reused
    yield
    deadline = time.monotonic() + 10.0
    while _left(before) and time.monotonic() < deadline:
        # An idle executor's workers exit when it is shut down or collected; one kept alive
        # only by a reference cycle (a stopped gRPC server and its servicer) waits for the
        # collector, which may not run on its own before the check.
        gc.collect()
        time.sleep(0.1)
    left = _left(before)
    assert not left, "threads still running after the suite: " + ", ".join(
        f"{t.name} (daemon={t.daemon})" for t in left
    )

"""The removals a cluster client owes the owners a write went on without (`kvpool.core.missed_writes`):
a key owed twice keeps its newest version, at most `MAX_PENDING` keys wait (more are dropped, logged
once), an owner no longer a member is owed nothing, and `close` ends the thread. (That they reach the
owner and keep it from serving an older copy: tests/faults/test_replica_versions.py.)"""
from __future__ import annotations

import threading

import pytest

from kvpool.core import missed_writes
from kvpool.core.fanout import FanOut
from kvpool.core.missed_writes import MissedWrites
from kvpool.core.records import WorkerInfo


def test_what_is_owed_is_bounded_and_dropped_for_a_worker_gone(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(missed_writes, "MAX_PENDING", 3)
    gate = threading.Event()

    def members() -> dict[str, WorkerInfo]:  # the delivery waits here until the test has looked
        gate.wait()
        return {}  # "w" left the cluster

    fanout = FanOut("node", None, 1.0, None)
    owed = MissedWrites(fanout, members, 1.0)
    try:
        owed.missed("w", [b"a", b"b"], [5, 5])
        owed.missed("w", [b"a", b"c", b"d", b"e"], [9, 5, 5, 5])  # a again: still one key; d and e: no room
        assert owed.pending() == 3
        assert owed._owed["w"] == {b"a": 9, b"b": 5, b"c": 5}
        assert sum("are not kept" in r.getMessage() for r in caplog.records) == 1  # logged once
        gate.set()
        deadline = threading.Event()
        for _ in range(100):
            if owed.pending() == 0:
                break
            deadline.wait(0.02)
        assert owed.pending() == 0 and owed.delivered == 0  # dropped, not delivered
    finally:
        gate.set()
        owed.close()
        fanout.close()
    assert "kvpool-missed-writes" not in [t.name for t in threading.enumerate()]
    owed.missed("w", [b"x"], [1])  # after close: nothing kept, no thread
    assert owed.pending() == 0 and "kvpool-missed-writes" not in [t.name for t in threading.enumerate()]


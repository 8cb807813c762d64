"""Review of c62f8b4 (tombstones and clear marks bounded per namespace) and c891fb6 (a put's first-pass
refusal told after the re-put; NATS URLs without a scheme redacted): each test fails on a real bug."""
from __future__ import annotations

import time
import types

import pytest

from kvpool.core import versions
from kvpool.core.versions import Tombstones


class _Clock:
    """A monotonic clock the test moves by hand (versions' only use of `time.monotonic`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = types.SimpleNamespace(monotonic=lambda: self.now, time=time.time)
        monkeypatch.setattr(versions, "time", fake)


# Bug: Tombstones._trim bounds the count before it drops the marks past keep_s. Before c62f8b4 the count's
# eviction took the global oldest, which is an expired mark whenever one is left (the marks are in time
# order), so the order did not matter. Now a namespace holding more than an eighth gives up its OWN oldest
# first: when the table is at max_keys only because other namespaces' marks ran past keep_s since the last
# add, a tenant's next removal throws away one of its own live tombstones (kept for far less than keep_s),
# then the expiry loop drops the expired marks anyway, leaving the table well under its bound. The removed
# key's tombstone is gone, so a late older put (a paused replica's, a repair's) brings the removed bytes
# back. (core/versions.py Tombstones._trim: the `while len(marks) > self.max_keys` loop runs before the
# keep_s loop.)
def test_a_live_tombstone_is_not_given_up_while_expired_marks_fill_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    clock.install(monkeypatch)
    marks = Tombstones(keep_s=10.0, max_keys=16)
    for i in range(8):  # another tenant's removals, long ago
        marks.add(b"b/%d" % i, 100 + i)
    clock.now += 5.0
    for i in range(8):  # tenant a's removals, 5 s ago: the table is now full (16)
        marks.add(b"a/%d" % i, 200 + i)
    clock.now += 6.0  # b's marks are 11 s old (past keep_s), a's are 6 s old (kept 4 s more)
    marks.add(b"a/new", 300)
    assert len(marks) <= 16
    assert marks.version(b"a/0") == 200, (
        f"tenant a removed 'a/0' 6 s ago (keep_s 10 s); after one more removal of a's, with 8 of the 16 marks "
        f"expired, its tombstone reads {marks.version(b'a/0')} (table now {len(marks)} marks): a late older put "
        f"of 'a/0' is taken and its removed bytes come back")

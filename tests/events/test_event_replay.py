"""A publisher's (re-)announcement of what the cache holds: the holdings are copied under the cache's
lock and their events made as they are taken, in order between what was queued before and what comes
after; a replay of more blocks than the queue's bound loses no change that follows it."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core import TieredCache
from kvpool.core.events import BlockEvent, EventQueue


@pytest.fixture
def cache(tmp_path) -> Iterator[TieredCache]:
    c = TieredCache(dram_bytes=64 << 20, ssd_path=str(tmp_path / "ssd"), ssd_sync=False, ssd_map_size=64 << 20)
    try:
        yield c
    finally:
        c.close()


def _put(cache: TieredCache, *keys: str) -> None:
    cache.batch_put(list(keys), [np.full(64, 7, dtype=np.uint8) for _ in keys])


def _all(q: EventQueue) -> list[tuple[str, bytes, str]]:
    out: list[BlockEvent] = []
    while batch := q.take(n=3):  # small batches: a replay is made a chunk at a time
        out += batch
    return [(e.kind, e.key, e.tier) for e in out]


def test_a_replay_comes_after_what_was_queued_and_before_what_follows(cache: TieredCache) -> None:
    _put(cache, "a", "b")
    cache.flush()  # a and b on SSD too: the replay says `copied` for them there
    q = EventQueue()
    cache.add_listener(q)
    _put(cache, "x")
    q.cleared()
    cache.remove_listener(q)
    cache.add_listener(q, replay=True)
    _put(cache, "y")
    cache.remove("a")
    assert _all(q) == [("stored", b"x", "dram"), ("cleared", b"*", ""),
                       ("stored", b"a", "dram"), ("stored", b"b", "dram"), ("stored", b"x", "dram"),
                       ("copied", b"a", "ssd"), ("copied", b"b", "ssd"),
                       ("stored", b"y", "dram"), ("dropped", b"a", "dram"), ("removed", b"a", "ssd")]


def test_two_replays_in_a_row_are_told_in_turn(cache: TieredCache) -> None:
    _put(cache, "a")
    q = EventQueue()
    cache.add_listener(q, replay=True)
    assert q.take(n=0) == []  # (nothing taken yet)
    cache.remove_listener(q)
    q.cleared()
    _put(cache, "b")  # not listening: told by the next replay only
    cache.add_listener(q, replay=True)
    assert _all(q) == [("stored", b"a", "dram"), ("cleared", b"*", ""),
                       ("stored", b"a", "dram"), ("stored", b"b", "dram")]


def test_a_change_after_a_replay_larger_than_the_queue_is_not_lost(cache: TieredCache) -> None:
    """A worker holding more blocks than its event queue's bound re-announces them (after lost events):
    the change that comes next is published, not dropped as an overflow (which set off yet another
    re-announcement)."""
    _put(cache, *(f"k{i}" for i in range(50)))
    q = EventQueue(max_queued=10)
    q.unbounded = True  # as the publisher announces
    q.cleared()
    cache.add_listener(q, replay=True)
    q.unbounded = False
    _put(cache, "after")
    events = _all(q)
    assert q.lost == 0
    assert len(events) == 52 and events[-1] == ("stored", b"after", "dram")

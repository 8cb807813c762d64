"""Review of a9b811b (replays made off the lock), 8aec61f (full disk: a replicated put's StorageError) and
17f6c61 (an owner refusing a newer block is owed the removal of its older copies): each test fails on a
real bug."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpool.core import TieredCache
from kvpool.core import protocol as P
from kvpool.core.cluster_backend import ClusterBackend
from kvpool.core.errors import KVPoolError
from kvpool.core.events import MAX_BATCH, BlockEvent, EventBatch, EventIndex, EventPublisher, EventQueue


@pytest.fixture
def cache(tmp_path) -> Iterator[TieredCache]:
    c = TieredCache(dram_bytes=64 << 20, ssd_path=str(tmp_path / "ssd"), ssd_sync=False, ssd_map_size=64 << 20)
    try:
        yield c
    finally:
        c.close()


def _put(cache: TieredCache, keys: list[str]) -> None:
    cache.batch_put(keys, [np.full(64, 7, dtype=np.uint8) for _ in keys])


def _drain(q: EventQueue) -> list[tuple[str, bytes, str]]:
    out: list[BlockEvent] = []
    while batch := q.take():
        out += batch
    return [(e.kind, e.key, e.tier) for e in out]


# Bug (a9b811b): EventQueue.replayed (core/events.py) chains `self._ahead` BEFORE `self._next`, but `_next`
# holds the events already made from `_ahead` (its head, `_source` fills it a MAX_BATCH chunk at a time):
# a replay registered while an earlier replay of more than MAX_BATCH events is part taken sends the rest of
# the earlier replay first, then its head, then what followed.
def test_a_replay_registered_while_an_earlier_one_is_part_taken_keeps_the_earlier_ones_order(
        cache: TieredCache) -> None:
    """A consumer of a worker's events (re-announced twice, the second while the first is being published)
    gets every event in the order the queue promises: `cleared`, the first holdings in order, `cleared`,
    the second holdings; not the tail of the first announcement before its head."""
    _put(cache, [f"k{i}" for i in range(MAX_BATCH + 500)])
    whole = EventQueue()
    cache.add_listener(whole, replay=True)
    holdings = _drain(whole)  # the holdings as one replay lists them
    cache.remove_listener(whole)
    q = EventQueue()
    q.cleared()
    cache.add_listener(q, replay=True)
    got = [(e.kind, e.key, e.tier) for e in q.take(n=1)]  # the publisher took `cleared` so far
    cache.remove_listener(q)  # a re-announcement (as EventPublisher._announce makes it)
    q.cleared()
    cache.add_listener(q, replay=True)
    got += _drain(q)
    cleared = [("cleared", b"*", "")]
    assert len(got) == len(cleared + holdings + cleared + holdings)
    assert got == cleared + holdings + cleared + holdings, \
        f"events out of order: the first replay's events begin {got[1:3]}, not {holdings[:2]}"


# Bug (left by a9b811b and b767ac6): EventPublisher.close(going=True) (core/events.py) queues `cleared` and then
# the SSD tier's blocks through `_OnSsd`, a listener whose replay is told block by block into the queue's
# bounded `_add` (`unbounded` is set only by `_announce`): a worker stopping with more SSD blocks than the
# queue's bound (MAX_QUEUED, 1M: 64 GiB of 64 KiB blocks), or with its queue near full, publishes only part
# of what it keeps, or loses the `cleared` itself, and no re-announcement follows (the publisher is gone).
def test_a_stopping_worker_announces_every_block_its_ssd_keeps_whatever_the_queue_bound(
        cache: TieredCache) -> None:
    """A router following a worker's events after the worker stops cleanly must know every block the
    worker's SSD tier keeps (it serves them after its restart): the last announcement is never cut short
    by the event queue's bound, as the start's announcement is not."""
    keys = [f"s{i}" for i in range(40)]
    _put(cache, keys)
    cache.flush()  # every block on SSD too: what outlives the process
    batches: list[EventBatch] = []
    pub = EventPublisher(cache, "w", "n", [batches.append], flush_s=3600.0)  # publishes at close only
    pub.queue.max_queued = 10  # (a bound below the SSD tier's blocks: 1M in production)
    pub.close(going=True)
    index = EventIndex()
    for b in batches:
        index.apply(b)
    kept = {k for (w, k), tiers in index.held.items() if "ssd" in tiers}
    assert kept == {k.encode() for k in keys}, \
        f"after the stop the router knows {len(kept)} of the {len(keys)} blocks the SSD tier keeps"
    assert batches[-1].lost == 0, f"{batches[-1].lost} events of the final announcement were dropped"


class _Transport:
    """One owner's answer to a PUT, as the worker sends it (per-block statuses), told as the real transport
    tells it (`Connection.put_statuses`)."""

    def __init__(self, statuses: dict[bytes, int]) -> None:
        self.statuses = statuses

    def put_statuses(self, keys: list[bytes], buffers: list[Any], pin_s: float, versions: list[int]) -> list[int]:
        return [self.statuses.get(k, P.ITEM_OK) for k in keys]


class _FanOut:
    def __init__(self, transports: dict[str, _Transport]) -> None:
        self.transports = transports

    def each(self, live: Any, groups: dict[str, list[int]], call: Any, deadline: float, **_: Any) -> Iterator[Any]:
        for w, idx in groups.items():
            yield w, idx, call(self.transports[w], idx)

    def answering(self, others_than: Any = None) -> bool:
        return True


class _Missed:
    def __init__(self) -> None:
        self.owed: dict[str, dict[bytes, int]] = {}

    def missed(self, worker: str, keys: list[bytes], versions: list[int]) -> None:
        self.owed.setdefault(worker, {}).update(zip(keys, versions))


def _backend(transports: dict[str, _Transport]) -> ClusterBackend:
    b = ClusterBackend.__new__(ClusterBackend)  # its put logic alone: two owners, R=2
    b.replication, b.timeout_s, b.local = 2, 5.0, False
    b.fanout = _FanOut(transports)  # type: ignore[assignment]
    b.missed = _Missed()  # type: ignore[assignment]
    return b


# Bug (8aec61f, kept by 17f6c61): ClusterBackend._put_as_of's `put` (core/cluster_backend.py) takes a
# StorageError from an owner as "stored there, not durable" for every block of its group. But the transport
# raises the error of the FIRST failed block only (connection.put_outcome); the worker answers ITEM_STORAGE
# for the blocks it committed on a full disk and ITEM_FULL / ITEM_QUOTA / ITEM_CORRUPT for those it refused
# in the same frame (worker_ops._put: `run_status[run_status == 0] = ITEM_STORAGE`). A block refused after
# one answered ITEM_STORAGE is counted as stored there: that owner is not owed the removal of its older copy
# (17f6c61's fix), and serves it once the owner that took the newer block evicts it.
def test_an_owner_that_refused_a_block_behind_a_not_durable_one_is_owed_the_removal_of_its_older_copy() -> None:
    """A user rewrites two blocks (R=2); one owner's disk is full (the first block: stored, not durable) and it
    has no room for the second (ITEM_FULL). The other owner stores both. The full owner must be told to
    drop its older copy of the second block, or readers get those older bytes once the newer one is
    evicted from the other owner."""
    keys, bufs = [b"k1", b"k2"], [b"x" * 64, b"y" * 64]
    b = _backend({"full": _Transport({b"k1": P.ITEM_STORAGE, b"k2": P.ITEM_FULL}), "roomy": _Transport({})})
    try:
        b._put_as_of({}, [["full", "roomy"], ["full", "roomy"]], keys, bufs, 0.0, [1000, 1001], [])
    except KVPoolError:
        pass  # StorageError: the first block is not durable on `full` (said; the test is about the second)
    owed = b.missed.owed.get("full", {})  # type: ignore[attr-defined]
    assert b"k2" in owed, "the owner that refused the newer k2 keeps its older k2 (owed no removal)"


# Bug (8aec61f): the same `put` returns no indices held newer when an owner's answer is a StorageError, so
# an owner that answered ITEM_SUPERSEDED for a block (it holds a version as new or newer: a writer whose clock
# runs ahead) beside one ITEM_STORAGE gets no put again above that version; the call says "stored, not
# durable" (StorageError) while readers, taking the newest version, get the other writer's older put.
def test_a_block_an_owner_holds_newer_is_put_again_when_another_block_is_not_durable() -> None:
    """A user puts two blocks (R=2) over a full disk on one owner, which also holds a newer-stamped version
    of the second (another writer, its clock ahead, wrote it before). The put must be made again above that
    version (as when no disk is full), or the user's later put is never read back."""
    keys, bufs = [b"k1", b"k2"], [b"x" * 64, b"y" * 64]
    b = _backend({"full": _Transport({b"k1": P.ITEM_STORAGE, b"k2": P.ITEM_SUPERSEDED}), "roomy": _Transport({})})
    again: list[int] | None = None
    not_durable: list[Any] = []  # (`Deferred`s: the caller raises the first once the blocks held newer are put again)
    try:
        again = b._put_as_of({}, [["full", "roomy"], ["full", "roomy"]], keys, bufs, 0.0, [1000, 1001], not_durable)
    except KVPoolError as e:
        err = e
    else:
        err = None
    assert again is not None and 1 in again, \
        f"k2 (held newer by an owner) is not put again above that version; the put said {err!r}"
    assert [type(d.error).__name__ for d in not_durable] == ["StorageError"]  # k1: said once the put is done

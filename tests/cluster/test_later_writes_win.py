"""A put or remove made after another writer's was acknowledged replaces it, whatever the two writers'
clocks say: versions are stamped by each writer (`kvpool.core.versions`), and a worker keeps a key's
newest version, so a writer whose clock runs behind another's (or stamped in the same millisecond) would
see its later put dropped and the older bytes served. The worker answers such a put ITEM_SUPERSEDED (a
remove, SUPERSEDED) and the writer stamps it again above what the worker holds."""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core.client import PoolClient
from kvpool.core.connection import put_outcome
from kvpool.core.errors import CapacityError
from kvpool.core.procs import WorkerProcess
from kvpool.core.shm_refs import recording
from kvpool.core.transport import ShmTransport, connect
from kvpool.core.versions import CLOCK, COUNTER_BITS

Spawn = Callable[..., WorkerProcess]


def _ahead(ms: int = 1000) -> int:
    """A version stamped by a writer whose clock runs `ms` ahead of this one's (within the skew allowed)."""
    return (int(time.time() * 1000) + ms) << COUNTER_BITS


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_put_after_one_from_a_clock_ahead_replaces_it(spawn: Spawn, path: str) -> None:
    worker = spawn()  # its own process: a worker in this one would share this process's clock
    address = worker.unix_path if path == "shm" else worker.address
    other = connect(address)  # the other writer, its clock ahead of ours
    try:
        ahead = _ahead()
        other.batch_put([b"k", b"mine"], [b"A" * 4096, b"a" * 100], versions=[ahead, ahead + 1])
        with PoolClient(mode="local", worker=address) as pool:
            pool.batch_put(["k", "fresh"], [b"B" * 4096, b"f" * 10])  # later in time: it must win
            assert pool.get("k") == b"B" * 4096 and pool.get("fresh") == b"f" * 10
            assert other.batch_versions([b"k"])[1][0] > ahead  # stamped again above the held version
            assert pool.remove("mine") is True and pool.get("mine") is None  # a remove too
    finally:
        other.close()


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_put_with_versions_of_its_own_keeps_last_writer_wins(spawn: Spawn, path: str) -> None:
    """A repair, a replicated put: the caller's versions stand, and the newest is kept."""
    worker = spawn()
    t = connect(worker.unix_path if path == "shm" else worker.address)
    try:
        ahead = _ahead()
        t.batch_put([b"k"], [b"new"], versions=[ahead])
        assert t.put_as_of([b"k"], [b"old"], 0.0, [ahead - 1]) == [0]  # superseded: told, not stored
        t.batch_put([b"k"], [b"old"], versions=[ahead - 1])
        assert t.batch_remove([b"k"], versions=[ahead - 2]) == [False]
        assert t.remove_as_of([b"k"], [ahead - 2]) == [P.SUPERSEDED]
        out = bytearray(16)
        assert t.batch_get_into([b"k"], [out]) == [3] and bytes(out[:3]) == b"new"
    finally:
        t.close()


def test_a_superseded_block_does_not_hide_another_blocks_failure() -> None:
    keys, lens = [b"a", b"b", b"c"], [1, 2, 3]
    assert put_outcome([0, P.ITEM_SUPERSEDED, 0], keys, lens, 16) == [1]
    with pytest.raises(CapacityError) as e:
        put_outcome([P.ITEM_SUPERSEDED, P.ITEM_FULL, 0], keys, lens, 16)
    assert e.value.key == b"b"


def test_replicas_both_take_the_later_put_at_one_version(nats, spawn: Spawn) -> None:
    """One replica holds a version from a clock ahead, the other nothing: the later put is stamped
    again above it and goes to both, so they agree on the bytes and the version."""
    workers = [spawn(nats_url=nats.url, node_id=f"node{i}") for i in range(2)]
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, node_id="client-node", timeout_s=5) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 2, 15)
        one = connect(workers[0].address)
        try:
            one.batch_put([b"k"], [b"A" * 1000], versions=[_ahead()])
            pool.put("k", b"B" * 1000)
            copies = [connect(w.address) for w in workers]
            try:
                got = [np.zeros(1000, dtype=np.uint8) for _ in copies]
                assert [c.batch_get_into([b"k"], [g])[0] for c, g in zip(copies, got)] == [1000, 1000]
                assert all(g.tobytes() == b"B" * 1000 for g in got)
                versions = [c.batch_versions([b"k"])[1][0] for c in copies]
                assert versions[0] == versions[1]
                one.batch_put([b"gone"], [b"G"], versions=[_ahead()])
                assert pool.remove("gone") is True
                assert [c.batch_exists([b"gone"])[0] for c in copies] == [False, False]
            finally:
                for c in copies:
                    c.close()
        finally:
            one.close()


def test_a_superseded_block_is_not_named_where_it_would_have_lain(spawn: Spawn) -> None:
    """`put_placed` tells where each block lies for readers on this node: none for a block not stored."""
    worker = spawn()
    other = connect(worker.unix_path)
    try:
        other.batch_put([b"held"], [b"H" * 64], versions=[_ahead()])
        with PoolClient(mode="local", worker=worker.unix_path) as pool:
            backend = pool.backend
            assert isinstance(backend, ShmTransport)
            with recording([b"held", b"new"]) as rec:
                backend.put_as_of([b"held", b"new"], [b"x" * 64, b"n" * 64], 0.0, None)  # stamped once
            held, new = rec.places([b"held", b"new"])
            assert held is None and new is not None
    finally:
        other.close()


@pytest.mark.parametrize("read", ["tcp get", "shm get", "shm lease", "shm get_into"])
def test_every_read_merges_the_version_it_read_into_the_clock(spawn: Spawn, read: str) -> None:
    """A read merges the version it read into this process's clock (README, Replicas), whichever path
    it takes: the next put of that key is then stamped above it, with no second round trip."""
    worker = spawn()  # its own process: its clock is not this one's
    other = connect(worker.address)
    try:
        key = f"read-{read}".encode()
        ahead = _ahead(1500)
        other.batch_put([key], [b"x" * 64], versions=[ahead])  # a writer ahead of us; its version not seen here
        assert CLOCK.now() < ahead
        with PoolClient(mode="local", worker=worker.address if read.startswith("tcp") else worker.unix_path) as pool:
            if read.endswith(" get"):
                assert pool.get(key) == b"x" * 64
            elif read == "shm lease":
                with pool.lease(key) as view:
                    assert view is not None
            else:
                assert pool.get_into(key, bytearray(64)) == 64
        assert CLOCK.now() > ahead
    finally:
        other.close()

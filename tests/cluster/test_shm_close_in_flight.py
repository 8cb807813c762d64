"""A same-node transport closed from another thread while a call copies through its mapping of the arena:
the call fails with PoolUnavailable (a typed error, as every other failure of the connection), never a
ValueError of a released mapping, and the mapping is unmapped once the call has let go of it. A put closed
(or aborted at its deadline) before it copies a part writes nothing more: the worker frees a closed
connection's reserved slots, and another writer may have committed its blocks there by then."""
from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.core import connection, shm_put, transport
from kvpool.core.arena_pages import ArenaPages
from kvpool.core.errors import PoolUnavailable
from kvpool.core.server import Worker
from kvpool.core.shm_refs import recording
from kvpool.core.shm_stage import Stager
from kvpool.core.transport import ShmTransport

pytestmark = pytest.mark.usefixtures("arena_only")  # (the arena's way, with small blocks)

_KEYS = [f"k{i}".encode() for i in range(16)]
_BLOCKS = [np.full(64 << 10, i, dtype=np.uint8) for i in range(16)]


def _mappings(worker: Worker) -> int:
    """How many mappings of the worker's arena this process has (the in-process worker's own too)."""
    return Path("/proc/self/maps").read_text().count(f"/dev/shm/{worker.cache.arena.name}")


def _closing_first(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, t: ShmTransport) -> list[int]:
    """`module.name` closes `t` from another thread (and waits for that close) before it runs the first
    time; the number of closes made."""
    real: Callable[..., Any] = getattr(module, name)
    closes: list[int] = []

    def closing(*args: Any, **kwargs: Any) -> Any:
        if not closes:
            closer = threading.Thread(target=t.close)
            closer.start()
            closer.join()
            closes.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, closing)
    return closes


@pytest.fixture
def stored(worker: Worker) -> Iterator[ShmTransport]:
    """A transport with `_BLOCKS` stored under `_KEYS`."""
    t = ShmTransport(worker.unix_path)
    t.batch_put(_KEYS, _BLOCKS)
    yield t
    t.close()


def test_a_get_closed_mid_copy_is_unavailable(worker: Worker, stored: ShmTransport,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    closes = _closing_first(monkeypatch, transport, "_copy_out", stored)
    out = [np.zeros(64 << 10, dtype=np.uint8) for _ in _KEYS]
    with pytest.raises(PoolUnavailable):
        stored.batch_get_into(_KEYS, out)
    assert closes == [1]
    monkeypatch.undo()
    assert stored.batch_get_into(_KEYS, out) == [b.nbytes for b in _BLOCKS]  # a later call connects again
    assert all(np.array_equal(o, b) for o, b in zip(out, _BLOCKS))


def test_a_lease_closed_before_its_views_are_made_is_unavailable(worker: Worker, stored: ShmTransport,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    closes = _closing_first(monkeypatch, ShmTransport, "_lease_reply", stored)
    # its leases ended with the connection: its views may have changed since
    with pytest.raises(PoolUnavailable), stored.batch_lease(_KEYS) as views:
        assert [bytes(v[:1]) for v in views if v is not None] == [bytes([i]) for i in range(16)]
    assert closes == [1]


def test_the_mappings_go_once_the_call_lets_go(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    own = _mappings(worker)
    t = ShmTransport(worker.unix_path)
    try:
        t.batch_put(_KEYS, _BLOCKS)  # maps the arena read-write
        _closing_first(monkeypatch, transport, "_copy_out", t)
        assert _mappings(worker) > own
        try:
            t.batch_get_into(_KEYS, [np.zeros(64 << 10, dtype=np.uint8) for _ in _KEYS])  # and read-only
        except PoolUnavailable:
            pass
        else:
            pytest.fail("the get did not fail")
        gc.collect()  # (the exception's frames held the call's reference to the read-only mapping)
        assert _mappings(worker) == own
    finally:
        t.close()


def _reserved(worker: Worker) -> int:
    return sum(sum(c.reserved.values()) for c in list(worker._conns))


@pytest.mark.parametrize("end", ["close", "abort"])
@pytest.mark.parametrize("how", ["put", "staged"])
def test_a_put_ended_before_it_copies_writes_nothing_into_slots_the_worker_gave_another_writer(
        worker: Worker, monkeypatch: pytest.MonkeyPatch, end: str, how: str) -> None:
    """Another thread closes (or, at a deadline, aborts) the writer's connection just before it copies;
    the worker frees the slots it reserved and another writer commits its blocks there; then the first
    writer's copy would run: it must fail, and the other writer's blocks read back as they were put."""
    writer, other, reader = (ShmTransport(worker.unix_path) for _ in range(3))
    size, n = 256 << 10, 8
    freed: list[int] = []
    victims = [f"victim{i}".encode() for i in range(n)]

    def ended_first(real: Callable[..., Any]) -> Callable[..., Any]:
        def hook(*args: Any, **kwargs: Any) -> Any:
            if not freed and threading.current_thread().name == "writer":
                freed.append(_reserved(worker))
                closer = threading.Thread(target=getattr(writer, end))
                closer.start()
                closer.join()
                deadline = time.monotonic() + 5
                while _reserved(worker) and time.monotonic() < deadline:  # the worker saw it: slots freed
                    time.sleep(0.01)
                with recording(victims) as rec:
                    other.batch_put(victims, [np.full(size, 0x11, dtype=np.uint8)] * n)
                freed.append(sum(p is not None for p in rec.places(victims)))
            return real(*args, **kwargs)
        return hook

    if how == "put":  # the writer's part is copied in `_copy_and_commit`, under `ShmTransport.copying`
        monkeypatch.setattr(shm_put.PartedPut, "_copy_and_commit", ended_first(shm_put.PartedPut._copy_and_commit))
    else:  # a stager readies the slots' pages, then copies
        monkeypatch.setattr(ArenaPages, "ready", ended_first(ArenaPages.ready))
    failed: list[BaseException] = []

    def put() -> None:
        keys, blocks = [f"w{i}".encode() for i in range(n)], [np.full(size, 0xAA, dtype=np.uint8)] * n
        try:
            if how == "put":
                writer.batch_put(keys, blocks)
            else:
                Stager(writer, writer.hello().arena).put(keys, [memoryview(b) for b in blocks])
        except BaseException as e:
            failed.append(e)
    t = threading.Thread(target=put, name="writer")
    t.start()
    t.join(30)
    monkeypatch.undo()
    try:
        assert len(freed) == 2 and freed[0] > 0 and freed[1] == n  # the writer held slots; the other's went in
        assert len(failed) == 1 and isinstance(failed[0], PoolUnavailable), failed
        out = [np.zeros(size, dtype=np.uint8) for _ in range(n)]
        assert reader.batch_get_into(victims, out) == [size] * n
        assert [int(o.min()) for o in out] == [0x11] * n and [int(o.max()) for o in out] == [0x11] * n
    finally:
        for t_ in (writer, other, reader):
            t_.close()


def test_a_close_from_the_thread_whose_copy_it_interrupted_does_not_wait_for_itself(
        worker: Worker, stored: ShmTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler that closes the client runs in the thread it interrupted, maybe in the middle of
    a copy (the gate held): its close waits GATE_WAIT_S at most, then goes on."""
    monkeypatch.setattr(connection, "GATE_WAIT_S", 0.2)
    # this thread, copying; the call it interrupted fails
    with pytest.raises(PoolUnavailable, match="closed during the call"), stored._session() as sock, \
            stored.copying(sock):
        t0 = time.monotonic()
        stored.close()
        assert time.monotonic() - t0 < 2
    out = [np.zeros(64 << 10, dtype=np.uint8) for _ in _KEYS]
    assert stored.batch_get_into(_KEYS, out) == [b.nbytes for b in _BLOCKS]  # and a later call connects again

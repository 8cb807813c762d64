"""A same-node transport closed from another thread while a call copies through its mapping of the arena:
the call fails with PoolUnavailable (a typed error, as every other failure of the connection), never a
ValueError of a released mapping, and the mapping is unmapped once the call has let go of it."""
from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.core import shm_put, transport
from kvpool.core.errors import PoolUnavailable
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport

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


def test_a_put_closed_mid_copy_is_unavailable(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        closes = _closing_first(monkeypatch, shm_put, "copy_in", t)
        with pytest.raises(PoolUnavailable):
            t.batch_put(_KEYS, _BLOCKS)
        assert closes == [1]
    finally:
        t.close()


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

"""A long-lived client lets go of workers that left: its connection to one, and on the same node its
mapping of that worker's arena (whose memory stays taken for as long as anything maps it)."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.core import Stagers, fanout
from kvpool.core.client import PoolClient
from kvpool.core.cluster_backend import ClusterBackend
from kvpool.core.fanout import Departures
from kvpool.core.procs import WorkerProcess
from kvpool.core.records import WorkerInfo


def _mapped(arena: str) -> bool:
    return f"/dev/shm/{arena}" in Path("/proc/self/maps").read_text()


def test_departures_count_from_when_a_worker_went_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "DEPARTED_S", 0.2)
    d = Departures()
    live = {"a": WorkerInfo(worker_id="a")}
    assert d.gone(["a", "b"], live) == []  # b missing from now on
    time.sleep(0.1)
    assert d.gone(["a", "b"], {**live, "b": WorkerInfo(worker_id="b")}) == []  # back: the count starts again
    assert d.gone(["a", "b"], live) == []
    time.sleep(0.25)
    assert d.gone(["a", "b"], live) == ["b"]
    assert d.gone(["a"], live) == []  # told once


def test_a_client_closes_what_it_holds_of_a_worker_that_left(nats, spawn: Callable[..., WorkerProcess],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "DEPARTED_S", 0.3)
    workers = [spawn(nats_url=nats.url) for _ in range(2)]
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 2, 15)
        backend = pool.backend
        assert isinstance(backend, ClusterBackend)
        keys = [f"k{i}" for i in range(64)]
        stagers = Stagers(pool)
        try:
            pool.batch_put(keys, [b"x" * 4096] * len(keys))  # both workers get keys: both connected
            for k in keys:
                stager = stagers.for_keys([k.encode()], [4096])
                assert stager is not None
                stager.put([k.encode()], [memoryview(b"y" * 4096)])
            stagers.settle()
            arenas = {w: info.arena for w, info in pool.members().items()}
            assert set(backend.fanout.connected()) == set(arenas) and all(map(_mapped, arenas.values()))
            gone = next(w for w, info in pool.members().items() if info.unix == workers[1].unix_path)
            workers[1].stop()  # leaves cleanly: no longer a member at once
            assert pool.wait_for_members(lambda m: gone not in m, 15)
            pool.batch_exists(keys)
            stagers.for_keys([b"k0"], [4096])
            time.sleep(0.4)
            pool.batch_exists(keys)  # a call notices it has been gone long enough
            stagers.for_keys([b"k0"], [4096])
            assert gone not in backend.fanout.connected()
            assert not _mapped(arenas[gone]), "the departed worker's arena is still mapped"
            assert _mapped(next(a for w, a in arenas.items() if w != gone))  # the live one's stays
        finally:
            stagers.close()

"""A connection the watchdog shut no longer counts toward `max_connections` (ad063ec), whether or not
its thread has ended. A request stuck outside any socket call (a stalled disk under the cache's lock,
an SSD read that hangs) is not woken by the shutdown: its thread and descriptor stay. A client that
times out and connects again (what every client does) then gets a new connection and a new stuck
thread each time, with no bound; before, the shut-but-alive ones counted and `max_connections` held."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvpool.core import PoolUnavailable
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.server import Worker

SMALL = {"dram_bytes": 32 << 20, "dram_slab_size": 1 << 20, "prefault": False}


def test_connections_with_stuck_requests_stay_bounded_by_max_connections(tmp_path: Path) -> None:
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), max_connections=3, io_timeout_s=0.3),
               CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    stuck = threading.Event()
    real = w.cache.acquire_many

    def hang(keys):  # type: ignore[no-untyped-def]
        stuck.wait(30)  # a read that hangs below the socket (a stalled disk)
        return real(keys)

    w.cache.acquire_many = hang  # type: ignore[method-assign]
    try:
        for _ in range(12):  # a client that times out and comes back
            with pytest.raises(PoolUnavailable), PoolClient(mode="local", worker=w.address, timeout_s=0.6) as c:
                c.get("k")
        with w._conns_lock:
            alive = len(w._conns)
        assert alive <= 3, f"{alive} connections (threads, descriptors) held by a worker of max_connections=3"
    finally:
        stuck.set()
        w.stop()

"""Adversarial checks of the engine-facing backends (Mooncake drop-in, FastDeploy store, SGLang HiCache
storage, all on `backends._hostio.HostIO`) called from several engine threads at once while the pool
goes away, comes back, or the engine closes the store. The promise: an engine never crashes or hangs
because of the pool, a closed store stays closed and holds nothing, and a hit is always the right bytes."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from kvpool.backends.mooncake_compat import MooncakeDistributedStore

from sigstop import freeze


def _wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


# Bug: HostIO.close() marks the store closed by setting `_retry_at` to +inf, but a call that another
# engine thread had in flight fails on the closed connection (PoolUnavailable) and `HostIO._failed`
# then sets `_retry_at = now + retry_s` over it: the store is no longer closed. Its next call after
# retry_s connects a brand-new PoolClient in a background thread (never closed: a connection and an
# arena mapping leaked past close()), and the "closed" store serves hits again.
def test_a_store_closed_while_another_thread_waits_on_the_pool_stays_closed(spawn: Callable[..., Any]) -> None:
    """An engine shuts its Mooncake store down while its prefetch thread is blocked on a stalled worker:
    afterwards health_check() must say "closed" (1) and no call may reach the pool again; instead the
    store reopens itself a second later and serves the block."""
    worker = spawn()
    store = MooncakeDistributedStore()
    assert store.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.unix_path) == 0
    assert store.put("k", b"v" * 100) == 0
    conn = store._io._client.backend  # type: ignore[union-attr]  # the ShmTransport to the worker
    freeze(worker.proc.pid)
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(store.get("k"))) for _ in range(2)]
    try:
        threads[0].start()
        assert _wait_until(lambda: conn._exchanging), "the first get never reached the worker"
        threads[1].start()  # waits for the connection the first holds
        time.sleep(0.1)
        store.close()
        for t in threads:
            t.join(10)
        assert results == [b"", b""]
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    try:
        assert store.health_check() == 1, "the store reports itself open again after close()"
        served = _wait_until(lambda: store.get("k") != b"", timeout_s=2.5)
        assert not served, "a closed store reconnected on its own and served a block"
        assert store._io._client is None, "a PoolClient was made after close() (never closed)"
    finally:
        client = store._io._client
        if client is not None:
            client.close()

"""A worker's stop waits for its own background threads (a catch-up after a stall, the settle after a
start, the alive stamp, the stall watch): one left running as the interpreter exits can write to the log
under it, which aborts the process (a CI run: a worker stopped as it woke from a pause exited -6), or
touch the cache as it closes."""
from __future__ import annotations

import socket
import threading
import time

from kvpool.core.cluster import Membership
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.server import Worker

_HELPERS = ("kvpool-catch-up", "kvpool-settle", "kvpool-alive", "kvpool-stall-watch")


def _helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in _HELPERS and t.is_alive()]


def test_stop_returns_only_after_a_catch_up_in_progress_has_ended(nats, tmp_path):
    """The catch-up asks a peer that takes the connection and never answers (it lasts until the
    catch-up's timeout); stop() is called meanwhile."""
    silent = socket.create_server(("127.0.0.1", 0))
    peer = Membership(nats.url, ttl_s=3.0, role="worker")
    w = None
    try:
        peer.register("w-silent", lambda: {"tcp": f"127.0.0.1:{silent.getsockname()[1]}"}, heartbeat_s=0.5)
        w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), no_auth=True, nats_url=nats.url,
                                heartbeat_s=0.5, member_ttl_s=3.0),  # type: ignore[arg-type]
                   CacheConfig(dram_bytes=8 << 20, dram_slab_size=1 << 20, prefault=False)).start()
        assert w.membership.wait_for(lambda m: "w-silent" in m, 5)
        beats = w._beats
        w._stalled(2.0)  # what the stall watch calls after a pause
        deadline = time.monotonic() + 5
        while w._beats == beats and time.monotonic() < deadline:  # the catch-up waits for a heartbeat
            time.sleep(0.05)
        silent.settimeout(5)
        conn, _ = silent.accept()  # the catch-up is asking the silent peer
        try:
            assert any(t.name == "kvpool-catch-up" for t in _helpers())
            w.stop()
            assert _helpers() == [], "threads of the worker outlived its stop"
        finally:
            conn.close()
    finally:
        if w is not None:
            w.stop()
        peer.close()
        silent.close()

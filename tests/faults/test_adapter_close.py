"""An engine adapter's close() ends its threads: a Mooncake-API store closed while it reconnects to a
cluster whose NATS is down returns at once (an engine shutting down does not wait out the attempt), and
the reconnect thread, with that attempt's NATS loop thread, ends with the attempt (the cluster client's
join timeout, 10 s), the client it made closed."""
from __future__ import annotations

import threading
import time

import pytest

from kvpool.backends.mooncake_compat import MooncakeDistributedStore
from kvpool.core.nats_server import free_port


def _ours() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvpool-"))


@pytest.mark.timeout(60)
def test_close_while_reconnecting_leaves_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_TIMEOUT_S", "0.5")
    before = _ours()
    store = MooncakeDistributedStore()
    assert store.setup("h", "", master_server_addr=f"nats://127.0.0.1:{free_port()}") == 0  # NATS down: misses
    time.sleep(1.2)  # past the retry back-off: the next call reconnects in a thread of its own
    assert store.put("k", b"v") != 0
    assert "kvpool-reconnect" in _ours()
    t0 = time.monotonic()
    store.close()
    assert time.monotonic() - t0 < 2.0
    while _ours() != before and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    assert _ours() == before, f"threads still running 15 s after close(): {_ours()}"

"""An engine whose adapter starts while NATS is down (cluster mode). The adapter's HostIO reports misses
and retries the pool every `retry_s`; each retry must stay within the client's `timeout_s` (the engine
thread that makes the call is waiting on it: vLLM's scheduler, SGLang's prefetch thread), and the
outage must be logged once, not once per retry."""
from __future__ import annotations

import logging
import socket
import time

import pytest

from kvpool.backends.fastdeploy import KVPoolStore

TIMEOUT_S = 1.0
RETRY_S = 0.2


def _dead_nats_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: every connect is refused at once
    return f"nats://127.0.0.1:{port}"


def test_a_retry_while_nats_is_down_is_bounded_by_the_clients_timeout() -> None:
    store = KVPoolStore("m", mode="cluster", nats_url=_dead_nats_url(), timeout_s=TIMEOUT_S, retry_s=RETRY_S)
    try:
        for _ in range(2):
            time.sleep(RETRY_S * 1.5)  # past the back-off: this call retries the pool
            t0 = time.monotonic()
            assert store.exists(["a"]) == {"a": False}
            took = time.monotonic() - t0
            assert took <= TIMEOUT_S + 1.5, f"a call while NATS is down took {took:.1f} s (timeout_s {TIMEOUT_S})"
    finally:
        store.close()


def test_retries_while_nats_is_down_log_the_outage_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvpool")
    store = KVPoolStore("m", mode="cluster", nats_url=_dead_nats_url(), timeout_s=TIMEOUT_S, retry_s=RETRY_S)
    try:
        for _ in range(3):
            time.sleep(RETRY_S * 1.5)
            store.exists(["a"])
    finally:
        store.close()
    warnings = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 2, warnings  # the outage (and at most the first connect error under it)

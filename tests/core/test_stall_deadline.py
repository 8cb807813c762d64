"""The stall watch's deadline (`kvpool.core.stall_watch`): counted from the time each tick checked, set
without the cache's lock; and clients that could leave a worker out of a write for a shorter pause than
it notices are refused."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvpool.core import stall_watch
from kvpool.core.client import PoolClient
from kvpool.core.errors import ConfigError
from kvpool.core.stall_watch import STALL_S, TICK_S, StallWatch


class _Deadlines:
    """Stands in for ReplicaState: records each deadline set."""

    def __init__(self) -> None:
        self.set: list[float] = []

    def stall_until(self, deadline: float) -> None:
        self.set.append(deadline)


def test_a_process_stopped_after_a_tick_checked_wakes_with_its_deadline_past(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tick reads the clock, finds no stall, and the process is stopped before it sets the deadline
    (the clock jumps 5 s there): the deadline it sets is already past, so reads stay closed until the
    next tick sees the stall; counted from when it was set, they would open on unvouched blocks."""
    clock = [100.0]
    reads: list[float] = []

    def monotonic() -> float:
        reads.append(clock[0])
        now = clock[0]
        clock[0] += 5.0 if len(reads) == 3 else TICK_S  # (the start, the thread's start, the first tick's check)
        return now

    monkeypatch.setattr(stall_watch.time, "monotonic", monotonic)
    deadlines, stop = _Deadlines(), threading.Event()
    stalls: list[float] = []
    StallWatch(deadlines, stalls.append, stop)  # type: ignore[arg-type]
    deadline = time.time() + 5
    while len(deadlines.set) < 3 and time.time() < deadline:
        time.sleep(0.01)
    stop.set()
    checked, woke = reads[2], reads[3]  # the first tick's check; the next tick, after the stop
    assert deadlines.set[1] == checked + STALL_S < woke  # from the check: past at the wake
    assert stalls and stalls[0] > STALL_S  # and the next tick sees the stall


def test_a_long_holder_of_the_cache_lock_is_not_a_stall(make_cache: Callable[..., Any]) -> None:
    """A clear of a million keys holds the cache's lock for seconds (an adversarial check: a worker
    fenced its reads, and dropped every block where a peer did not answer its catch-up): the watch
    does not wait for the lock, so it ticks on."""
    cache = make_cache()
    stalls: list[float] = []
    stop = threading.Event()
    StallWatch(cache.replicas, stalls.append, stop)
    try:
        with cache.replicas._lock:
            time.sleep(2 * STALL_S)
    finally:
        stop.set()
    assert stalls == []


@pytest.mark.parametrize("timeout_s", [0.2, STALL_S / 2])
def test_replicas_need_a_client_timeout_of_at_least_the_stall_bound(timeout_s: float) -> None:
    """A worker paused for less than STALL_S does not know it was paused; a client that gives up on it
    sooner could leave it out of a write (adversarial check: 20 of 20 older copies, timeout 0.5 s)."""
    with pytest.raises(ConfigError, match="at least"):
        PoolClient(mode="cluster", nats_url="nats://127.0.0.1:1", replication=2, timeout_s=timeout_s)

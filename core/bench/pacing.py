"""Holding a run to a target rate: kvtest's `target_qps`, shared by all of a run's threads."""
from __future__ import annotations

import threading
import time

__all__ = ["Pacer"]


class Pacer:
    """`wait()` returns at the next free slot of a schedule of `qps` calls per second (0: at once).

    Slots are handed out in order across threads; a caller that fell behind is not made to catch up
    with a burst beyond one second's worth, so a stall does not turn into a spike afterwards."""

    def __init__(self, qps: float) -> None:
        self.interval = 1.0 / qps if qps > 0 else 0.0
        self._next = time.perf_counter()
        self._lock = threading.Lock()

    def wait(self) -> None:
        if not self.interval:
            return
        with self._lock:
            now = time.perf_counter()
            self._next = max(self._next, now - 1.0)
            slot = self._next
            self._next += self.interval
        if slot > now:
            time.sleep(slot - now)

"""Pins with deadlines: blocks kept in DRAM (never evicted) until unpinned or until their pin expires.

A pin is on a key, not on a block: a key pinned before its block is committed (a put that carries a
pin) is committed pinned. The deadline is what keeps a pin from outliving the client that made it: a
client that dies without unpinning (a stream producer, say) costs DRAM for at most that long.
"""
from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Iterable

from .cache import TieredCache

MAX_PIN_S = 3600.0
"""The longest a pin lasts without being renewed, in seconds (longer requests are cut to it)."""


class PinTable:
    """Pins of one TieredCache. Thread-safe; expiry is applied lazily by `expire` (call it before
    space is needed) and by every `pin`."""

    def __init__(self, cache: TieredCache) -> None:
        self._cache = cache
        self._until: dict[bytes, float] = {}
        self._deadlines: list[tuple[float, bytes]] = []  # a heap; entries whose key was re-pinned are stale
        self._lock = threading.Lock()

    def pin(self, keys: Iterable[bytes], seconds: float) -> None:
        """Pin `keys` for `seconds` (at most MAX_PIN_S) from now, renewing any earlier pin; `seconds` <= 0
        unpins them."""
        now = time.monotonic()
        seconds = min(seconds, MAX_PIN_S)
        with self._lock:
            self._expire(now)
            for key in keys:
                if seconds > 0:
                    until = now + seconds
                    self._until[key] = until
                    heapq.heappush(self._deadlines, (until, key))
                    self._cache.pin(key, True)
                elif self._until.pop(key, None) is not None:
                    self._cache.pin(key, False)

    def holds(self, key: bytes) -> bool:
        """Whether `key` has a live pin (a block committed under it now is committed pinned)."""
        with self._lock:
            return self._until.get(key, 0.0) > time.monotonic()

    def expire(self) -> None:
        """Unpin the keys whose pins have expired."""
        with self._lock:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            until, key = heapq.heappop(self._deadlines)
            if self._until.get(key) == until:
                del self._until[key]
                self._cache.pin(key, False)

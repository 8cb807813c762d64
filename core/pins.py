"""Pins with deadlines: blocks kept in DRAM (never evicted) until unpinned or until their pin expires.

A pin is on a key, not on a block: a key pinned before its block is committed (a put that carries a
pin) is committed pinned. The deadline is what keeps a pin from outliving the client that made it: a
client that dies without unpinning (a stream producer, say) costs DRAM for at most that long.

What pins may cost a worker is bounded: a pin on a key that is not (yet) in DRAM waits at most
`PENDING_PIN_S` for its block and at most `MAX_PENDING_PINS` such pins exist at once (more are
refused and counted), so pins on keys that never arrive cannot grow the worker; renewing a pin does
not pile up deadlines; and every operation is linear in the keys it names.
"""
from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Iterable

from .cache import TieredCache

MAX_PIN_S = 3600.0
"""The longest a pin lasts without being renewed, in seconds (longer requests are cut to it)."""
PENDING_PIN_S = 30.0
"""How long a pin on a key that is not in DRAM waits for its block (a put that carries a pin sends
the pin just before the block)."""
MAX_PENDING_PINS = 1 << 16
"""Pins waiting for their blocks, at most, per table; further ones are refused (counted in `refused`)."""


class PinTable:
    """Pins of one TieredCache. Thread-safe; expiry is applied lazily by `expire` (call it before
    space is needed) and by every `pin`."""

    def __init__(self, cache: TieredCache) -> None:
        self._cache = cache
        self._until: dict[bytes, float] = {}
        self._pending: dict[bytes, float] = {}  # key not in DRAM -> the pin's full length, for `claim`
        self._deadlines: list[tuple[float, bytes]] = []  # a heap; entries whose key was re-pinned are stale
        self._lock = threading.Lock()
        self.refused = 0
        """Pins refused because `MAX_PENDING_PINS` were already waiting for their blocks."""

    def pin(self, keys: Iterable[bytes], seconds: float) -> None:
        """Pin `keys` for `seconds` (at most MAX_PIN_S) from now, renewing any earlier pin; `seconds` <= 0
        unpins them. A key whose block is not in DRAM is pinned for at most PENDING_PIN_S (its block,
        committed meanwhile, gets the whole pin through `claim`)."""
        now = time.monotonic()
        seconds = min(seconds, MAX_PIN_S)
        with self._lock:
            self._expire(now)
            for key in keys:
                if seconds <= 0:
                    self._pending.pop(key, None)
                    if self._until.pop(key, None) is not None:
                        self._cache.pin(key, False)
                elif self._cache.pin(key, True):
                    self._pending.pop(key, None)
                    self._set(key, now + seconds)
                elif key in self._pending or len(self._pending) < MAX_PENDING_PINS:
                    self._pending[key] = seconds
                    self._set(key, now + min(seconds, PENDING_PIN_S))
                else:
                    self.refused += 1
            self._compact()

    def _set(self, key: bytes, until: float) -> None:
        self._until[key] = until
        heapq.heappush(self._deadlines, (until, key))

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the live pins: renewals cost no memory."""
        if len(self._deadlines) > 2 * len(self._until) + 1024:
            self._deadlines = [(u, k) for k, u in self._until.items()]
            heapq.heapify(self._deadlines)

    def holds(self, key: bytes) -> bool:
        """Whether `key` has a live pin (a block committed under it now is committed pinned)."""
        with self._lock:
            return self._until.get(key, 0.0) > time.monotonic()

    def claim(self, key: bytes) -> bool:
        """`holds(key)`, for a block being committed under `key`: a pin that was waiting for this
        block now runs its whole length."""
        now = time.monotonic()
        with self._lock:
            if self._until.get(key, 0.0) <= now:
                return False
            seconds = self._pending.pop(key, None)
            if seconds is not None:
                self._set(key, now + seconds)
            return True

    def counts(self) -> dict[str, int]:
        """Live pins, those still waiting for their blocks, and pins refused so far."""
        with self._lock:
            return {"pins": len(self._until), "pending_pins": len(self._pending), "pins_refused": self.refused}

    def expire(self) -> None:
        """Unpin the keys whose pins have expired."""
        with self._lock:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            until, key = heapq.heappop(self._deadlines)
            if self._until.get(key) == until:
                del self._until[key]
                self._pending.pop(key, None)
                self._cache.pin(key, False)

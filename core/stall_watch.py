"""A worker that stalled catches up before it serves reads again.

A client takes a worker that does not answer within its timeout as down for a while (`fanout.SUSPECT_S`),
and with replicas its puts and removes go on with the key's other owner alone. A worker paused for
less than the member TTL (SIGSTOP, a VM frozen, a debugger) stays a member and is not fenced by its
heartbeats: it wakes up holding the older copies of what was written meanwhile. The client that wrote
tells it (`kvpool.core.missed_writes`), but only while that client lives; once the other owner loses
the newer copy (evicted, or a removal forgotten in a restart), the older one would be served.

So a worker in a cluster runs a stall watch: a thread that ticks every `TICK_S` and pushes the cache's
stall deadline to `STALL_S` past the time it ticked (`ReplicaState.stall_until`). A process stalled
past it wakes up with its reads closed (misses) before any request thread can serve one; the watch's
next tick sees the gap and has the worker fence its reads and catch up from its peers since the stall
began, as after lapsed heartbeats (`kvpool.core.catch_up`). The deadline counts from the time the tick
checked, not from when it is set: a process stopped between the two wakes with it past (an adversarial
check stopped it there: 0.2 s of older copies served, then repaired onto the other owner). Setting it
takes no lock, so a long holder of the cache's lock (a clear of a million keys) is not a stall.

A client can leave a worker out of a write only once it failed to answer within the client's timeout,
so with replicas clients must wait at least `STALL_S` (`ClientConfig`: a ConfigError otherwise): a
worker that answered every request within it was never left out. A worker kept from running that long
by its own load (its GIL held a second) catches up too: misses for a moment, never older bytes.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .replica_state import ReplicaState

__all__ = ["StallWatch", "STALL_S", "TICK_S"]

STALL_S = 1.0
"""Seconds without a tick after which a worker takes itself as having stalled."""
TICK_S = 0.2


class StallWatch:
    """The thread that pushes `replicas`' stall deadline and calls `on_stall(seconds)` after a stall,
    until `stop` is set."""

    def __init__(self, replicas: ReplicaState, on_stall: Callable[[float], None], stop: threading.Event) -> None:
        self._replicas, self._on_stall, self._stop = replicas, on_stall, stop
        replicas.stall_until(time.monotonic() + STALL_S)
        self.thread = threading.Thread(target=self._run, name="kvpool-stall-watch", daemon=True)
        """Ends within a tick of `stop` being set."""
        self.thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            gap, last = now - last, now
            if gap > STALL_S:  # reads closed since the deadline passed: fenced before they open again
                self._on_stall(gap)
            self._replicas.stall_until(now + STALL_S)

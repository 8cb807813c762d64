"""Read repair for cluster clients: after a read found owners holding an older block (or missing a removal)
than the newest an owner answered, the newest is written to them in the background (`Repairs`)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .background import Background
from .buffers import readable
from .errors import KVPoolError
from .fanout import FanOut, Transport
from .records import WorkerInfo

__all__ = ["Groups", "Repair", "Repairs", "live_groups"]

log = logging.getLogger("kvpool.client")

Groups = dict[str, list[int]]
"""Key indices by the worker asked about them."""


@dataclass
class Repair:
    """Owners of `key` found holding something older than `version`: the block of `size` bytes read
    into `buffer`, or (`buffer` None) the key's removal."""

    key: bytes
    owners: list[str]
    version: int
    buffer: Any
    size: int


def live_groups(live: dict[str, WorkerInfo], groups: Groups) -> Groups:
    """`groups` less the workers that are no members of `live` now. A job in the background takes the
    member list when it runs, not when it was queued: a worker restarted meanwhile is reached at its new
    process (an older list would have it asked at the old one's address, and its connection replaced
    by one that leads nowhere), and one that left is not asked."""
    return {w: idx for w, idx in groups.items() if w in live}


class Repairs:
    """Read repair: writes the newest block (or removal) read to the owners that answered with an older
    one, in one background thread, each batch under its own `timeout_s`. Bytes are copied before the
    read returns (the caller owns its buffers); at most `max_pending` keys wait, beyond which repairs
    are skipped (the next read of the key repairs it). A repair reaches its owners as `members()` gives
    them when it runs (`live_groups`)."""

    def __init__(self, fanout: FanOut, members: Callable[[], dict[str, WorkerInfo]], timeout_s: float,
                 max_pending: int = 4096) -> None:
        self.fanout = fanout
        self.members = members
        self.timeout_s = timeout_s
        self._queue = Background("kvpool-repair", max_pending)
        self.done = 0
        """Keys repaired (an owner answered the repair)."""
        self._lock = threading.Lock()

    def submit(self, repairs: list[Repair]) -> None:
        if not repairs:
            return
        jobs: list[tuple[Repair, bytes | None]] = []
        for r in repairs:
            jobs.append((r, None if r.buffer is None else bytes(readable(r.buffer)[:r.size])))
        self._queue.submit(len(jobs), lambda: self._run(jobs))  # full: skipped

    def _run(self, jobs: list[tuple[Repair, bytes | None]]) -> None:
        try:
            puts: Groups = {}
            removes: Groups = {}
            for j, (r, data) in enumerate(jobs):
                for w in r.owners:
                    (removes if data is None else puts).setdefault(w, []).append(j)

            def put(t: Transport, idx: list[int]) -> None:
                t.batch_put([jobs[j][0].key for j in idx], [jobs[j][1] for j in idx], 0.0,
                            [jobs[j][0].version for j in idx])

            def remove(t: Transport, idx: list[int]) -> list[bool]:
                return t.batch_remove([jobs[j][0].key for j in idx], [jobs[j][0].version for j in idx])

            deadline = time.monotonic() + self.timeout_s
            live = self.members()
            done = sum(len(idx) for _, idx, _ in self.fanout.each(live, live_groups(live, puts), put, deadline))
            done += sum(len(idx) for _, idx, _ in self.fanout.each(live, live_groups(live, removes), remove,
                                                                   deadline))
            with self._lock:
                self.done += done
        except KVPoolError as e:  # a repair that fails is retried by the next read of its key
            log.debug("read repair of %d keys failed: %s", len(jobs), e)

    def wait(self) -> None:
        """Until the repairs submitted so far are done (tests, shutdown)."""
        self._queue.wait()

    def close(self) -> None:
        """Drop the repairs not begun; wait for the one under way (its fan-out closed first, it fails fast)."""
        self._queue.close()

"""Writes an owner missed: a cluster client's puts and removes that went on without one of a key's
owners, delivered to that owner once it answers again.

With replicas, a put or remove is acknowledged once an owner of each key took it; an owner that was
suspect (`FanOut`: it failed a call in the last seconds) or failed within the call is left out. If it
stays a member (paused for less than the member TTL, say), it keeps the older block it held, meant to
be outvoted at reads by the owners that took the write. That holds only while they keep the write:
once one evicts the newer block, or restarts and forgets a removal (removals live in memory), the
left-out owner's older block is the newest anyone knows of, served and repaired back (found by an
adversarial check: stale bytes after a 2 s pause and ordinary eviction).

So each owner left out is sent a removal of its copies older than the write (`remove_as_of`): at the
removal's version, or just below the put's, so that a block as new or newer stays and the put's own
version is still welcome (from a read repair). It is sent at once and again every `RETRY_S` until the
owner answers, even while the client still takes it as down (`fanout.SUSPECT_S`): an owner that was
paused finds the request waiting as it resumes, not seconds later (meanwhile a reader in another process
that found the newest copy evicted took its older one: an adversarial check, 20 of 20 stale reads 0.1 s
after the resume). Until it is delivered, reads outvote it as before.

What is owed lives in this client: one that closes tries once more (within its timeout), and one that
dies before the owner answers again leaves it untold. A worker that was paused finds out by itself
(`kvpool.core.stall_watch`) and catches up from its peers; one that only this client could not reach
(a partition) is then left with its older copies.

A worker that leaves the cluster has its missed writes dropped: one that comes back after the member
TTL is fenced and catches up from its peers' change logs, which hold them. At most `MAX_PENDING` keys
wait; past that, new ones are dropped and that is logged once.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from .errors import KVPoolError
from .fanout import FanOut, Transport
from .records import WorkerInfo

__all__ = ["MissedWrites", "MAX_PENDING", "RETRY_S"]

log = logging.getLogger("kvpool.cluster")

MAX_PENDING = 1 << 16
"""Keys that may wait for their owner at once, over all owners."""
RETRY_S = 0.5
"""How long after a failed delivery it is tried again (each try is bounded by the client's timeout)."""


class MissedWrites:
    """The removals owed to owners that a put or remove went on without (see the module's doc), sent by
    one thread of their own, started at the first and ended by `close`."""

    def __init__(self, fanout: FanOut, members: Callable[[], dict[str, WorkerInfo]], timeout_s: float) -> None:
        self.fanout = fanout
        self.members = members
        self.timeout_s = timeout_s
        self._owed: dict[str, dict[bytes, int]] = {}  # worker -> key -> the version to remove as of
        self._count = 0
        self._full_logged = False
        self._failed_logged = False
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.delivered = 0
        """Keys whose removal an owner answered."""

    def missed(self, worker: str, keys: Sequence[bytes], versions: Sequence[int]) -> None:
        """`worker` did not take these keys' writes: remove its copies of each as of its version."""
        with self._cond:
            if self._closed:
                return
            owed = self._owed.setdefault(worker, {})
            for k, v in zip(keys, versions):
                if k in owed:
                    owed[k] = max(owed[k], v)
                elif self._count < MAX_PENDING:
                    owed[k] = v
                    self._count += 1
                elif not self._full_logged:
                    self._full_logged = True
                    log.warning("%d keys already wait for owners that missed their writes; more are not kept "
                                "(such an owner may serve an older copy once the others lose theirs; logged "
                                "once)", MAX_PENDING)
            if not owed:
                del self._owed[worker]
            if self._thread is None and self._owed:
                self._thread = threading.Thread(target=self._run, name="kvpool-missed-writes", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return self._count

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._owed:
                    self._cond.wait()
                if self._closed:
                    return
                owed = {w: dict(ks) for w, ks in self._owed.items()}
            try:
                self._deliver(owed)
            except KVPoolError as e:  # (the client closed meanwhile, say): tried again, or dropped by close
                log.debug("removals owed to workers that missed writes not sent: %s", e)
            except Exception:  # a bug: logged (a warning the first time), and tried again rather than ending the thread
                log.log(logging.DEBUG if self._failed_logged else logging.WARNING,
                        "removals owed to workers that missed writes failed", exc_info=True)
                self._failed_logged = True
            with self._cond:
                if self._owed and not self._closed:
                    self._cond.wait(RETRY_S)

    def _deliver(self, owed: Mapping[str, dict[bytes, int]]) -> None:
        """Send each member its owed removals; forget those it answered, and those of a worker gone."""
        live = self.members()
        jobs: list[tuple[bytes, int]] = []
        groups: dict[str, list[int]] = {}
        for w, ks in owed.items():
            if w in live:
                groups[w] = list(range(len(jobs), len(jobs) + len(ks)))
                jobs += ks.items()

        def remove(t: Transport, idx: list[int]) -> None:
            t.remove_as_of([jobs[j][0] for j in idx], [jobs[j][1] for j in idx])

        done = {w: [jobs[j] for j in idx]
                for w, idx, _ in self.fanout.each(live, groups, remove, time.monotonic() + self.timeout_s,
                                                  suspects=True)}
        with self._cond:
            for w in list(self._owed):
                if w not in live:
                    self._count -= len(self._owed.pop(w))
            for w, sent in done.items():
                mine = self._owed.get(w, {})
                for k, v in sent:
                    if mine.get(k) == v:  # (a newer write it missed meanwhile stays owed)
                        del mine[k]
                        self._count -= 1
                        self.delivered += 1
                if not mine:
                    self._owed.pop(w, None)

    def close(self) -> None:
        """Stop the thread (after the delivery under way), then try once more to deliver what is owed,
        within the client's timeout (the fan-out is still open: `ClusterBackend.close`), so that a client
        that closes normally leaves nothing untold to an owner that answers; what is still owed after
        that is dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:
            owed = {w: dict(ks) for w, ks in self._owed.items()}
        if owed:
            try:
                self._deliver(owed)
            except KVPoolError as e:
                log.debug("removals owed to workers that missed writes not sent at close: %s", e)
        with self._cond:
            if self._owed:
                log.debug("client closed with removals owed to %d workers that missed writes", len(self._owed))
            self._owed.clear()
            self._count = 0

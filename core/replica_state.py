"""What replicas compare and a returning worker needs, over one cache's tiers: the newest version known
of each key (its block's, else its removal's), the fence that keeps a worker back from an absence
from serving blocks it cannot vouch for, and the log of changes peers ask for when they catch up
(`kvpool.core.catch_up`). `TieredCache.replicas` is one."""
from __future__ import annotations

import time
from collections.abc import Sequence

from .tier_stack import TierStack
from .versions import CLEAR, CLOCK, CLOCK_SKEW_MS, COUNTER_BITS, REMOVE, Change, ceiling

__all__ = ["ReplicaState"]


class ReplicaState:
    """Versions, fence and change log of the cache whose tiers are `stack` (under its lock)."""

    def __init__(self, stack: TierStack) -> None:
        self._stack = stack
        self._lock = stack.lock
        self._fences = 0  # `fence(True)`s not yet ended

    def batch_versions(self, keys: Sequence[bytes]) -> tuple[list[bool], list[int]]:
        """Whether each key's block is present (as `batch_exists`) and the newest version known of it:
        its block's if present, else its removal's (0 if neither). While fenced (`fence`), only what
        it accepted since."""
        now = time.time()
        with self._lock:
            stack = self._stack
            stack.check_open()
            held = stack.presence(list(keys), now)
            floor = stack.readable_from
            return held, [stack.version_of(k) if h else _at_least(stack.removed_version(k), floor)
                          for k, h in zip(keys, held)]

    def removed_versions(self, keys: Sequence[bytes]) -> list[int]:
        """The version of each key's last removal (its tombstone's while kept, or a clear's); 0 if none."""
        with self._lock:
            floor = self._stack.readable_from
            version = self._stack.removed_version
            return [_at_least(version(k), floor) for k in keys]

    def fence(self, on: bool) -> None:
        """While fenced, reads and lookups are misses (a worker that may hold blocks it has not yet
        learnt are outdated), but for blocks stamped after the fence began (later than any clock
        `CLOCK_SKEW_MS` behind this one): those are newer than anything it can have missed. Writes go on.
        Fences nest (a catch-up after a start, another after a lapse meanwhile): reads open again at the
        last `fence(False)`, and only blocks newer than the latest fence's start are read till then."""
        with self._lock:
            if on:
                self._fences += 1
                self._stack.fence(max(ceiling(), int(self._stack.fence_floor)))
            else:
                self._fences = max(0, self._fences - 1)
                if not self._fences:
                    self._stack.fence(0)

    def fence_after(self, seconds: float) -> None:
        """Reads become misses `seconds` from now unless this is called again first (a watchdog: a
        worker calls it at each heartbeat, so a process that was paused longer wakes up fenced)."""
        with self._lock:
            self._stack.fence_at = time.monotonic() + seconds

    def current(self) -> bool:
        """Whether it can vouch for every block it holds now: reads neither fenced (a catch-up pending) nor
        past the heartbeat or stall deadline (an absence that the catch-up has yet to follow)."""
        return self._stack.readable_from == 0

    def stall_until(self, deadline: float) -> None:
        """Reads are misses after `deadline` (monotonic seconds) unless this is called again first: the
        stall watch's own deadline (`kvpool.core.stall_watch`). Set without the cache's lock (one
        attribute), so that a long holder of it (a clear of a million keys) is not taken for a stall."""
        self._stack.stall_at = deadline

    def changes_since(self, since_ms: int, from_seq: int = 0, limit: int = 1 << 15) -> tuple[list[Change], int, int]:
        """The changes accepted at or after `since_ms` (unix ms; `versions.ChangeLog.since`), the
        sequence number to ask from next (-1: none left), and the time since which the log is complete."""
        with self._lock:
            changes = self._stack.changes
            out, nxt = changes.since(since_ms, from_seq, limit)
            return out, nxt, changes.covered_since_ms

    def apply_changes(self, changes: Sequence[tuple[bytes, int, int]]) -> int:
        """Catch up on (key, version, kind) changes a peer accepted while this cache was away: a block
        older than one of them is dropped (a miss: this cache lacks the newer bytes) and the change is
        remembered (a tombstone; a clear's mark), so no older put brings it back. A clear (`key` its
        prefix) drops every block under the prefix older than it. Returns blocks dropped."""
        with self._lock:
            stack = self._stack
            stack.check_open()
            doomed: list[bytes] = []
            for k, v, kind in changes:
                CLOCK.observe(v)
                if kind == CLEAR:
                    stack.clears.add(k, v)
                    doomed += [key for key in stack.keys_with_prefix(k) if stack.version_of(key) < v]
                    continue
                if stack.version_of(k) >= v:
                    continue
                stack.tombstones.add(k, v if kind == REMOVE else v - 1)  # v itself is still welcome
                doomed.append(k)
            return sum(stack.remove(list(dict.fromkeys(doomed)))) if doomed else 0

    def supersede(self, keys: Sequence[bytes], versions: Sequence[int]) -> int:
        """Each key was written (or removed) at its owners as of its version, after this worker, now below
        them, stopped owning it (`kvpool.core.succession`): a block held of it goes, if stamped before
        that version or up to `CLOCK_SKEW_MS` after it (another writer's clock may run that far ahead of
        this one's), with a tombstone just below the version (that version itself is still welcome: a
        replica answering with its block wins a read). A key not held is left alone (most are: no
        tombstone). Returns blocks dropped.

        Each also goes into the change log, as a put of that version: a worker that held the key before
        and was away meanwhile learns of it when it catches up here, though the owners that took the
        write may have left by then (with R=1 the newer version's only copy went with them)."""
        margin = CLOCK_SKEW_MS << COUNTER_BITS
        with self._lock:
            stack = self._stack
            stack.check_open()
            if versions:
                CLOCK.observe(max(versions))  # (the clock only moves: observing the newest is observing each)
            stack.changes.record(keys, versions, False)
            doomed: list[bytes] = []
            version_of = stack.version_of
            for k, v in zip(keys, versions):
                held = version_of(k)
                if held and held < v + margin:
                    stack.tombstones.add(k, v - 1)
                    doomed.append(k)
            return sum(stack.remove(list(dict.fromkeys(doomed)))) if doomed else 0

    def covered_since(self, since_ms: int) -> None:
        """The change log holds everything accepted since `since_ms` (unix ms): this cache accepted
        nothing between then and now (its last sign of life before this start)."""
        with self._lock:
            self._stack.changes.covered_since_ms = since_ms


def _at_least(version: int, floor: float) -> int:
    """`version`, or 0 if it is below `floor` (what a fenced cache cannot vouch for)."""
    return version if version >= floor else 0

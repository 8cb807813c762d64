"""Block versions: a hybrid logical clock, the tombstones removes leave, and a worker's log of recent changes.

A version is a u64 `wall_ms << 16 | counter` stamped by the writer (`stamp`): it follows wall time,
never goes back in one process, and is merged with every version the process sees (`observe`), so a
write that follows a read of version v is stamped above v even on a slower clock. 0 means "none".
A worker keeps the newest version of each key: a put or remove older than what it holds (a block or a
tombstone) changes nothing, so replicas converge whatever order writes reach them in.
"""
from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

import numpy as np

__all__ = ["REMOVED", "SUPERSEDED", "COUNTER_BITS", "CLOCK_SKEW_MS", "HybridClock", "CLOCK", "stamp", "observe",
           "ceiling", "capped", "wall_ms_of", "Tombstones", "Clears", "Change", "ChangeLog", "PUT", "REMOVE", "CLEAR"]

REMOVED, SUPERSEDED = 1, 2
"""A removal's outcome per key beside 0 (nothing to remove): removed; not removed, because a block of the
key as new as the removal or newer is held (a REMOVE reply's flags)."""
COUNTER_BITS = 16
CLOCK_SKEW_MS = 2000
"""How far apart the wall clocks of two processes of a pool may be, in ms (what versions order
correctly across writers; NTP keeps machines far closer)."""
_COUNTER_MASK = (1 << COUNTER_BITS) - 1


def wall_ms_of(version: int) -> int:
    """The wall-clock milliseconds a version was stamped at (about: see `HybridClock`)."""
    return version >> COUNTER_BITS


class HybridClock:
    """A hybrid logical clock: `now()` returns versions strictly increasing in this process, at least the
    wall clock (ms) shifted by `COUNTER_BITS`, and above every version passed to `observe`. Thread-safe."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def now(self) -> int:
        wall = int(time.time() * 1000) << COUNTER_BITS
        with self._lock:
            self._last = max(self._last + 1, wall)
            return self._last

    def observe(self, version: int) -> None:
        """Merge a version seen (read, received): later stamps are above it. A version stamped more
        than CLOCK_SKEW_MS ahead of this clock counts as stamped that far ahead, no further: a forged
        or broken one must not push this process's writes into the future (where they would beat
        every other writer's later ones, or overflow the u64)."""
        if version > self._last:
            top = ceiling()
            with self._lock:
                self._last = max(self._last, min(int(version), top))

    def batch(self, n: int) -> list[int]:
        """`n` versions at once, consecutive."""
        return list(self._range(n))

    def batch_array(self, n: int) -> np.ndarray:
        """`batch(n)` as a little-endian uint64 array (a request's column), made without Python ints."""
        r = self._range(n)
        return np.arange(r.start, r.stop, dtype="<u8")

    def _range(self, n: int) -> range:
        wall = int(time.time() * 1000) << COUNTER_BITS
        with self._lock:
            first = max(self._last + 1, wall)
            self._last = first + n - 1
        return range(first, first + n)


CLOCK = HybridClock()
"""This process's clock: every writer in it stamps from here."""


def stamp() -> int:
    """A new version from this process's clock."""
    return CLOCK.now()


def ceiling() -> int:
    """The newest version a version stamped now may carry: CLOCK_SKEW_MS ahead of this clock."""
    return (int(time.time() * 1000) + CLOCK_SKEW_MS) << COUNTER_BITS


def capped(versions: np.ndarray) -> np.ndarray:
    """`versions` (uint64s a peer sent: a put's, a removal's) with each past `ceiling()` brought down to it.
    A worker keeps what it is sent as sent, so one stamped far ahead (a broken clock, a garbage column)
    would beat every later put of its key, for good; capped, it beats those stamped in the next
    CLOCK_SKEW_MS only (a writer superseded by it stamps again above it)."""
    top = ceiling()
    if versions.size and int(versions.max()) > top:
        out: np.ndarray = np.minimum(versions, np.uint64(top))
        return out
    return versions


def observe(version: int) -> None:
    CLOCK.observe(version)


def namespace(key: bytes) -> bytes:
    """The namespace a key (or a cleared prefix) is in, for the marks' bounds: up to its first `/` (a
    tenant's `<name>/`); b"" for one without."""
    i = key.find(b"/")
    return key[:i + 1] if i >= 0 else b""


class Tombstones:
    """Keys removed, by the version of their removal, kept for `keep_s` seconds and at most `max_keys`
    (the oldest go first): while one is kept, a put of that key older than the removal is ignored, so
    an old put that arrives late (a replica back from a pause, a repair) cannot bring the key back. A
    namespace (`namespace`: a tenant's) holding more than an eighth of them gives up its own oldest to
    make room for its next: one tenant's crowd of removals does not push out another's marks."""

    def __init__(self, keep_s: float = 600.0, max_keys: int = 1 << 18) -> None:
        self.keep_s = keep_s
        self.max_keys = max_keys
        self._marks: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # key -> (version, monotonic at)
        self._by_ns: dict[bytes, OrderedDict[bytes, None]] = {}  # each namespace's keys, oldest first

    def __len__(self) -> int:
        return len(self._marks)

    def add(self, key: bytes, version: int) -> None:
        old = self._marks.pop(key, None)
        if old is not None and old[0] > version:
            version = old[0]
        self._marks[key] = (version, time.monotonic())
        ns = namespace(key)
        own = self._by_ns.setdefault(ns, OrderedDict())
        own.pop(key, None)
        own[key] = None
        self._trim(ns)

    def discard(self, key: bytes) -> None:
        if self._marks.pop(key, None) is not None:
            self._forget(key)

    def none_of(self, keys: list[bytes]) -> bool:
        """Whether none of `keys` has a tombstone kept (expired ones may count: a caller then takes
        the per-key path, which trims them)."""
        return not self._marks or self._marks.keys().isdisjoint(keys)

    def version(self, key: bytes) -> int:
        """The version of `key`'s removal if it is still kept, else 0."""
        mark = self._marks.get(key)
        if mark is None:
            return 0
        if time.monotonic() - mark[1] > self.keep_s:
            self._trim()
            return 0 if key not in self._marks else self._marks[key][0]
        return mark[0]

    def _trim(self, adding: bytes | None = None) -> None:
        """Down to `max_keys` (the namespace `adding` to gives up its own oldest where it holds more than an
        eighth, else the oldest go), and none older than `keep_s`."""
        marks = self._marks
        horizon = time.monotonic() - self.keep_s
        while marks:  # (first: a namespace gives up a live mark of its own only where the table is full of live ones)
            key, (_, at) = next(iter(marks.items()))
            if at > horizon:
                break
            del marks[key]
            self._forget(key)
        while len(marks) > self.max_keys:
            own = self._by_ns.get(adding) if adding is not None else None
            key = next(iter(own if own is not None and len(own) > max(1, self.max_keys // 8) else marks))
            del marks[key]
            self._forget(key)

    def _forget(self, key: bytes) -> None:
        """`key` out of its namespace's list (its mark gone)."""
        ns = namespace(key)
        own = self._by_ns.get(ns)
        if own is not None:
            own.pop(key, None)
            if not own:
                del self._by_ns[ns]

    def clear(self) -> None:
        self._marks.clear()
        self._by_ns.clear()


class Clears:
    """The clears a cache accepted, as prefix -> version: a key under a cleared prefix counts as removed
    as of the clear's version unless a newer block of it is held (b"": every key). Unlike tombstones, a
    clear is one mark however many keys it covered, or covered on a peer while this cache was away.
    A lookup costs one dict probe per distinct prefix length; the newest `max_marks` clears are kept
    (by version, a namespace holding more than an eighth giving up its own first, as `Tombstones`; a
    clear of every key replaces them all)."""

    def __init__(self, max_marks: int = 1024) -> None:
        self.max_marks = max_marks
        self._marks: dict[bytes, int] = {}
        self._lengths: list[int] = []  # the distinct lengths of the marked prefixes
        self.newest = 0
        """The newest clear's version (0: none): a block stamped above it is not under any clear."""

    def __bool__(self) -> bool:
        return bool(self._marks)

    def add(self, prefix: bytes, version: int) -> None:
        if self.version(prefix) >= version:
            return  # a clear as new or newer already covers it
        marks = {p: v for p, v in self._marks.items() if not (p.startswith(prefix) and v <= version)}
        marks[prefix] = version
        own = namespace(prefix)
        while len(marks) > self.max_marks:  # the oldest clears go first: the clearing namespace's own where it
            mine = [(v, p) for p, v in marks.items() if namespace(p) == own]  # holds more than an eighth (one
            # tenant's clears do not push out another's)
            pool = mine if len(mine) > max(1, self.max_marks // 8) else [(v, p) for p, v in marks.items()]
            del marks[min(pool)[1]]
        self._marks = marks
        self._lengths = sorted({len(p) for p in marks})
        self.newest = max(self.newest, version)

    def version(self, key: bytes) -> int:
        """The version of the newest clear that covered `key` (0 if none)."""
        marks = self._marks
        best = 0
        for n in self._lengths:
            if n > len(key):
                break
            v = marks.get(key[:n], 0)
            if v > best:
                best = v
        return best


PUT, REMOVE, CLEAR = 0, 1, 2
"""A change's kind: a block stored, a removal, a clear (its `key` is then the prefix cleared)."""


@dataclass(frozen=True, slots=True)
class Change:
    """One write a worker accepted: `key` got `version` (`kind`: a block, a removal; or every key under
    the prefix `key` was cleared) at `at_ms` (its wall clock)."""

    key: bytes
    version: int
    kind: int
    at_ms: int


class _Batch(NamedTuple):
    """The changes of one `ChangeLog.record`: keys and their versions, of one kind, at one time."""

    keys: tuple[bytes, ...]
    versions: tuple[int, ...]
    kind: int
    at_ms: int
    seq: int  # the sequence number of its first change


class ChangeLog:
    """The last `max_entries` changes a worker accepted, in the order it accepted them, numbered.

    `covered_since_ms` is the wall time (ms) since which the log holds every change accepted: it starts
    at `covered_since_ms` given (a worker's last sign of life before this start: it accepted nothing
    between then and now) and moves forward as old entries are dropped. A worker back from an absence
    asks its peers for their changes since it left (`since`); a peer whose log does not reach that far
    back says so, and the returning worker drops what it cannot prove fresh."""

    def __init__(self, covered_since_ms: int = 0, max_entries: int = 1 << 18) -> None:
        self.max_entries = max_entries
        self.covered_since_ms = covered_since_ms
        self._batches: deque[_Batch] = deque()
        """Each `record`'s changes kept together (a same-node put's commit records 32-64 at once; a tuple
        each, and its trim one by one, cost a worker 8-20 us a commit), oldest first."""
        self._len = 0  # changes held: those of the batches, less those of the first before `_first_seq`
        self._first_seq = 0  # sequence number of the first change held (the log keeps exactly max_entries)
        self._last_ms = 0  # times only grow, whatever the wall clock does

    def __len__(self) -> int:
        return self._len

    @property
    def next_seq(self) -> int:
        """The sequence number of the next change recorded."""
        return self._first_seq + self._len

    def puts_since(self, seq: int) -> set[bytes] | None:
        """The keys of the puts recorded from sequence number `seq` on; None where the log no longer
        reaches back that far. (Walks those changes' batches only, from the newest.)"""
        if seq < self._first_seq or seq > self.next_seq:
            return None
        out: set[bytes] = set()
        for b in reversed(self._batches):
            if b.seq + len(b.keys) <= seq:
                break
            if b.kind == PUT:
                out.update(b.keys[max(seq - b.seq, 0):])
        return out

    def record(self, keys: Iterable[bytes], versions: Iterable[int], removed: bool) -> None:
        self._add(keys, versions, REMOVE if removed else PUT)

    def record_clear(self, prefix: bytes, version: int) -> None:
        self._add((prefix,), (version,), CLEAR)

    def _add(self, keys: Iterable[bytes], versions: Iterable[int], kind: int) -> None:
        at = self._last_ms = max(int(time.time() * 1000), self._last_ms)
        ks, vs = tuple(keys), tuple(versions)  # (copies: a caller's list is its own)
        if len(ks) != len(vs):  # (a change is a key and its version: the pairs there are)
            n = min(len(ks), len(vs))
            ks, vs = ks[:n], vs[:n]
        if not ks:
            return
        batches = self._batches
        batches.append(_Batch(ks, vs, kind, at, self.next_seq))
        self._len += len(ks)
        excess = self._len - self.max_entries
        if excess <= 0:
            return
        self._len -= excess
        self._first_seq += excess
        gone_ms = 0
        while batches and batches[0].seq + len(batches[0].keys) <= self._first_seq:
            gone_ms = batches.popleft().at_ms
        if batches and batches[0].seq < self._first_seq:
            gone_ms = batches[0].at_ms  # (changes of it dropped: the newest dropped; times only grow)
        self.covered_since_ms = max(self.covered_since_ms, gone_ms + 1)

    def _batch_of(self, seq: int) -> int:
        """The index of the batch holding sequence number `seq` (one held)."""
        return bisect.bisect_right(self._batches, seq, key=attrgetter("seq")) - 1  # (their first numbers grow)

    def _first_at(self, since_ms: int) -> int:
        """The sequence number of the first change held at or after `since_ms` (`next_seq` if none)."""
        batches = self._batches
        i = bisect.bisect_left(batches, since_ms, key=attrgetter("at_ms"))  # (their times grow)
        return max(batches[i].seq, self._first_seq) if i < len(batches) else self.next_seq

    def since(self, since_ms: int, from_seq: int = 0, limit: int = 1 << 15) -> tuple[list[Change], int]:
        """Up to `limit` changes accepted at or after `since_ms`, from sequence number `from_seq` on;
        and the sequence number to ask from next (-1: none left)."""
        seq = max(from_seq, self._first_seq)
        if seq == self._first_seq:  # (a first page: changes are in acceptance order, their times only grow)
            seq = self._first_at(since_ms)
        out: list[Change] = []
        if seq < self.next_seq:
            changes = (Change(b.keys[i], b.versions[i], b.kind, b.at_ms)
                       for b in itertools.islice(self._batches, self._batch_of(seq), None)
                       for i in range(max(seq - b.seq, 0), len(b.keys)))
            out = list(itertools.islice(changes, max(limit, 0)))
        end = seq + len(out)
        return out, (end if end < self.next_seq else -1)

"""Pointer-addressed block I/O over PoolClient, shared by the FastDeploy and Mooncake-API adapters.

Engines written against Mooncake register pinned host buffers up front, then hand over raw pointers
into them and expect one integer status per key. `HostIO` turns (pointer, size) into zero-copy numpy
views of the registered buffers, moves the bytes through a `PoolClient`, and turns every pool failure
into a status (logged once per outage), so the engine never sees an exception from the pool.
"""
from __future__ import annotations

import bisect
import ctypes
import enum
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvpool.core import (
    CapacityError,
    InvalidArgument,
    KVPoolError,
    PartialFailure,
    PartialPut,
    PoolClient,
    PoolUnavailable,
    StorageError,
    key_bytes,
)

from ._mapped import first_inaccessible

T = TypeVar("T")


class Status(enum.IntEnum):
    """Mooncake's status codes (mooncake-store `types.h`): what Mooncake-style engines test for."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200
    """No room in the pool (every candidate block is leased or pinned)."""
    INVALID_PARAMS = -600
    """A bad key, a size <= 0, a block larger than the pool's max block, a destination smaller than
    the block, or a pointer range that is not inside one registered buffer."""
    OBJECT_NOT_FOUND = -704
    """A miss."""
    RPC_FAIL = -900
    """The pool cannot be reached (worker down, no live worker, timeout)."""


STATUS_OF_ERROR: tuple[tuple[type[BaseException], Status], ...] = (
    (StorageError, Status.INTERNAL_ERROR),  # done, not durable (a worker's full disk): the pool answers, no outage
    (PoolUnavailable, Status.RPC_FAIL),  # includes PoolTimeout
    (OSError, Status.RPC_FAIL),          # AuthError, and socket/shm errors not typed on the way up
    (CapacityError, Status.NO_AVAILABLE_HANDLE),
    (ValueError, Status.INVALID_PARAMS),  # InvalidKey, InvalidArgument, BlockTooLarge, BufferSizeError, ConfigError
    (KVPoolError, Status.INTERNAL_ERROR),  # ProtocolError, PoolClosed, anything newer
)
"""How each pool error becomes a status; first match wins. Only errors of these types are caught."""


def prefixed(prefix: str, keys: Sequence[Any]) -> list[Any]:
    """`keys` in the namespace `prefix` (none: as they are). A key that is not a str has no name there:
    it becomes None, an invalid key, so its item fails INVALID_PARAMS (a bytes key would otherwise
    escape the namespace, and anything else raise into the engine)."""
    if not prefix:
        return list(keys)
    return [prefix + k if isinstance(k, str) else None for k in keys]


MODEL_CHARS = 128
"""Longest model name kept as it is in keys (`model_part`)."""


def model_part(name: str) -> str:
    """A model's part of every key: its name, or beyond MODEL_CHARS characters its SHA-256 (a long
    model path pushed every key past the pool's 511 bytes, and every block was refused)."""
    if len(name) <= MODEL_CHARS:
        return name
    return "sha256-" + hashlib.sha256(name.encode(errors="surrogatepass")).hexdigest()


def status_of(err: BaseException) -> Status:
    """The status that reports `err` to an engine (INTERNAL_ERROR for anything unlisted)."""
    return next((st for cls, st in STATUS_OF_ERROR if isinstance(err, cls)), Status.INTERNAL_ERROR)


class HostBuffers:
    """Host memory regions registered by the engine, each kept as one writable numpy view (no copy).

    The engine owns the memory and keeps it alive while registered (FastDeploy and Mooncake users
    allocate these pinned buffers once, for the life of the process).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, np.ndarray] = {}  # base address -> view; changed under the lock
        # (bases sorted, their views): replaced whole, so a reader's one load is a consistent pair
        self._index: tuple[tuple[int, ...], tuple[np.ndarray, ...]] = ((), ())

    def register(self, ptr: int, size: int) -> None:
        """Make [ptr, ptr + size) addressable; re-registering a base address replaces its size."""
        ptr, size = int(ptr), int(size)
        if ptr <= 0 or size <= 0:
            raise InvalidArgument(f"cannot register buffer at {ptr:#x} of {size} bytes: need a non-null pointer and "
                                  "size > 0", size=size)
        bad = first_inaccessible(ptr, size)
        if bad is not None:  # a copy would kill the engine with SIGSEGV
            raise InvalidArgument(f"cannot register buffer at {ptr:#x} of {size} bytes: {bad:#x} is not host memory "
                                  "this process can read and write (GPU memory? kvpool's pointer calls take host "
                                  "buffers: pinned CPU memory)", size=size)
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))
        with self._lock:
            self._regions[ptr] = arr
            self._reindex()

    def unregister(self, ptr: int) -> bool:
        """Forget the buffer registered at base address `ptr`; False if there was none."""
        with self._lock:
            found = self._regions.pop(int(ptr), None) is not None
            self._reindex()
        return found

    def _reindex(self) -> None:
        bases = tuple(sorted(self._regions))
        self._index = (bases, tuple(self._regions[b] for b in bases))

    def view(self, ptr: int, size: int) -> np.ndarray | None:
        """A uint8 view of [ptr, ptr + size), or None unless the whole range lies in one registered buffer."""
        bases, arrays = self._index  # one consistent snapshot, no lock on the hot path
        i = bisect.bisect_right(bases, ptr) - 1
        while i >= 0:  # overlapping registrations are rare: look further down only if the nearest is short
            off = ptr - bases[i]
            if off + size <= arrays[i].size:
                return arrays[i][off:off + size]
            i -= 1
        return None

    def __len__(self) -> int:
        return len(self._index[0])


_RECONNECT_WAIT_S = 1.0
"""The longest `close` waits for a reconnect under way to end."""


def _first(fn: Callable[[PoolClient, list[int]], list[int]], item: int, client: PoolClient) -> int:
    """`fn`'s result for one item asked alone."""
    return fn(client, [item])[0]


class HostIO:
    """Block I/O between registered host buffers and the pool, with statuses instead of exceptions.

    `connect()` builds the PoolClient. A ConfigError from it raises here (a misconfiguration should be
    loud at start-up); an unreachable pool does not: it starts an outage. During an outage every call
    reports RPC_FAIL / a miss at once, without touching the pool, for `retry_s` seconds; then the next
    call tries again (one that must connect anew does so in a thread of its own, and reports a miss
    meanwhile). The first failure of each outage logs a warning, recovery logs once more.
    """

    def __init__(self, connect: Callable[[], PoolClient] | None, *, logger: logging.Logger,
                 retry_s: float = 1.0, buffers: HostBuffers | None = None) -> None:
        self.buffers = buffers if buffers is not None else HostBuffers()
        self.log = logger
        self.retry_s = retry_s
        self._connect = connect
        self._client: PoolClient | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0 if connect is not None else float("inf")  # no connect: closed until replaced
        self._closed = False  # `close` was called: for good (an outage's back-off never ends it)
        self._outage = False
        self._logged: set[str] = set()
        self._reconnecting: threading.Thread | None = None
        self._started = False
        self._pool()
        self._started = True

    @property
    def closed(self) -> bool:
        """True after close(), or when built without a way to connect: every call then fails."""
        return self._closed or self._retry_at == float("inf")

    # ----- the fail-soft boundary ------------------------------------------------------------

    def _pool(self) -> PoolClient | None:
        """The client, or None during an outage's back-off, or while a new one connects. The first is
        made at start-up, in the caller's thread; one made again after a failure (a cluster client may
        wait seconds for NATS) is made in a thread of its own (`_reconnect`): no engine call waits on it."""
        if self._client is not None and not self._outage:
            return self._client
        with self._lock:
            if self._closed or time.monotonic() < self._retry_at:
                return None
            if self._client is None and self._connect is not None:
                if self._started:
                    if self._reconnecting is None:
                        self._reconnecting = threading.Thread(target=self._reconnect, name="kvpool-reconnect",
                                                              daemon=True)
                        self._reconnecting.start()
                    return None
                try:
                    self._client = self._connect()
                except (KVPoolError, OSError) as e:
                    if status_of(e) != Status.RPC_FAIL:
                        raise  # a misconfiguration (ConfigError, ...): loud, at start-up
                    self._failed(e)
                    self._retry_at = time.monotonic() + self.retry_s
            return self._client

    def _reconnect(self) -> None:
        """Make the client again (`_pool`); the thread ends with the attempt, which the client's own
        timeouts bound. A client made after `close` is closed at once."""
        client: PoolClient | None = None
        try:
            assert self._connect is not None
            client = self._connect()
        except Exception as e:  # (anything: it must reach no engine thread, and the next attempt must come)
            with self._lock:
                if not self.closed:
                    self._failed(e)
                    self._retry_at = time.monotonic() + self.retry_s
        finally:
            with self._lock:
                self._reconnecting = None
                if client is not None and not self.closed:
                    self._client, client = client, None
            if client is not None:
                client.close()

    def _failed(self, err: BaseException) -> Status:
        """Report `err` once; an unreachable pool starts (or extends) an outage (not a `PartialFailure`:
        the workers that answered still serve)."""
        st = status_of(err)
        why = str(err)  # log text, not the error: a record must not keep its traceback (and sockets) alive
        if isinstance(err, PartialFailure):  # some worker did not answer in time; others did
            self.once("partial", "kvpool: %s: reported as RPC_FAIL for those, no outage (later ones are "
                      "logged at debug level)", why)
            return st
        if st == Status.RPC_FAIL:
            if self._closed:  # a call that was under way when the store closed: no outage, no reconnect
                return st
            self._retry_at = time.monotonic() + self.retry_s
            if not self._outage:
                self._outage = True
                self.log.warning("kvpool unavailable (%s): reporting misses, retrying every %.1f s", why, self.retry_s)
            else:
                self.log.debug("kvpool still unavailable: %s", why)
        else:
            self.once(type(err).__name__, "kvpool %s: %s (reported as %s; later ones are logged at debug level)",
                      type(err).__name__, why, st.name)
        return st

    def _ok(self) -> None:
        if self._outage:
            self._outage = False
            self.log.info("kvpool reachable again")

    def once(self, kind: str, msg: str, *args: Any) -> None:
        """Log `msg` as a warning the first time for `kind`, at debug level after that."""
        level = logging.DEBUG if kind in self._logged else logging.WARNING
        self._logged.add(kind)
        self.log.log(level, msg, *args)

    def call(self, fn: Callable[[PoolClient], T], fallback: Callable[[Status], T], *, proves: bool = False) -> T:
        """`fn(client)`, or `fallback(status)` when the pool is unavailable or answers with an error.
        `proves`: `fn` raises when no worker is reachable (a put), so its success ends an outage; a
        read or a query answers "absent" then (a miss in cluster mode), which proves nothing."""
        pool = self._pool()
        if pool is None:
            return fallback(Status.RPC_FAIL)
        try:
            result = fn(pool)
        except (KVPoolError, OSError) as e:
            return fallback(self._failed(e))
        if proves:
            self._ok()
        return result

    # ----- pointer-addressed batches ---------------------------------------------------------

    def _resolve(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
                 out: list[int]) -> tuple[list[int], list[bytes], list[list[np.ndarray]]]:
        """(indices, keys, views of each key's parts) of the well-formed items; the others get
        INVALID_PARAMS in `out`. A key's parts are (pointer, size) pairs, in order."""
        idx: list[int] = []
        raw: list[bytes] = []
        parts: list[list[np.ndarray]] = []
        for i, (key, key_ptrs, key_sizes) in enumerate(zip(keys, ptrs, sizes)):
            try:
                k = key_bytes(key)
            except KVPoolError as e:
                self.once("bad key", "kvpool: %s", str(e))
                out[i] = Status.INVALID_PARAMS
                continue
            views = self._views(key, key_ptrs, key_sizes)
            if views is None:
                out[i] = Status.INVALID_PARAMS
                continue
            idx.append(i)
            raw.append(k)
            parts.append(views)
        return idx, raw, parts

    def _views(self, key: str, ptrs: Sequence[int], sizes: Sequence[int]) -> list[np.ndarray] | None:
        if not ptrs or len(ptrs) != len(sizes):
            self.once("bad parts", "kvpool: key %r has %d pointers and %d sizes; need as many, at least one",
                      key, len(ptrs), len(sizes))
            return None
        views: list[np.ndarray] = []
        for ptr, size in zip(ptrs, sizes):
            try:
                ptr, size = int(ptr), int(size)
            except (TypeError, ValueError):
                self.once("bad part", "kvpool: key %r has a pointer %r or size %r that is not an integer",
                          key, ptr, size)
                return None
            if size <= 0:
                self.once("bad size", "kvpool: key %r has size %d; sizes must be > 0", key, size)
                return None
            view = self.buffers.view(ptr, size)
            if view is None:
                self.once("bad pointer", "kvpool: %d bytes at %#x (key %r) are not inside a registered buffer "
                          "(%d registered); call register_buffer(ptr, size) first", size, ptr, key, len(self.buffers))
                return None
            views.append(view)
        return views

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Store `sizes[i]` bytes at `ptrs[i]` under `keys[i]`: OK or a negative Status per key."""
        return self.batch_put_from_parts(keys, [[p] for p in ptrs], [[n] for n in sizes])

    def batch_put_from_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                       sizes: Sequence[Sequence[int]]) -> list[int]:
        """Store under `keys[i]` the concatenation of the parts (`ptrs[i][j]`, `sizes[i][j]` bytes):
        OK or a negative Status per key. Several parts cost one gathering copy."""
        out: list[int] = [Status.OK] * len(keys)
        idx, raw, parts = self._resolve(keys, ptrs, sizes, out)
        if not idx:
            return out
        views = [p[0] if len(p) == 1 else np.concatenate(p) for p in parts]

        def put(c: PoolClient, items: list[int]) -> list[int]:
            c.batch_put([raw[n] for n in items], [views[n] for n in items])
            return [Status.OK] * len(items)
        for i, st in zip(idx, self._per_item(put, raw, proves=True)):
            out[i] = st
        return out

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], *,
                       exact: bool = False) -> list[int]:
        """Copy each block to `ptrs[i]` (at most `sizes[i]` bytes): bytes read, or a negative Status per
        key (OBJECT_NOT_FOUND on a miss, INVALID_PARAMS when the block is larger than `sizes[i]`, or,
        with `exact`, smaller: for engines that take any count read as the whole page loaded)."""
        out: list[int] = [Status.OK] * len(keys)
        idx, raw, parts = self._resolve(keys, [[p] for p in ptrs], [[n] for n in sizes], out)
        self._get_views(idx, raw, [p[0] for p in parts], out)
        if exact:
            for i in idx:
                if 0 <= out[i] != sizes[i]:
                    self.once("short object", "kvpool holds %r as %d bytes where the engine reads %d: not loaded "
                              "(a block of another layout under the same key?)", keys[i], out[i], sizes[i])
                    out[i] = Status.INVALID_PARAMS
        return out

    def batch_get_into_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                       sizes: Sequence[Sequence[int]]) -> list[int]:
        """Scatter each block over its parts, in order: bytes read, or a negative Status per key
        (OBJECT_NOT_FOUND on a miss; INVALID_PARAMS when the block's size is not the parts' total, so a
        short block never leaves a part unwritten). Several parts cost one copy through a scratch buffer."""
        out: list[int] = [Status.OK] * len(keys)
        idx, raw, parts = self._resolve(keys, ptrs, sizes, out)
        dests = [p[0] if len(p) == 1 else np.empty(sum(v.size for v in p), np.uint8) for p in parts]
        self._get_views(idx, raw, dests, out)
        for n, i in enumerate(idx):
            if out[i] < 0:
                continue
            if out[i] != dests[n].size:
                self.once("short object", "kvpool holds %r as %d bytes where the engine reads %d: not loaded "
                          "(a block of another layout under the same key?)", keys[i], out[i], dests[n].size)
                out[i] = Status.INVALID_PARAMS
            elif len(parts[n]) > 1:
                at = 0
                for v in parts[n]:
                    v[:] = dests[n][at:at + v.size]
                    at += v.size
        return out

    def _get_views(self, idx: list[int], raw: list[bytes], dests: list[np.ndarray], out: list[int]) -> None:
        if not idx:
            return

        def get(c: PoolClient, items: list[int]) -> list[int]:
            got = c.batch_get_into([raw[n] for n in items], [dests[n] for n in items])
            return [n if n >= 0 else Status.OBJECT_NOT_FOUND for n in got]
        for i, n in zip(idx, self._per_item(get, raw)):
            out[i] = n

    def _per_item(self, fn: Callable[[PoolClient, list[int]], list[int]], keys: list[bytes], *,
                  proves: bool = False) -> list[int]:
        """`fn(client, items)`'s result for each of `keys` (`items`: their indices), in one call where the
        pool takes it; statuses instead of errors, as `call`'s. An error that names one of the keys
        (`KVPoolError.key`: a block too large for its destination, or for the pool) fails that key alone
        with its status, and the rest are asked again in one call; one that names none (and is no outage)
        has each key asked alone, for its own status. A cluster put that only some owners stored (`PartialPut`)
        fails the keys not stored, and starts no outage: the other workers still serve. A StorageError (a
        full disk: the blocks are stored, not durable) fails the keys left, none asked again."""
        out: list[int] = [Status.RPC_FAIL] * len(keys)
        todo = list(range(len(keys)))
        while todo:
            pool = self._pool()
            if pool is None:
                return out
            try:
                got = fn(pool, todo)
            except PartialPut as e:  # a cluster put some owner did not store in time: those keys fail
                self._failed(e)
                failed = set(e.failed)
                for j, n in enumerate(todo):
                    out[n] = Status.RPC_FAIL if j in failed else Status.OK  # (only puts raise it)
                self._ok()  # (a worker answered)
                return out
            except (KVPoolError, OSError) as e:
                st = self._failed(e)
                if st == Status.RPC_FAIL:
                    return out
                if isinstance(e, StorageError):  # the whole batch's answer (stored, not durable: a full
                    for n in todo:  # disk), not the named key's own fault: asking again would store it all again
                        out[n] = st
                    return out
                named = getattr(e, "key", None)
                bad = next((n for n in todo if keys[n] == named), None)
                if bad is not None:
                    out[bad] = st
                    todo.remove(bad)
                    continue
                if len(todo) == 1:
                    out[todo[0]] = st
                    return out
                for n in todo:
                    out[n] = self.call(functools.partial(_first, fn, n), lambda s: s, proves=proves)
                return out
            if proves:
                self._ok()
            for n, r in zip(todo, got):
                out[n] = r
            return out
        return out

    def _well_formed(self, keys: Sequence[str]) -> tuple[list[int], list[bytes]]:
        """(indices, canonical keys) of the keys that are well formed; each other is logged once."""
        good: list[int] = []
        raw: list[bytes] = []
        for i, key in enumerate(keys):
            try:
                raw.append(key_bytes(key))
                good.append(i)
            except KVPoolError as e:
                self.once("bad key", "kvpool: %s", str(e))
        return good, raw

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key; False for a malformed key (logged once), all False when the pool
        cannot answer."""
        out = [False] * len(keys)
        good, raw = self._well_formed(keys)
        if raw:
            flags = self.call(lambda c: c.batch_exists(raw), lambda st: [False] * len(raw))
            for i, f in zip(good, flags):
                out[i] = f
        return out

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        """OK where a block was removed, OBJECT_NOT_FOUND where none was, INVALID_PARAMS for a malformed
        key (the others removed all the same), RPC_FAIL when unreachable."""
        out: list[int] = [Status.INVALID_PARAMS] * len(keys)
        good, raw = self._well_formed(keys)
        def rm(c: PoolClient) -> list[int]:
            try:
                flags = c.batch_remove(raw)
            except PartialFailure as e:  # owners of some keys did not answer: those fail, the others are told
                self._failed(e)
                failed, result = set(e.failed), e.result
                if not isinstance(result, list):
                    raise
                return [Status.RPC_FAIL if j in failed else Status.OK if f else Status.OBJECT_NOT_FOUND
                        for j, f in enumerate(result)]
            return [Status.OK if f else Status.OBJECT_NOT_FOUND for f in flags]

        if raw:
            done = self.call(rm, lambda st: [int(st)] * len(raw), proves=True)
            for i, st in zip(good, done):
                out[i] = st
        return out

    def clear(self, prefix: str | None = None) -> int:
        """Remove every block of the pool, or those whose key starts with `prefix`; how many that took
        from the pool (its blocks before less its blocks after, each tier's counted: best effort, as
        others' puts and evictions meanwhile count too), or a negative Status."""
        def held(c: PoolClient) -> int:
            total = c.stats().total
            return int(total.dram_blocks + total.ssd_blocks)

        def clear_all(c: PoolClient) -> int:
            before = held(c)
            c.clear(prefix)
            n = max(0, before - held(c))
            self.log.info("kvpool: cleared %s (%d blocks)", f"the keys under {prefix!r}" if prefix else "every block",
                          n)
            return n
        return self.call(clear_all, lambda st: int(st), proves=True)

    def close(self) -> None:
        """Close the client. A reconnect under way (`_reconnect`) is waited for `_RECONNECT_WAIT_S` at
        most, not for its whole attempt (an engine shutting down while NATS is down would wait up to the
        cluster client's 10 s): past that, its thread ends with the attempt and closes what it made."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
            self._closed = True  # every later call reports RPC_FAIL (a call under way that fails after this
            self._retry_at = float("inf")  # starts no outage's back-off, and so no reconnect: see `_failed`)
            reconnecting = self._reconnecting
        if reconnecting is not None:
            reconnecting.join(_RECONNECT_WAIT_S)


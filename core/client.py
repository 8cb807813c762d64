"""PoolClient: the one API that backends, streams and tools use to reach the pool.

Modes (chosen by `ClientConfig.mode`, `KVPOOL_MODE`, a config file or kwargs):
- `embedded` (the default): a TieredCache inside this process; no services.
- `local`: one worker, at `worker` = a Unix socket path (shared memory, zero copy) or host:port (TCP).
- `cluster`: workers discovered through NATS at `nats_url`; keys placed by rendezvous hashing with
  `replication` copies; same-node workers are reached through shared memory, others through TCP.
Sizes are bytes; a miss is `None` from `get` and `-1` from `batch_get_into`. In `cluster` mode a dead
worker is a miss (or a replica's hit), never an exception or a hang: every call is bounded by `timeout_s`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

from .buffers import Destination, readable
from .cache import TieredCache
from .cluster import Membership, rank
from .config import CacheConfig, default_state_dir, load
from .errors import ConfigError, InvalidKey, PoolTimeout, PoolUnavailable
from .keys import Key, key_bytes
from .pins import PinTable
from .transport import ShmTransport, TcpTransport, connect

log = logging.getLogger("kvpool.client")

MODES = ("embedded", "local", "cluster")


@dataclasses.dataclass
class ClientConfig:
    """How a PoolClient reaches the pool (environment: `KVPOOL_MODE`, `KVPOOL_WORKER`, ...)."""

    mode: str | None = None
    """`embedded`, `local` or `cluster`; unset: `cluster` when `nats_url` is given, `local` when
    `worker` is, else `embedded`."""
    worker: str | None = None
    """local mode: a worker's Unix socket path or host:port; default the `kvpool worker` default socket."""
    nats_url: str | None = None
    """cluster mode: the NATS server of the cluster."""
    token: str | None = None
    """shared secret for workers that require one (TCP)."""
    replication: int = 1
    """cluster mode: copies written per block (top-R workers by rendezvous score)."""
    timeout_s: float = 5.0
    node_id: str | None = None
    """this machine's id (workers with the same id are reached through shared memory); default hostname."""

    def __post_init__(self) -> None:
        if self.mode is None:
            self.mode = "cluster" if self.nats_url else "local" if self.worker else "embedded"
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.replication < 1:
            raise ConfigError(f"replication {self.replication} must be >= 1")


class PoolClient:
    """Put, get and query blocks in the pool, whichever way it is reached.

    `PoolClient()` with nothing configured is an embedded pool. Keyword arguments are options of
    `ClientConfig`, or (embedded mode) of `CacheConfig`.
    """

    def __init__(self, config: ClientConfig | None = None, *, cache: CacheConfig | None = None,
                 **overrides: Any) -> None:
        client_fields = {f.name for f in dataclasses.fields(ClientConfig)}
        own = {k: v for k, v in overrides.items() if k in client_fields}
        rest = {k: v for k, v in overrides.items() if k not in client_fields}
        self.config = cfg = config if config is not None else load(ClientConfig, **own)
        if rest and cfg.mode != "embedded":
            raise ConfigError(f"cache options {sorted(rest)} apply only to embedded mode (mode is {cfg.mode})")
        self._embedded: TieredCache | None = None
        self._embedded_pins: PinTable | None = None
        self._cluster: _Cluster | None = None
        self._single: TcpTransport | ShmTransport | None = None
        if cfg.mode == "embedded":
            self._embedded = TieredCache(cache if cache is not None else load(CacheConfig, **rest))
            self._embedded_pins = PinTable(self._embedded)
        elif cfg.mode == "local":
            address = cfg.worker or str(default_state_dir() / "worker-7461.sock")
            self._single = connect(address, cfg.token, cfg.timeout_s)
        else:
            if not cfg.nats_url:
                raise ConfigError("cluster mode needs nats_url (KVPOOL_NATS_URL)")
            self._cluster = _Cluster(cfg)
        # Engines drop their store without close() and rely on the destructor or process exit: this
        # closes what the client holds then (an embedded cache's SSD tier included), once.
        self._finalizer = weakref.finalize(self, _close_parts, self._embedded, self._single, self._cluster)

    # ----- the API ----------------------------------------------------------------------------

    def put(self, key: Key, data: Any) -> None:
        """Store `data` (bytes-like, numpy, torch) under `key`."""
        self.batch_put([key], [data])

    def batch_put(self, keys: Sequence[Key], buffers: Sequence[Any], *, pin_s: float = 0.0) -> None:
        """Store each buffer under its key; raises on bad input or when no worker takes the block.

        `pin_s` > 0: the blocks are pinned (kept in DRAM, never evicted) for that many seconds, on every
        replica, from before they become visible; see `pin`."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if self._embedded is not None:
            pins = self._pins()
            pins.expire()  # as a worker does: expired pins are evictable before this put looks for room
            if pin_s > 0:
                pins.pin([key_bytes(k) for k in keys], pin_s)
            return self._embedded.batch_put(keys, buffers, pin=pin_s > 0)
        raw = [key_bytes(k) for k in keys]
        views = [readable(b) for b in buffers]
        if self._single is not None:
            return self._single.put_many(raw, views, pin_s)
        assert self._cluster is not None
        return self._cluster.put_many(raw, views, pin_s)

    def pin(self, keys: Sequence[Key], seconds: float) -> None:
        """Keep blocks in DRAM (never evicted) for `seconds` from now, renewing earlier pins; `seconds`
        <= 0 unpins them. A pin lasts at most `kvpool.core.pins.MAX_PIN_S` unless renewed, so a client
        that dies holding pins does not hold the memory forever. In cluster mode every current owner
        (replica) of each key is told; the call does not wait for the workers."""
        raw = [key_bytes(k) for k in keys]
        if self._embedded is not None:
            self._pins().pin(raw, seconds)
        elif self._single is not None:
            self._single.pin(raw, seconds)
        else:
            assert self._cluster is not None
            self._cluster.pin(raw, seconds)

    def _pins(self) -> PinTable:
        assert self._embedded_pins is not None
        return self._embedded_pins

    def get(self, key: Key) -> bytes | None:
        """The block's bytes, or None on a miss."""
        if self._embedded is not None:
            return self._embedded.get(key)
        with self.lease([key]) as views:
            if views[0] is not None:
                return bytes(views[0])
        return None

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        """Copy each block into its buffer; sizes, -1 for each miss."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if self._embedded is not None:
            return self._embedded.batch_get_into(keys, buffers)
        raw = [key_bytes(k) for k in keys]
        dests = [Destination(b) for b in buffers]
        if self._single is not None:
            return self._single.get_into_many(raw, dests)
        assert self._cluster is not None
        return self._cluster.get_into_many(raw, dests)

    @contextmanager
    def lease(self, keys: Sequence[Key]) -> Iterator[list[memoryview | None]]:
        """Read-only views of blocks, valid inside the `with` (None per miss). Zero copy where the
        pool shares memory with this process (embedded, same-node worker); a copy otherwise."""
        raw = [key_bytes(k) for k in keys]
        if self._embedded is not None:
            with _embedded_leases(self._embedded, raw) as views:
                yield views
        elif isinstance(self._single, ShmTransport):
            with self._single.lease(raw) as views:
                yield views
        else:
            bufs = [self._fetch(k) for k in raw]
            yield [None if b is None else memoryview(b).toreadonly() for b in bufs]

    def _fetch(self, key: bytes) -> bytes | None:
        buf = bytearray(self._max_block())
        n = self.batch_get_into([key], [buf])[0]
        return None if n < 0 else bytes(buf[:n])

    def _max_block(self) -> int:
        if self._single is not None:
            return int(self._single.info.get("max_block") or (16 << 20))
        assert self._cluster is not None
        return self._cluster.max_block()

    def exists(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key is present (in any tier, on any of its owners)."""
        if isinstance(keys, (str, bytes)):
            raise InvalidKey(f"exists takes a list of keys, not one key ({keys[:24]!r}); pass [key]")
        if self._embedded is not None:
            return self._embedded.batch_exists(keys)
        raw = [key_bytes(k) for k in keys]
        if self._single is not None:
            return self._single.exists(raw)
        assert self._cluster is not None
        return self._cluster.exists(raw)

    def prefix_match(self, keys: Sequence[Key]) -> int:
        """Length of the longest present prefix of the key chain `keys`."""
        if self._embedded is not None:
            return self._embedded.prefix_match(keys)
        if self._single is not None:
            return self._single.prefix_match([key_bytes(k) for k in keys])
        flags = self.exists(keys)
        return next((i for i, f in enumerate(flags) if not f), len(flags))

    def remove(self, keys: Sequence[Key]) -> list[bool]:
        """Remove blocks (every replica); True where one was present."""
        if self._embedded is not None:
            return self._embedded.batch_remove(keys)
        raw = [key_bytes(k) for k in keys]
        if self._single is not None:
            return self._single.remove(raw)
        assert self._cluster is not None
        return self._cluster.remove(raw)

    def clear(self, prefix: Key | None = None) -> None:
        """Remove every block from the pool (every worker, in cluster mode); with `prefix`, only the
        blocks whose key starts with it (a namespace: other models' and tenants' blocks stay)."""
        raw = None if prefix is None else key_bytes(prefix)
        if self._embedded is not None:
            self._embedded.clear(raw)
        elif self._single is not None:
            self._single.clear(raw)
        else:
            assert self._cluster is not None
            self._cluster.clear(raw)

    def wait_for_members(self, predicate: Callable[[dict[str, dict[str, Any]]], bool], timeout: float) -> bool:
        """Cluster mode: wait until `predicate(live workers by id)` holds (membership arrives over NATS
        asynchronously); False if it still does not after `timeout` seconds."""
        if self._cluster is None:
            raise ConfigError(f"members exist in cluster mode only (mode is {self.config.mode})")
        return self._cluster.membership.wait_for(predicate, timeout)

    def stats(self) -> dict[str, Any]:
        """Embedded: the cache's counters. Otherwise {worker_id: that worker's info and counters}."""
        if self._embedded is not None:
            return self._embedded.stats()
        if self._single is not None:
            s = self._single.stats()
            return {s["worker_id"]: s}
        assert self._cluster is not None
        return self._cluster.stats()

    def close(self) -> None:
        """Release what the client holds (idempotent); also done when it is garbage-collected or the
        process exits without a call."""
        self._finalizer()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_parts(embedded: TieredCache | None, single: TcpTransport | ShmTransport | None,
                 cluster: _Cluster | None) -> None:
    if embedded is not None:
        embedded.close()
    if single is not None:
        single.close()
    if cluster is not None:
        cluster.close()


@contextmanager
def _embedded_leases(cache: TieredCache, keys: list[bytes]) -> Iterator[list[memoryview | None]]:
    blocks = [cache.acquire(k) for k in keys]
    try:
        yield [None if b is None else cache.arena.view(b.offset, b.size).toreadonly() for b in blocks]
    finally:
        for b in blocks:
            if b is not None:
                cache.release(b)


_SUSPECT_S = 2.0


class _Cluster:
    """Routing over the live workers: rendezvous placement, replicas, and same-node shared memory."""

    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id or socket.gethostname()
        self.membership = Membership(cfg.nats_url or "", connect_timeout=cfg.timeout_s)
        self.membership.watch()
        self._transports: dict[str, tuple[tuple[Any, ...], TcpTransport | ShmTransport]] = {}
        self._suspect: dict[str, float] = {}
        self._lock = threading.Lock()  # guards the two dicts: one client serves many threads
        self._fanout = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvpool-fanout")

    def _live(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        members = self.membership.members()
        with self._lock:
            return {w: i for w, i in members.items() if self._suspect.get(w, 0) <= now}

    def _transport(self, worker_id: str, info: dict[str, Any]) -> TcpTransport | ShmTransport:
        """The connection to a worker; a new one when the member's entry names another process (a
        worker restarted under the same id: the old connection leads nowhere)."""
        incarnation = (info.get("pid"), info.get("tcp"), info.get("unix"), info.get("arena"))
        stale: TcpTransport | ShmTransport | None = None
        with self._lock:  # one transport per worker, however many threads ask at once
            known = self._transports.get(worker_id)
            if known is not None and known[0] != incarnation:
                stale, known = known[1], None
                del self._transports[worker_id]
            if known is None:
                same_node = info.get("node_id") == self.node_id and os.path.exists(info.get("unix", ""))
                known = (incarnation, connect(info["unix"] if same_node else info["tcp"], self.cfg.token,
                                              self.cfg.timeout_s))
                self._transports[worker_id] = known
        if stale is not None:
            stale.close()
        return known[1]

    def _failed(self, worker_id: str, err: Exception, in_flight: Future[Any] | None = None) -> None:
        """Treat the worker as down for a while and drop its connection: at once, or (a call still
        `in_flight` on it past the deadline) when that call ends, never under it."""
        log.warning("worker %s failed (%s); treating it as down for %.0f s", worker_id, err, _SUSPECT_S)
        with self._lock:
            self._suspect[worker_id] = time.monotonic() + _SUSPECT_S
            known = self._transports.pop(worker_id, None)
        if known is None:
            return
        if in_flight is None:
            known[1].close()
        else:
            in_flight.add_done_callback(lambda _: known[1].close())

    def _owners(self, keys: list[bytes], live: dict[str, dict[str, Any]]) -> list[list[str]]:
        ids = list(live)
        return [rank(k, ids)[:self.cfg.replication] for k in keys]

    def _each(self, live: dict[str, dict[str, Any]], groups: dict[str, list[int]],
              call: Callable[[TcpTransport | ShmTransport, list[int]], Any],
              deadline: float) -> Iterator[tuple[str, list[int], Any]]:
        """(worker, key indices, result) per worker that answered by `deadline` (monotonic seconds); the
        workers are asked in parallel, so one call waits for the slowest worker once, not for each in
        turn. A worker that fails or misses the deadline is marked down and skipped."""
        def ask(w: str, idx: list[int]) -> Any:
            return call(self._transport(w, live[w]), idx)

        budget = deadline - time.monotonic()
        if budget <= 0:
            return
        if len(groups) == 1 and budget >= 0.99 * self.cfg.timeout_s:
            # the common case (one owner, the whole budget): no thread hop; the socket timeout bounds it
            ((w, idx),) = groups.items()
            try:
                yield w, idx, ask(w, idx)
            except PoolUnavailable as e:
                self._failed(w, e)
            return
        futures = {self._fanout.submit(ask, w, idx): (w, idx) for w, idx in groups.items()}
        done, late = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        for f in late:
            if not f.cancel():
                self._failed(futures[f][0], PoolTimeout(f"no answer within the call's {self.cfg.timeout_s} s"), f)
        for f in done:
            w, idx = futures[f]
            try:
                yield w, idx, f.result()
            except PoolUnavailable as e:
                self._failed(w, e)

    def _deadline(self) -> float:
        return time.monotonic() + self.cfg.timeout_s

    def _attempts(self) -> Iterator[tuple[int, float]]:
        """(replica rank, its deadline) for a read: the call's `timeout_s` is shared out, so an owner
        that hangs leaves its replicas time to answer within the same bound."""
        start, n = time.monotonic(), self.cfg.replication
        for attempt in range(n):
            yield attempt, start + self.cfg.timeout_s * (attempt + 1) / n

    def _replica_groups(self, owners: list[list[str]]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, ow in enumerate(owners):
            for w in ow:
                groups.setdefault(w, []).append(i)
        return groups

    def _read_groups(self, owners: list[list[str]], attempt: int, pending: list[bool]) -> dict[str, list[int]]:
        """Keys still pending, grouped by their `attempt`-th owner (primary first, then replicas)."""
        groups: dict[str, list[int]] = {}
        for i, ow in enumerate(owners):
            if pending[i] and attempt < len(ow):
                groups.setdefault(ow[attempt], []).append(i)
        return groups

    def max_block(self) -> int:
        return max((int(i.get("max_block", 0)) for i in self._live().values()), default=16 << 20)

    def put_many(self, keys: list[bytes], views: list[memoryview], pin_s: float) -> None:
        live = self._live()
        if not live:
            raise PoolUnavailable(f"no live workers in the cluster at {self.cfg.nats_url}")
        stored = [0] * len(keys)
        groups = self._replica_groups(self._owners(keys, live))
        put = lambda t, idx: t.put_many([keys[i] for i in idx], [views[i] for i in idx], pin_s)  # noqa: E731
        for _, idx, _ in self._each(live, groups, put, self._deadline()):
            for i in idx:
                stored[i] += 1
        if not all(stored):
            raise PoolUnavailable(f"{stored.count(0)} of {len(keys)} blocks reached no live worker")

    def get_into_many(self, keys: list[bytes], dests: list[Destination]) -> list[int]:
        live = self._live()
        out = [-1] * len(keys)
        owners = self._owners(keys, live)
        get = lambda t, idx: t.get_into_many([keys[i] for i in idx], [dests[i] for i in idx])  # noqa: E731
        for attempt, deadline in self._attempts():
            groups = self._read_groups(owners, attempt, [n < 0 for n in out])
            for _, idx, sizes in self._each(live, groups, get, deadline):
                for i, n in zip(idx, sizes):
                    out[i] = n
        return out

    def exists(self, keys: list[bytes]) -> list[bool]:
        live = self._live()
        out = [False] * len(keys)
        owners = self._owners(keys, live)
        ask = lambda t, idx: t.exists([keys[i] for i in idx])  # noqa: E731
        for attempt, deadline in self._attempts():
            groups = self._read_groups(owners, attempt, [not f for f in out])
            for _, idx, flags in self._each(live, groups, ask, deadline):
                for i, f in zip(idx, flags):
                    out[i] = f
        return out

    def pin(self, keys: list[bytes], seconds: float) -> None:
        live = self._live()
        groups = self._replica_groups(self._owners(keys, live))
        for _ in self._each(live, groups, lambda t, idx: t.pin([keys[i] for i in idx], seconds), self._deadline()):
            pass

    def remove(self, keys: list[bytes]) -> list[bool]:
        live = self._live()
        out = [False] * len(keys)
        groups = self._replica_groups(self._owners(keys, live))
        rm = lambda t, idx: t.remove([keys[i] for i in idx])  # noqa: E731
        for _, idx, flags in self._each(live, groups, rm, self._deadline()):
            for i, f in zip(idx, flags):
                out[i] = out[i] or f
        return out

    def clear(self, prefix: bytes | None) -> None:
        live = self._live()
        for _ in self._each(live, {w: [] for w in live}, lambda t, idx: t.clear(prefix), self._deadline()):
            pass

    def stats(self) -> dict[str, Any]:
        live = self._live()
        out: dict[str, Any] = {w: {**info, "error": "no answer"} for w, info in live.items()}
        for w, _, s in self._each(live, {w: [] for w in live}, lambda t, idx: t.stats(), self._deadline()):
            out[w] = s
        return out

    def close(self) -> None:
        with self._lock:
            transports = [t for _, t in self._transports.values()]
            self._transports.clear()
        self._fanout.shutdown(wait=False, cancel_futures=True)
        for t in transports:
            t.close()
        self.membership.close()

"""PoolClient: the one API that backends, streams and tools use to reach the pool.

Modes (chosen by `ClientConfig.mode`, `KVPOOL_MODE`, a config file or kwargs):
- `embedded` (the default): a TieredCache inside this process; no services.
- `local`: one worker, at `worker` = a Unix socket path (shared memory, zero copy) or host:port (TCP).
- `cluster`: workers discovered through NATS at `nats_url`; keys placed by rendezvous hashing with
  `replication` copies; same-node workers are reached through shared memory, others through TCP.
Each mode is a `PoolBackend` (`kvpool.core.pool_backend`), chosen once by `open_backend`; PoolClient
checks the arguments and hands every call to it. Sizes are bytes; a miss is `None` from `get`, `-1`
from `batch_get_into`. In `cluster` mode a dead worker is a miss (or a replica's hit), never an
exception or a hang: every call is bounded by `timeout_s`.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from .cache import TieredCache
from .cluster_backend import ClusterBackend
from .config import CacheConfig, default_state_dir, load, section
from .embedded_backend import EmbeddedBackend
from .errors import ConfigError, InvalidArgument
from .keys import Key, key_bytes, keys_bytes
from .pins import pin_seconds
from .pool_backend import MembersPredicate, PoolBackend
from .records import PoolStats, WorkerInfo
from .stall_watch import STALL_S
from .transport import connect

__all__ = ["MODES", "PLACEMENTS", "ClientConfig", "BACKENDS", "open_backend", "PoolClient"]

MODES = ("embedded", "local", "cluster")
PLACEMENTS = ("hash", "local")


@section("client")
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
    """the pool token, for TCP workers (loopback ones too); unset: `KVPOOL_TOKEN`, else the token file a
    worker of this user made (`KVPOOL_TOKEN_FILE`, else `<state dir>/token`), read when connecting.
    It never crosses the wire (challenge-response), and a client holding one treats a worker that cannot
    prove it holds the same as absent. Same-node (Unix socket) workers need none: the kernel vouches
    for the peer's user."""
    tls_ca: str | None = None
    """CA file (PEM) to verify TCP workers' TLS certificates against (`KVPOOL_TLS_CA`): set, every TCP
    connection is TLS and a worker that does not serve it, or whose certificate does not verify for the
    address dialled, is treated as absent; unset, TCP is clear text. See `kvpool.core.tls`."""
    replication: int = 1
    """cluster mode: copies written per block (top-R workers by rendezvous score)."""
    timeout_s: float = 5.0
    """Seconds each call may take, at most (above 0, finite)."""
    node_id: str | None = None
    """this machine's id (workers with the same id are reached through shared memory); default
    `kvpool.core.config.default_node_id()`, as a worker's."""
    placement: str = "hash"
    """cluster mode: which workers own the keys this client writes and reads. `hash`: every member,
    by rendezvous hashing, so any client finds a key by its name. `local`: the members on this client's
    node (the same hashing among them; every member where the node has none), for a prefill instance's
    handoff: its layers go to its own node's worker through shared memory, and a decode instance on
    another node reads them from there over one TCP connection, named by the announcement's places
    (`kvpool.core.get_placed`), where placing by hash would send each byte across the network twice.
    A client placing by hash does not find such keys by their names, so a key should be written under
    one placement (a handoff's request keys are its producer's own). One copy only (`replication` 1).
    Workers that placing by hash gives a key are told of its newer versions all the same, so that a copy
    they kept from before (written while the node had no worker) is not served again."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement {self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if self.mode is None:
            self.mode = "cluster" if self.nats_url else "local" if self.worker else "embedded"
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.replication < 1:
            raise ConfigError(f"replication {self.replication} must be >= 1", limit=1)
        if self.placement == "local" and self.replication > 1:
            raise ConfigError(f"placement 'local' keeps one copy, on this node: replication {self.replication} "
                              "would not be kept (a handoff's layers need none; place by hash for copies)", limit=1)
        if not 0 < self.timeout_s < math.inf:
            raise ConfigError(f"timeout_s={self.timeout_s}: a finite number of seconds above 0 (KVPOOL_TIMEOUT_S)")
        if self.replication > 1 and self.timeout_s < STALL_S:
            raise ConfigError(f"timeout_s {self.timeout_s} with replication {self.replication}: at least {STALL_S} s "
                              "(a worker paused for less does not know it may have been left out of a write, and "
                              "would serve its older copies: kvpool.core.stall_watch)", limit=STALL_S)


# ----- mode -> backend ------------------------------------------------------------------------

def _embedded(cfg: ClientConfig, cache: CacheConfig | None, cache_options: Mapping[str, Any]) -> PoolBackend:
    return EmbeddedBackend(TieredCache(cache if cache is not None else load(CacheConfig, **cache_options)))


def _local(cfg: ClientConfig, cache: CacheConfig | None, cache_options: Mapping[str, Any]) -> PoolBackend:
    return connect(cfg.worker or str(default_state_dir() / "worker-7461.sock"), cfg.token, cfg.timeout_s, cfg.tls_ca)


def _cluster(cfg: ClientConfig, cache: CacheConfig | None, cache_options: Mapping[str, Any]) -> PoolBackend:
    if not cfg.nats_url:
        raise ConfigError("cluster mode needs nats_url (KVPOOL_NATS_URL)")
    return ClusterBackend(cfg.nats_url, token=cfg.token, replication=cfg.replication, timeout_s=cfg.timeout_s,
                          node_id=cfg.node_id, tls_ca=cfg.tls_ca, local=cfg.placement == "local")


BACKENDS: dict[str, Callable[[ClientConfig, CacheConfig | None, Mapping[str, Any]], PoolBackend]] = {
    "embedded": _embedded, "local": _local, "cluster": _cluster,
}
"""How each mode builds its backend."""


def open_backend(cfg: ClientConfig, cache: CacheConfig | None = None,
                 cache_options: Mapping[str, Any] | None = None) -> PoolBackend:
    """The backend of `cfg.mode`; `cache` (a CacheConfig) or `cache_options` (its fields) configure an
    embedded cache. Other modes ignore `cache` and refuse `cache_options` (a misplaced keyword)."""
    if cache_options and cfg.mode != "embedded":
        raise ConfigError(f"cache options {sorted(cache_options)} apply only to embedded mode (mode is {cfg.mode})")
    return BACKENDS[str(cfg.mode)](cfg, cache, cache_options or {})


# ----- the client -----------------------------------------------------------------------------

def _keys(keys: Sequence[Key]) -> list[bytes]:
    """Canonical keys of a batch; one key where a list belongs is an error, not a list of characters."""
    if isinstance(keys, (str, bytes)):
        raise InvalidArgument(f"a batch call takes a list of keys, not one key ({keys[:24]!r}); pass [key] "
                              "or use the single-key call")
    return keys_bytes(keys)


def _pairs(keys: Sequence[Key], buffers: Sequence[Any]) -> list[bytes]:
    if len(keys) != len(buffers):
        raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers", size=len(buffers), limit=len(keys))
    return _keys(keys)


class PoolClient:
    """Put, get and query blocks in the pool, whichever way it is reached.

    `PoolClient()` with nothing configured is an embedded pool. Keyword arguments are options of
    `ClientConfig`, or (embedded mode) of `CacheConfig`. `backend=` serves the calls from any
    `PoolBackend` instead (`kvpool.core.memory_backend.MemoryBackend` for tests); the client closes it.
    """

    def __init__(self, config: ClientConfig | None = None, *, cache: CacheConfig | None = None,
                 backend: PoolBackend | None = None, **overrides: Any) -> None:
        if backend is not None:
            if config is not None or cache is not None or overrides:
                raise ConfigError("PoolClient(backend=...) takes no other configuration")
            self.config: ClientConfig | None = None
            self.backend = backend
        else:
            client_fields = {f.name for f in dataclasses.fields(ClientConfig)}
            own = {k: v for k, v in overrides.items() if k in client_fields}
            rest = {k: v for k, v in overrides.items() if k not in client_fields}
            self.config = cfg = config if config is not None else load(ClientConfig, **own)
            self.backend = open_backend(cfg, cache, rest)
        # Engines drop their store without close() and rely on the destructor or process exit: this
        # closes what the client holds then (an embedded cache's SSD tier included), once.
        self._finalizer = weakref.finalize(self, getattr(self.backend, "shut", self.backend.close))

    # ----- blocks ------------------------------------------------------------------------------

    def put(self, key: Key, data: Any, *, pin_s: float = 0.0) -> None:
        """Store `data` (bytes-like, numpy, torch) under `key`; see `batch_put`."""
        self.backend.batch_put([key_bytes(key)], [data], pin_seconds(pin_s))

    def batch_put(self, keys: Sequence[Key], buffers: Sequence[Any], *, pin_s: float = 0.0) -> None:
        """Store each buffer under its key; raises on bad input or when no worker takes the block.

        `pin_s` > 0: the blocks are pinned (kept in DRAM, never evicted) for that many seconds, on every
        replica, from before they become visible; see `batch_pin`."""
        self.backend.batch_put(_pairs(keys, buffers), buffers, pin_seconds(pin_s))

    def get(self, key: Key) -> bytes | None:
        """The block's bytes, or None on a miss."""
        with self.backend.batch_lease([key_bytes(key)]) as (view,):
            return None if view is None else bytes(view)

    def get_into(self, key: Key, buffer: Any) -> int:
        """Copy the block into `buffer`: its size in bytes, or -1 on a miss."""
        return self.backend.batch_get_into([key_bytes(key)], [buffer])[0]

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        """Copy each block into its buffer; sizes, -1 for each miss."""
        return self.backend.batch_get_into(_pairs(keys, buffers), buffers)

    @contextmanager
    def lease(self, key: Key) -> Iterator[memoryview | None]:
        """A read-only view of the block valid inside the `with` (None on a miss); see `batch_lease`."""
        with self.backend.batch_lease([key_bytes(key)]) as (view,):
            yield view

    def batch_lease(self, keys: Sequence[Key]) -> AbstractContextManager[list[memoryview | None]]:
        """Read-only views of blocks, valid inside the `with` (None per miss). Zero copy where the
        pool shares memory with this process (embedded, a same-node worker, in cluster mode a same-node
        owner when each block has one copy); a copy otherwise."""
        return self.backend.batch_lease(_keys(keys))

    def exists(self, key: Key) -> bool:
        """Whether the block is present (in any tier, on any of its owners)."""
        return self.backend.batch_exists([key_bytes(key)])[0]

    def batch_exists(self, keys: Sequence[Key]) -> list[bool]:
        return self.backend.batch_exists(_keys(keys))

    def prefix_match(self, keys: Sequence[Key]) -> int:
        """Length of the longest present prefix of the key chain `keys`."""
        return self.backend.prefix_match(_keys(keys))

    def remove(self, key: Key) -> bool:
        """Remove the block (every replica); True if one was present."""
        return self.backend.batch_remove([key_bytes(key)])[0]

    def batch_remove(self, keys: Sequence[Key]) -> list[bool]:
        return self.backend.batch_remove(_keys(keys))

    def pin(self, key: Key, pin_s: float) -> None:
        """Keep the block in DRAM (never evicted) for `pin_s` seconds from now; see `batch_pin`."""
        self.backend.batch_pin([key_bytes(key)], pin_seconds(pin_s))

    def batch_pin(self, keys: Sequence[Key], pin_s: float) -> None:
        """Keep blocks in DRAM (never evicted) for `pin_s` seconds from now, renewing earlier pins;
        `pin_s` <= 0 unpins them. A pin lasts at most `kvpool.core.pins.MAX_PIN_S` unless renewed, so
        a client that dies holding pins does not hold the memory forever. In cluster mode every
        current owner (replica) of each key is told; the call does not wait for the workers."""
        self.backend.batch_pin(_keys(keys), pin_seconds(pin_s))

    def clear(self, prefix: Key | None = None) -> None:
        """Remove every block from the pool (every worker, in cluster mode); with `prefix`, only the
        blocks whose key starts with it (a namespace: other models' and tenants' blocks stay)."""
        self.backend.clear(None if prefix is None else key_bytes(prefix))

    # ----- the pool ----------------------------------------------------------------------------

    @property
    def max_block(self) -> int:
        """Largest block the pool accepts, in bytes."""
        return self.backend.max_block

    def members(self) -> dict[str, WorkerInfo]:
        """The live workers by id: none embedded, the one worker in local mode, the cluster's members
        (as last heard over NATS) in cluster mode."""
        return self.backend.members()

    def wait_for_members(self, predicate: MembersPredicate, timeout_s: float) -> bool:
        """Wait until `predicate(members())` holds (cluster membership arrives over NATS
        asynchronously); False if it still does not after `timeout_s` seconds. Outside cluster mode
        the members never change: the predicate is checked once."""
        return self.backend.wait_for_members(predicate, timeout_s)

    def stats(self) -> PoolStats:
        """Counters and tier fill, summed over the pool (`total`) and per worker (`workers`)."""
        return self.backend.stats()

    def close(self) -> None:
        """Release what the client holds (idempotent); also done when it is garbage-collected or the
        process exits without a call."""
        self._finalizer()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

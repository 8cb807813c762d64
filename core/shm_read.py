"""Reading committed same-node blocks in place through a client's own read-only arena mappings.

`put_placed` puts blocks as `PoolClient.batch_put` does and returns where the same-node ones were
committed (`shm_refs.Place`); `read_placed` copies blocks from such places into the caller's buffers
with no round trip to the worker, and checks each one's checksum over the copied bytes; `get_placed`
gets the others from the worker each place names (a reader on another node), where placement would
look elsewhere (`ClientConfig.placement`). A place is only
ever looked up among the arenas the client maps already, or would map for a get: those of its local
worker (local mode) or of the live members on its node (cluster mode), matched by worker id and arena
name; anything else (another node, a restarted worker, an embedded pool) reads nothing in place, and
the caller gets those blocks the ordinary way.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .client import PoolClient
from .cluster_backend import ClusterBackend
from .errors import InvalidArgument, PoolUnavailable
from .keys import Key, keys_bytes
from .records import WorkerInfo
from .shm_refs import ArenaLookup, Place, copy_placed, recording
from .transport import ShmTransport
from .versions import CLOCK

__all__ = ["put_placed", "read_placed", "get_placed"]


def put_placed(pool: PoolClient, keys: Sequence[Key], buffers: Sequence[Any], *,
               pin_s: float = 0.0) -> list[Place | None]:
    """`pool.batch_put(keys, buffers, pin_s=pin_s)`; the place each block was committed at in a
    same-node worker's arena (None where it went another way: TCP, an embedded pool)."""
    names = keys_bytes(keys)
    with recording(names) as rec:
        pool.batch_put(keys, buffers, pin_s=pin_s)
    return rec.places(names)


def read_placed(pool: PoolClient, places: Sequence[Place | None], views: Sequence[memoryview],
                checksums: Sequence[int]) -> list[bool]:
    """Copy each block from its place into its view (of the block's size) where `pool` maps that arena,
    checking `checksums` over the copied bytes: True where the view holds the block, False where the
    caller must get it from the pool (the view may then hold anything). Places come from anyone who
    could send a message: one is read only within the mapping of an arena this client trusts."""
    if not any(p is not None for p in places):
        return [False] * len(places)
    ok, newest = copy_placed(_lookup(pool), places, views, checksums)
    if newest:
        CLOCK.observe(newest)  # as a get would: this process's later writes are newer than what it read
    return ok


def get_placed(pool: PoolClient, keys: Sequence[Key], views: Sequence[memoryview],
               places: Sequence[Place | None]) -> list[int]:
    """`pool.batch_get_into(keys, views)`, but in cluster mode a key with a place is asked of the worker
    the place names first, and of its owners by placement only if that worker misses
    (`ClusterBackend.batch_get_into_at`): its writer may have placed it by another rule than this
    client's (a producer placing locally). The caller checks what it got against what it was told."""
    if not len(keys) == len(views) == len(places):
        raise InvalidArgument(f"{len(keys)} keys, {len(views)} buffers and {len(places)} places: one of each per block")
    backend = pool.backend
    if not isinstance(backend, ClusterBackend) or all(p is None for p in places):
        return pool.batch_get_into(keys, views)
    return backend.batch_get_into_at([p.worker if p is not None else None for p in places], keys_bytes(keys), views)


def _lookup(pool: PoolClient) -> ArenaLookup:
    backend = pool.backend
    if isinstance(backend, ShmTransport):
        return lambda worker, arena: _arena(backend, worker, arena)
    if isinstance(backend, ClusterBackend):
        live: dict[str, WorkerInfo] | None = None

        def find(worker: str, arena: str) -> memoryview | None:
            nonlocal live
            live = backend.membership.members() if live is None else live
            info = live.get(worker)
            if info is None or info.arena != arena or info.node_id != backend.fanout.node_id:
                return None
            try:
                transport = backend.fanout.transport(worker, info)
            except PoolUnavailable:
                return None  # the caller's get reports the worker as it would
            return _arena(transport, worker, arena) if isinstance(transport, ShmTransport) else None
        return find
    return lambda worker, arena: None


def _arena(transport: ShmTransport, worker: str, arena: str) -> memoryview | None:
    """The transport's read-only mapping, if it is of worker `worker`'s arena `arena`."""
    try:
        mapped = transport.arena  # connects and maps on first use
    except PoolUnavailable:
        return None  # the worker is gone or its arena cannot be mapped: the get will say so
    info = transport.info
    return mapped if info.worker_id == worker and info.arena == arena else None

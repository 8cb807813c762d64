"""Typed records of the pool: who a worker is (`WorkerInfo`) and what `PoolClient.stats()` returns.

They are parsed from the worker's wire JSON (HELLO replies, STATS replies, cluster member entries),
whose shape stays as it is; parsing ignores fields it does not know, so an older client reads a newer
worker (as nats.py's `js/api.py` reads JetStream's replies).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from .stats import CacheStats

__all__ = ["WorkerInfo", "WorkerStats", "PoolStats"]

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

R = TypeVar("R", bound="DataclassInstance")


def _known(cls: type[R], d: Mapping[str, Any]) -> R:
    """`cls(**d)` with only the fields `cls` declares."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def _total(parts: Iterable[CacheStats]) -> CacheStats:
    """Field-wise sum: the counters and fill of several caches as one."""
    items = list(parts)
    return CacheStats(**{f.name: sum(getattr(p, f.name) for p in items) for f in dataclasses.fields(CacheStats)})


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A worker as it describes itself (HELLO reply, cluster member entry). Sizes in bytes."""

    worker_id: str
    node_id: str = ""
    """The machine's id: clients with the same one reach the worker through shared memory."""
    tcp: str = ""
    """host:port of its TCP listener."""
    unix: str = ""
    """Path of its Unix socket (same node: shared memory)."""
    arena: str = ""
    """Name of its shared-memory arena."""
    arena_size: int = 0
    max_block: int = 0
    max_reserve: int = 0
    """The most arena bytes one connection may hold reserved and uncommitted."""
    auth: bool = False
    """Whether TCP connections must present a token."""
    pid: int = 0
    dram_capacity: int = 0
    dram_bytes: int = 0
    ssd_bytes: int = 0
    hits: int = 0
    misses: int = 0
    transports: tuple[str, ...] = ()
    ts: float = 0.0
    """Wall-clock time of the heartbeat that carried this entry (member entries only)."""
    member_since: float | None = None
    """Wall time since which it has been a member without a break (member entries; None: unknown)."""
    member_ttl_s: float = 0.0
    """How long it counts as a member after its last heartbeat got through (it fences itself then):
    clients keep it as long (`Membership.members`)."""
    held_since: float = 0.0
    """Wall time since which it may hold the blocks it holds (`kvpool.core.held_since`; unknown: ever)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], worker_id: str | None = None) -> WorkerInfo:
        """Parse a HELLO reply or member entry; `worker_id` (a member entry's key) fills a missing id."""
        fields = {**d, "worker_id": str(d.get("worker_id", worker_id or ""))}
        if "transports" in fields:
            fields["transports"] = tuple(fields["transports"])
        return _known(cls, fields)

    @property
    def incarnation(self) -> tuple[int, str, str, str]:
        """Changes when the worker id is served by another process (a restart): a connection to the
        old one leads nowhere."""
        return self.pid, self.tcp, self.unix, self.arena

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "transports": list(self.transports)}


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """One worker's entry in `PoolStats`: who it is, and its counters (None when it did not answer)."""

    info: WorkerInfo
    cache: CacheStats | None = None
    """Its counters, tier fill and pins; None when it did not answer."""
    error: str | None = None
    """Why there are no counters ("no answer"), else None."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], worker_id: str | None = None) -> WorkerStats:
        """Parse a STATS reply ({...WorkerInfo fields, "stats": {...counters}}), or a member entry
        with an "error"."""
        counters = d.get("stats")
        if isinstance(counters, Mapping):
            return cls(WorkerInfo.from_dict(d, worker_id), CacheStats.from_dict(counters))
        return cls(WorkerInfo.from_dict(d, worker_id), None, str(d.get("error", "no counters")))

    def as_dict(self) -> dict[str, Any]:
        """The wire shape it was parsed from (`kvpool status --json` prints it)."""
        if self.cache is None:
            return {**self.info.as_dict(), "error": self.error}
        return {**self.info.as_dict(), "stats": self.cache.as_dict()}


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """What `PoolClient.stats()` returns in every mode: totals over the pool, and per worker.

    Embedded: the cache's own counters, no workers. Local: its one worker. Cluster: every live worker
    (one that did not answer in time has `cache` None and an `error`; it adds nothing to the totals)."""

    total: CacheStats
    workers: Mapping[str, WorkerStats] = dataclasses.field(default_factory=dict)
    """By worker id."""

    @classmethod
    def of_workers(cls, workers: Mapping[str, WorkerStats]) -> PoolStats:
        return cls(_total(w.cache for w in workers.values() if w.cache is not None), dict(workers))

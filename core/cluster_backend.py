"""`ClusterBackend`: the pool as every live worker of a cluster, as a PoolBackend.

Keys are placed by rendezvous hashing over the members with `replication` copies: a put goes
to every owner, a read asks the primary and then each replica in turn for what is still missing,
sharing the call's `timeout_s` out between them. A dead worker is a miss (or a replica's hit), never
an exception or a hang.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from .cluster import Membership, rank
from .config import default_node_id
from .errors import PoolUnavailable
from .fanout import FanOut, Transport
from .pool_backend import MembersPredicate, leases_by_copy
from .records import PoolStats, WorkerInfo, WorkerStats

__all__ = ["Groups", "ClusterBackend"]

Groups = dict[str, list[int]]
"""Key indices by the worker asked about them."""


class ClusterBackend:
    """Routing over the live workers of the cluster at `nats_url`. `node_id` is this machine's id
    (workers with the same one are reached through shared memory; default as a worker's)."""

    def __init__(self, nats_url: str, *, token: str | None = None, replication: int = 1, timeout_s: float = 5.0,
                 node_id: str | None = None) -> None:
        self.nats_url = nats_url
        self.replication = replication
        self.timeout_s = timeout_s
        self.membership = Membership(nats_url, connect_timeout_s=timeout_s)
        self.membership.watch()
        self.fanout = FanOut(node_id or default_node_id(), token, timeout_s)

    # ----- placement --------------------------------------------------------------------------

    def _owners(self, keys: Sequence[bytes], live: dict[str, WorkerInfo]) -> list[list[str]]:
        ids = list(live)
        return [rank(k, ids)[:self.replication] for k in keys]

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _attempts(self) -> Iterator[tuple[int, float]]:
        """(replica rank, its deadline) for a read: the call's `timeout_s` is shared out, so an owner
        that hangs leaves its replicas time to answer within the same bound."""
        start, n = time.monotonic(), self.replication
        for attempt in range(n):
            yield attempt, start + self.timeout_s * (attempt + 1) / n

    @staticmethod
    def _replica_groups(owners: list[list[str]]) -> Groups:
        groups: Groups = {}
        for i, ow in enumerate(owners):
            for w in ow:
                groups.setdefault(w, []).append(i)
        return groups

    @staticmethod
    def _read_groups(owners: list[list[str]], attempt: int, pending: list[bool]) -> Groups:
        """Keys still pending, grouped by their `attempt`-th owner (primary first, then replicas)."""
        groups: Groups = {}
        for i, ow in enumerate(owners):
            if pending[i] and attempt < len(ow):
                groups.setdefault(ow[attempt], []).append(i)
        return groups

    def _live(self) -> dict[str, WorkerInfo]:
        """The members: placement ranks all of them, suspect or not (`FanOut.each` skips suspects)."""
        return self.membership.members()

    # ----- the PoolBackend calls ----------------------------------------------------------------

    @property
    def max_block(self) -> int:
        return max((i.max_block for i in self._live().values()), default=16 << 20)

    def batch_put(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float = 0.0) -> None:
        live = self._live()
        if not live:
            raise PoolUnavailable(f"no live workers in the cluster at {self.nats_url}")
        stored = [0] * len(keys)

        def put(t: Transport, idx: list[int]) -> None:
            t.batch_put([keys[i] for i in idx], [buffers[i] for i in idx], pin_s)

        for _, idx, _ in self.fanout.each(live, self._replica_groups(self._owners(keys, live)), put, self._deadline()):
            for i in idx:
                stored[i] += 1
        if not all(stored):
            raise PoolUnavailable(f"{stored.count(0)} of {len(keys)} blocks reached no live worker")

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        live = self._live()
        out = [-1] * len(keys)
        owners = self._owners(keys, live)

        def get(t: Transport, idx: list[int]) -> list[int]:
            return t.batch_get_into([keys[i] for i in idx], [buffers[i] for i in idx])

        for attempt, deadline in self._attempts():
            groups = self._read_groups(owners, attempt, [n < 0 for n in out])
            for _, idx, sizes in self.fanout.each(live, groups, get, deadline):
                for i, n in zip(idx, sizes):
                    out[i] = n
        return out

    def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        live = self._live()
        out = [False] * len(keys)
        owners = self._owners(keys, live)

        def ask(t: Transport, idx: list[int]) -> list[bool]:
            return t.batch_exists([keys[i] for i in idx])

        for attempt, deadline in self._attempts():
            groups = self._read_groups(owners, attempt, [not f for f in out])
            for _, idx, flags in self.fanout.each(live, groups, ask, deadline):
                for i, f in zip(idx, flags):
                    out[i] = f
        return out

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        flags = self.batch_exists(keys)
        return next((i for i, f in enumerate(flags) if not f), len(flags))

    def batch_pin(self, keys: Sequence[bytes], pin_s: float) -> None:
        """Every current owner (replica) of each key is told; nothing waits for the workers."""
        live = self._live()

        def pin(t: Transport, idx: list[int]) -> None:
            t.batch_pin([keys[i] for i in idx], pin_s)

        for _ in self.fanout.each(live, self._replica_groups(self._owners(keys, live)), pin, self._deadline()):
            pass

    def batch_remove(self, keys: Sequence[bytes]) -> list[bool]:
        live = self._live()
        out = [False] * len(keys)

        def rm(t: Transport, idx: list[int]) -> list[bool]:
            return t.batch_remove([keys[i] for i in idx])

        for _, idx, flags in self.fanout.each(live, self._replica_groups(self._owners(keys, live)), rm,
                                              self._deadline()):
            for i, f in zip(idx, flags):
                out[i] = out[i] or f
        return out

    def batch_lease(self, keys: Sequence[bytes]) -> AbstractContextManager[list[memoryview | None]]:
        """Copies, whichever worker holds each block."""
        return leases_by_copy(self, keys)

    def clear(self, prefix: bytes | None = None) -> None:
        live = self._live()
        for _ in self.fanout.each(live, {w: [] for w in live}, lambda t, idx: t.clear(prefix), self._deadline()):
            pass

    def stats(self) -> PoolStats:
        live = self._live()
        out = {w: WorkerStats(info, error="no answer") for w, info in live.items()}
        for w, _, s in self.fanout.each(live, {w: [] for w in live}, lambda t, idx: t.stats(), self._deadline()):
            (out[w],) = s.workers.values()  # a transport's stats: its one worker
        return PoolStats.of_workers(out)

    def members(self) -> dict[str, WorkerInfo]:
        return self.membership.members()

    def wait_for_members(self, predicate: MembersPredicate, timeout_s: float) -> bool:
        return self.membership.wait_for(predicate, timeout_s)

    def close(self) -> None:
        self.fanout.close()
        self.membership.close()

"""`ClusterBackend`: the pool as every live worker of a cluster, as a PoolBackend.

Keys are placed by rendezvous hashing over the members with `replication` copies. Every put and
remove carries one version (`kvpool.core.versions`) to every owner, and each owner keeps the newest.
A read asks all owners at once and takes the newest among those that answer within the call's
`timeout_s` (a removal newer than every block is a miss), then repairs the owners that answered with
something older (`Repairs`, in the background). A dead worker is a miss (or a replica's hit), never
an exception or a hang.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from . import protocol as P
from .background import Background
from .buffers import byte_size, readable_all
from .cluster import Membership, rank
from .config import default_node_id
from .connection import item_error, max_block_of, refuse_too_large
from .errors import KVPoolError, PartialFailure, PartialPut, PoolUnavailable, ProtocolError
from .fanout import FanOut, Transport
from .missed_writes import MissedWrites
from .nats_creds import redacted_url
from .pool_backend import MembersPredicate, copies
from .read_repair import Groups, Repair, Repairs, live_groups
from .records import PoolStats, WorkerInfo, WorkerStats
from .succession import told_below
from .transport import ShmTransport
from .versions import CLOCK, REMOVED, SUPERSEDED

__all__ = ["ClusterBackend"]

log = logging.getLogger("kvpool.client")


@dataclasses.dataclass
class Deferred:
    """The error a put raises once the blocks held newer are put again, and the blocks it did not store
    (none for a StorageError: stored, not durable)."""

    error: KVPoolError
    unstored: list[int]


_STORED = (P.ITEM_OK, P.ITEM_STORAGE, P.ITEM_SUPERSEDED)
"""A put's item statuses of an owner that took the block: stored (not durable, for ITEM_STORAGE), or
holding a version as new or newer."""


def _newest(heard: dict[str, tuple[bool, int]]) -> tuple[int, bool]:
    """The newest (version, is a block) among owners' answers (holds a block, version); a removal
    wins a tie; (0, False) when none knows the key."""
    best = (0, False)
    for block, v in heard.values():
        if v > best[0] or (v == best[0] and v and not block):
            best = (v, block)
    return best


_BACKENDS: weakref.WeakSet[ClusterBackend] = weakref.WeakSet()
"""Every ClusterBackend of this process, for `_forked`."""


def _forked() -> None:
    """In a forked child: the parent's cluster clients refuse calls (their threads, NATS loop and
    fan-out pool did not come along: a call waited out its timeout and took every key for a miss)."""
    for backend in list(_BACKENDS):
        backend._forked = True
        backend.fanout.forked()


os.register_at_fork(after_in_child=_forked)

JOIN_TIMEOUT_S = 10.0  # the least a client waits for NATS at start: a JetStream cluster electing answers nothing


class ClusterBackend:
    """Routing over the live workers of the cluster at `nats_url`. `node_id` is this machine's id
    (workers with the same one are reached through shared memory; default as a worker's). `local`:
    keys are placed over the members on this node only, where it has any (`ClientConfig.placement`).
    Each call is bounded by `timeout_s`; joining the cluster by `timeout_s` or `JOIN_TIMEOUT_S`, the
    longer."""

    def __init__(self, nats_url: str, *, token: str | None = None, replication: int = 1, timeout_s: float = 5.0,
                 node_id: str | None = None, tls_ca: str | None = None, local: bool = False) -> None:
        self.nats_url = nats_url
        self.replication = replication
        self.local = local
        self.timeout_s = timeout_s
        self._forked = False
        self.membership = Membership(nats_url, connect_timeout_s=max(timeout_s, JOIN_TIMEOUT_S))
        with ExitStack() as undo:  # what is made so far, closed if a later step raises (Ctrl-C too)
            undo.callback(self.membership.close)
            self.membership.watch()
            self.fanout = FanOut(node_id or default_node_id(), token, timeout_s, tls_ca)
            undo.callback(self.fanout.close)
            _BACKENDS.add(self)  # (once it has a fan-out to refuse calls with, in a forked child)
            self.repairs = Repairs(self.fanout, self.live, timeout_s)
            undo.callback(self.repairs.close)
            self.missed = MissedWrites(self.fanout, self.live, timeout_s)
            """Removals owed to owners that a put or remove went on without (`kvpool.core.missed_writes`)."""
            undo.callback(self.missed.close)
            self.supersedes = Background("kvpool-supersede", 1 << 16)
            """Where puts and removes tell the workers below the owners (`_supersede`)."""
            undo.pop_all()

    # ----- placement --------------------------------------------------------------------------

    def _owners(self, keys: Sequence[bytes], live: dict[str, WorkerInfo], whole: bool = False) -> list[list[str]]:
        """Each key's owners (its first `replication` workers by rank); with `whole`, every worker, the
        owners first (whom a put tells below them: `_supersede`). With `local` placement, the workers
        ranked are this node's (all of them where it has none)."""
        ids = list(live)
        if self.local:
            ids = [w for w in ids if live[w].node_id == self.fanout.node_id] or ids
        if whole:
            return [rank(k, ids) for k in keys]
        return [rank(k, ids)[:self.replication] for k in keys]

    def _supersede(self, live: dict[str, WorkerInfo], ranked: list[list[str]], keys: Sequence[bytes],
                   versions: list[int]) -> None:
        """Tell the workers below each key's owners that may hold an older copy (`ranked`:
        `_owners(whole=True)`; `succession.told_below`) to drop a block of it stamped before its version,
        or within the clock-skew bound after it (`Connection.supersede`, one way;
        `ReplicaState.supersede`). Such a worker owned the key before one ranked above it joined, and
        would serve the block again, though newer ones were written meanwhile, if that one left. With
        `local` placement, the workers placing by hash would give it are told too (`_by_hash`).
        At once where this client's connection to the worker is open and unused (a one-way message:
        sent before the put returns, so a writer killed right after still told it), else in the
        background (`supersedes`): a put never waits on a worker that owns none of its keys; here
        when 65,536 keys wait already. A worker this client takes as down (suspect), or that fails
        the call, is owed it as a removal below the version (`missed`), sent once it answers again (it
        would otherwise keep the old block, and serve it once the owners above it left). The put or
        remove stands whatever happens here."""
        r = self.replication
        hashed = self._by_hash(live, keys, ranked) if self.local else None
        groups: Groups = {}
        for i, ws in enumerate(ranked):
            told = told_below(ws, r, live)
            if hashed is not None:
                told = list(dict.fromkeys(told + hashed[i]))
            for w in told:
                groups.setdefault(w, []).append(i)
        if not groups:
            return

        def tell_now(t: Transport, idx: list[int]) -> None:
            t.supersede([keys[i] for i in idx], [versions[i] for i in idx], idle=True)

        sent = self.fanout.send_idle(live, groups, tell_now)
        groups = {w: idx for w, idx in groups.items() if w not in sent}
        if not groups:
            return
        keys = list(keys)  # the caller may change its list once the put returns

        def tell(t: Transport, idx: list[int]) -> None:
            t.supersede([keys[i] for i in idx], [versions[i] for i in idx])

        def send() -> None:
            try:
                live = self.live()  # as it is now (`live_groups`)
                told = live_groups(live, groups)
                answered = {w for w, _, _ in self.fanout.each(live, told, tell, self._deadline())}
                for w, idx in told.items():  # suspect, or failed now: owed until it answers (`missed`)
                    if w not in answered:
                        self.missed.missed(w, [keys[i] for i in idx], [versions[i] - 1 for i in idx])
            except KVPoolError as e:
                log.debug("the workers below the owners of %d keys not told: %s", len(keys), e)

        if not self.supersedes.submit(len(keys), send):
            send()

    def _by_hash(self, live: dict[str, WorkerInfo], keys: Sequence[bytes],
                 ranked: list[list[str]]) -> list[list[str]]:
        """With `local` placement: the workers that placing by hash gives each key, owners and those
        below them that may hold a copy (`told_below`), other than the owners of `ranked`
        (`_owners(whole=True)`). They may hold a copy of the key from before (written while this node
        had no worker, or when its workers were others), which they would serve again once this node's
        workers leave: `_supersede` tells them too."""
        r = self.replication
        ids = list(live)
        out = []
        for k, ws in zip(keys, ranked):
            hashed = rank(k, ids)
            out.append([w for w in hashed[:r] + told_below(hashed, r, live) if w not in ws[:r]])
        return out

    def supersede_below_owners(self, keys: Sequence[bytes], live: dict[str, WorkerInfo]) -> None:
        """Before a put that goes another way (`shm_stage.Stagers`): the workers below each key's owners
        among `live` (`live()`) are told, as of now, what an ordinary put tells them (`_supersede`)."""
        if len(live) > self.replication:
            self._supersede(live, self._owners(keys, live, whole=True), keys, CLOCK.batch(len(keys)))

    def sole_owner(self, keys: Sequence[bytes], live: dict[str, WorkerInfo]) -> WorkerInfo | None:
        """The member of `live` (`live()`) that placement gives every key of `keys` to, as their only copy;
        None when the keys spread over several workers or have more than one copy."""
        owners = self._owners(keys, live)
        first = owners[0] if owners else []
        if len(first) != 1 or any(o != first for o in owners):
            return None
        return live[first[0]]

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _missed(self, groups: Groups, answered: set[str], keys: Sequence[bytes], versions: Sequence[int]) -> None:
        """The owners of `groups` that did not answer a write (suspect, or failed within the call) are
        owed a removal of their older copies, as of `versions` (`missed`). With one copy of each key, an
        owner that misses a write fails it: nothing is owed."""
        if self.replication <= 1:
            return
        for w, idx in groups.items():
            if w not in answered:
                self.missed.missed(w, [keys[i] for i in idx], [versions[i] for i in idx])

    def _replica_groups(self, owners: list[list[str]]) -> Groups:
        """Key indices by owner: the first `replication` workers of each of `owners` (`_owners`)."""
        groups: Groups = {}
        for i, ow in enumerate(owners):
            for w in ow[:self.replication]:
                groups.setdefault(w, []).append(i)
        return groups

    def live(self) -> dict[str, WorkerInfo]:
        """The members: placement ranks all of them, suspect or not (`FanOut.each` skips suspects). The
        connections to workers long gone are closed (`FanOut.drop_departed`)."""
        live = self.membership.members()
        self.fanout.drop_departed(live)
        return live

    # ----- the PoolBackend calls ----------------------------------------------------------------

    @property
    def max_block(self) -> int:
        return max((i.max_block for i in self.live().values()), default=16 << 20)

    def batch_put(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float = 0.0) -> None:
        """Each block to every live owner, as of one version per block (the same on every replica). A
        block an owner holds a version as new or newer of (another writer's clock runs ahead of this
        one's, or stamped in the same millisecond) is put again to all, as of a version above the
        newest its owners hold: a put made after another one was acknowledged replaces it."""
        live = self.live()
        if not live:
            raise PoolUnavailable(f"no live workers in the cluster at {redacted_url(self.nats_url)}")
        ranked = self._owners(keys, live, whole=True)
        self._refuse_too_large(live, ranked, keys, buffers)
        if self.replication > 1:  # CUDA tensors to the host once, not once per owner (R=1: the transport's)
            buffers = readable_all(buffers)
        versions = CLOCK.batch(len(keys))
        deferred: list[Deferred] = []  # (blocks refused; or stored, but a full disk kept older SSD copies)
        try:
            superseded = self._put_as_of(live, ranked, keys, buffers, pin_s, versions, deferred)
            if superseded:
                again = [keys[i] for i in superseded]
                later: list[Deferred] = []
                try:
                    self._put_as_of(live, [ranked[i] for i in superseded], again, [buffers[i] for i in superseded],
                                    pin_s, self._restamp(live, again, superseded, versions), later)
                except PoolUnavailable as e:  # (PartialPut too) the batch's indices, with the blocks refused before
                    failed = [superseded[j] for j in e.failed] if isinstance(e, PartialPut) else superseded
                    raise PartialPut(str(e), failed=sorted({*failed, *(i for d in deferred for i in d.unstored)})
                                     ) from None
                deferred += [Deferred(d.error, [superseded[j] for j in d.unstored]) for d in later]
            if deferred:  # a refusal before a store not durable (StorageError): the block not stored is told
                raise next((d.error for d in deferred if d.unstored), deferred[0].error)
        finally:  # (a put that failed may have reached an owner: the older copies go too)
            self._supersede(live, ranked, keys, versions)

    def _refuse_too_large(self, live: dict[str, WorkerInfo], ranked: list[list[str]], keys: Sequence[bytes],
                          buffers: Sequence[Any]) -> None:
        """BlockTooLarge, before any block is sent, for the first block larger than one of its owners takes
        (`refuse_too_large`): a batch with one stores none, on no worker."""
        limit = {w: max_block_of(info) for w, info in live.items()}
        sizes = [byte_size(b) for b in buffers]
        if len(set(limit.values())) == 1:  # one max block across the cluster (the usual case): one check
            refuse_too_large(keys, sizes, next(iter(limit.values())))
            return
        for key, size, owners in zip(keys, sizes, ranked):
            refuse_too_large([key], [size], min(limit[w] for w in owners[:self.replication]))

    def _put_as_of(self, live: dict[str, WorkerInfo], ranked: list[list[str]], keys: Sequence[bytes],
                   buffers: Sequence[Any], pin_s: float, versions: list[int], deferred: list[Deferred]
                   ) -> list[int]:
        """Put to every live owner (the first `replication` of `ranked`) as of `versions`; the indices an
        owner held as new or newer. Each owner's answer is taken block by block: a block it refused (no
        room, its tenant's quota, corrupt on arrival) leaves that owner owed the removal of its older copy,
        as an owner that missed the put is (else that copy is served once the other owners lose the newer
        block). The error of the first block every owner that answered refused, else of the first stored
        but not durable (a full disk), is appended to `deferred`, for the caller to raise once the blocks
        held newer are put again; PartialPut (or PoolUnavailable) where a block's owners did not answer."""
        stored = [0] * len(keys)
        superseded: set[int] = set()
        refused: Groups = {}
        refusals: dict[int, int] = {}  # index -> the first refusal's item status
        storage_at: int | None = None

        def put(t: Transport, idx: list[int]) -> list[int]:
            return t.put_statuses([keys[i] for i in idx], [buffers[i] for i in idx], pin_s, [versions[i] for i in idx])

        groups = self._replica_groups(ranked)
        answered: set[str] = set()
        for w, idx, status in self.fanout.each(live, groups, put, self._deadline()):
            answered.add(w)
            for i, st in zip(idx, status):
                if st in _STORED:
                    stored[i] += 1
                    if st == P.ITEM_SUPERSEDED:
                        superseded.add(i)
                    elif st == P.ITEM_STORAGE and storage_at is None:
                        storage_at = i
                else:
                    refused.setdefault(w, []).append(i)
                    refusals.setdefault(i, st)
        below = [v - 1 for v in versions]  # (the put's own version stays welcome)
        self._missed(groups, answered, keys, below)
        for w, idx in refused.items():
            self._missed({w: idx}, set(), keys, below)
        unstored = [i for i, n in enumerate(stored) if not n]
        if unstored and not all(i in refusals for i in unstored):  # some blocks' owners did not answer
            why = (f"{len(unstored)} of {len(keys)} blocks were stored by no live worker that answered (one that "
                   "did not answer in time may still store them)")
            if any(stored):  # the others were: the caller may tell them apart (those an owner held newer
                # were not stored either: their put again, with a fresh version, is not made now)
                raise PartialPut(why, failed=sorted({*unstored, *superseded}))
            if self.fanout.answering(others_than=groups):  # the pool answers, only these blocks' owners did
                raise PartialPut(why, failed=list(range(len(keys))))  # not: not an outage of the pool
            raise PoolUnavailable(why)
        if unstored:  # each refused by every owner that answered: the first one's own error, as with one owner
            deferred.append(Deferred(self._item_error(refusals[unstored[0]], unstored[0], keys, buffers), unstored))
        elif storage_at is not None:
            deferred.append(Deferred(self._item_error(P.ITEM_STORAGE, storage_at, keys, buffers), []))
        return sorted(superseded)

    def _item_error(self, status: int, i: int, keys: Sequence[bytes], buffers: Sequence[Any]) -> KVPoolError:
        """The error a worker's item status `status` for block `i` means (`connection.item_error`)."""
        max_block = self.max_block if status == P.ITEM_TOO_LARGE else 0  # (told in that error's words only)
        error = item_error(status, keys[i], byte_size(buffers[i]), max_block)
        return error if error is not None else ProtocolError(f"item status {status} taken for a failure")

    def _restamp(self, live: dict[str, WorkerInfo], again: Sequence[bytes], idx: list[int],
                 versions: list[int]) -> list[int]:
        """Fresh versions for the keys `again` (the batch's at `idx`), above the newest any of their live
        owners knows of each: written into `versions` at `idx` (what the workers below the owners are told)
        and returned."""
        def ask(t: Transport, sub: list[int]) -> tuple[list[bool], list[int]]:
            return t.batch_versions([again[j] for j in sub])  # merged into this process's clock

        for _ in self.fanout.each(live, self._replica_groups(self._owners(again, live)), ask, self._deadline()):
            pass
        stamps = CLOCK.batch(len(again))
        for i, v in zip(idx, stamps):
            versions[i] = v
        return stamps

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        """The newest version of each block among its live owners, or a miss (-1) where the newest thing
        they know of the key is its removal. With one copy, the owner is simply asked; with more,
        `_read_newest`."""
        return self._get_into(keys, buffers, self._deadline())

    def _get_into(self, keys: Sequence[bytes], buffers: Sequence[Any], deadline: float) -> list[int]:
        """`batch_get_into` by `deadline` (what is not read by then is a miss)."""
        live = self.live()
        owners = self._owners(keys, live)
        if self.replication <= 1:
            return self._ask_each(live, self._replica_groups(owners), keys, buffers, deadline)
        return self._read_newest(keys, buffers, live, owners, deadline)

    def batch_get_into_at(self, workers: Sequence[str | None], keys: Sequence[bytes],
                          buffers: Sequence[Any]) -> list[int]:
        """`batch_get_into`, but each key with a worker named beside it (where its writer put it: a
        `Place`) is read from that worker first, whoever placement says owns it, and from its owners
        only where that worker misses (no member, no answer, no such key); one deadline for both. The
        caller checks what it read (a key's block there may be another version than it was told of)."""
        deadline = self._deadline()
        live = self.live()
        groups: Groups = {}
        for i, w in enumerate(workers):
            if w is not None and w in live:
                groups.setdefault(w, []).append(i)
        out = self._ask_each(live, groups, keys, buffers, deadline) if groups else [-1] * len(keys)
        rest = [i for i, n in enumerate(out) if n < 0]
        if rest and time.monotonic() < deadline:
            for i, n in zip(rest, self._get_into([keys[i] for i in rest], [buffers[i] for i in rest], deadline)):
                out[i] = n
        return out

    def _ask_each(self, live: dict[str, WorkerInfo], groups: Groups, keys: Sequence[bytes], buffers: Sequence[Any],
                  deadline: float) -> list[int]:
        """Each key read from the one worker `groups` names for it, a miss where none answered by `deadline`."""
        out = [-1] * len(keys)

        def get(t: Transport, idx: list[int]) -> list[int]:
            return t.batch_get_into([keys[i] for i in idx], [buffers[i] for i in idx])

        for _, idx, sizes in self.fanout.each(live, groups, get, deadline, reads=True):
            for i, n in zip(idx, sizes):
                out[i] = n
        return out

    def _read_newest(self, keys: Sequence[bytes], buffers: Sequence[Any], live: dict[str, WorkerInfo],
                     owners: list[list[str]], deadline: float) -> list[int]:
        """Two rounds under the call's one deadline. First, in parallel, each key's primary reads it into
        the caller's buffer and its other owners say which version they hold (EXISTS): one round trip
        when they agree. Then the keys whose newest version is a block held by another owner are read
        from it (the primary missed, was stale or did not answer). A removal as new as or newer than
        every block is a miss. Owners that answered with something older are repaired in the background
        (`Repairs`)."""
        n = len(keys)
        halfway = min(deadline, time.monotonic() + self.timeout_s / 2)
        out = [-1] * n
        got = [0] * n  # the version of what lies in buffers[i] (where out[i] >= 0)
        heard: list[dict[str, tuple[bool, int]]] = [{} for _ in range(n)]  # owner -> (holds a block, version)

        def first(t: Transport, idx: list[int]) -> tuple[list[int], list[int], list[bool], list[int]]:
            reads = [i for i in idx if i >= 0]  # this worker is their primary
            asks = [~i for i in idx if i < 0]
            sizes, versions = t.batch_get_versions_into([keys[i] for i in reads], [buffers[i] for i in reads])
            flags, known = t.batch_versions([keys[i] for i in asks]) if asks else ([], [])
            return sizes, versions, flags, known

        groups: Groups = {}
        for i, ow in enumerate(owners):
            for rank_, w in enumerate(ow):
                groups.setdefault(w, []).append(i if rank_ == 0 else ~i)
        for w, idx, (sizes, versions, flags, known) in self.fanout.each(live, groups, first, halfway, reads=True):
            reads = [i for i in idx if i >= 0]
            asks = [~i for i in idx if i < 0]
            for i, size, v in zip(reads, sizes, versions):
                out[i], got[i] = size, v
                heard[i][w] = (size >= 0, v)
            for i, f, v in zip(asks, flags, known):
                heard[i][w] = (f, v)
        newest = [_newest(h) for h in heard]
        fetch: Groups = {}
        for i in range(n):
            version, block = newest[i]
            if out[i] >= 0 and got[i] >= version:
                continue
            out[i] = -1
            holder = next((w for w, (b, v) in heard[i].items() if b and v == version), None) if block else None
            if holder is not None:
                fetch.setdefault(holder, []).append(i)

        def get(t: Transport, idx: list[int]) -> tuple[list[int], list[int]]:
            return t.batch_get_versions_into([keys[i] for i in idx], [buffers[i] for i in idx])

        for _, idx, (sizes, versions) in self.fanout.each(live, fetch, get, deadline, reads=True):
            for i, size, v in zip(idx, sizes, versions):
                if size >= 0 and v >= newest[i][0]:
                    out[i], got[i] = size, v
        stale = [Repair(keys[i], [w for w, (b, v) in heard[i].items() if (b, v) != (newest[i][1], newest[i][0])],
                        got[i] if out[i] >= 0 else newest[i][0], buffers[i] if out[i] >= 0 else None, out[i])
                 for i in range(n) if newest[i][0] and (out[i] >= 0 or not newest[i][1])]
        self.repairs.submit([r for r in stale if r.owners])
        return out

    def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the newest thing the key's live owners know of it is a block (not its removal)."""
        live = self.live()
        owners = self._owners(keys, live)
        heard: list[dict[str, tuple[bool, int]]] = [{} for _ in keys]

        def ask(t: Transport, idx: list[int]) -> tuple[list[bool], list[int]]:
            return t.batch_versions([keys[i] for i in idx])

        for w, idx, (flags, versions) in self.fanout.each(live, self._replica_groups(owners), ask,
                                                          self._deadline(), reads=True):
            for i, f, v in zip(idx, flags, versions):
                heard[i][w] = (f, v)
        return [_newest(h)[1] for h in heard]

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        flags = self.batch_exists(keys)
        return next((i for i, f in enumerate(flags) if not f), len(flags))

    def batch_pin(self, keys: Sequence[bytes], pin_s: float) -> None:
        """Every current owner (replica) of each key is told; nothing waits for the workers."""
        live = self.live()

        def pin(t: Transport, idx: list[int]) -> None:
            t.batch_pin([keys[i] for i in idx], pin_s)

        for _ in self.fanout.each(live, self._replica_groups(self._owners(keys, live)), pin, self._deadline()):
            pass

    def batch_remove(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove from every live owner, as of one version per key (the same on every replica); a key an
        owner holds a block as new or newer of is removed again as of a version above its owners' newest.
        Keys no live owner answered for: PartialFailure (their indices; `result` the others' flags)
        where some owner or other worker answered, else PoolUnavailable."""
        live = self.live()
        ranked = self._owners(keys, live, whole=True)
        versions = CLOCK.batch(len(keys))
        try:
            removed, superseded, unreached = self._remove_as_of(live, ranked, keys, versions)
            if superseded:
                again = [keys[i] for i in superseded]
                stamps = self._restamp(live, again, superseded, versions)
                done, _, lost = self._remove_as_of(live, [ranked[i] for i in superseded], again, stamps)
                for i, ok in zip(superseded, done):
                    removed[i] = removed[i] or ok
                unreached += [superseded[j] for j in lost if not removed[superseded[j]]]
        finally:
            self._supersede(live, ranked, keys, versions)
        if unreached:
            why = (f"{len(set(unreached))} of {len(keys)} removes were answered by no live owner (one that did not "
                   "answer in time may still remove them)")
            if len(set(unreached)) < len(keys) or self.fanout.answering(others_than=self._replica_groups(ranked)):
                raise PartialFailure(why, failed=sorted(set(unreached)), result=removed)
            raise PoolUnavailable(why)
        return removed

    def _remove_as_of(self, live: dict[str, WorkerInfo], ranked: list[list[str]], keys: Sequence[bytes],
                      versions: list[int]) -> tuple[list[bool], list[int], list[int]]:
        """Remove from every live owner (the first `replication` of `ranked`) as of `versions`: whether an
        owner removed each key, the indices of those an owner held a block as new or newer of, and those
        no owner answered for (an owner that did not answer may still hold the key: "not removed" would
        be an answer it never gave)."""
        removed = [False] * len(keys)
        reached = [False] * len(keys)
        superseded: set[int] = set()

        def rm(t: Transport, idx: list[int]) -> list[int]:
            return t.remove_as_of([keys[i] for i in idx], [versions[i] for i in idx])

        groups = self._replica_groups(ranked)
        answered: set[str] = set()
        for w, idx, outcomes in self.fanout.each(live, groups, rm, self._deadline()):
            answered.add(w)
            for i, o in zip(idx, outcomes):
                reached[i] = True
                removed[i] = removed[i] or o == REMOVED
                if o == SUPERSEDED:
                    superseded.add(i)
        self._missed(groups, answered, keys, versions)
        return removed, sorted(superseded), [i for i, r in enumerate(reached) if not r]

    @contextmanager
    def batch_lease(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        """Views of the blocks (None per miss) under the call's one deadline. With one copy of each
        block, each owner's keys are leased from it in parallel: in place where it shares memory with
        this process (a same-node worker: zero copy, valid inside the `with`), as copies from the others.
        With replicas, each block is read as `batch_get_into` reads it, the newest version among its
        owners, into a copy; what is not read by the deadline is a miss."""
        deadline = self._deadline()
        with ExitStack() as held:
            if self.replication <= 1:
                yield self._lease_from_owners(keys, held, deadline)
            else:
                yield self._newest_copies(keys, deadline)

    def _lease_from_owners(self, keys: Sequence[bytes], held: ExitStack, deadline: float) -> list[memoryview | None]:
        """Each owner's keys leased from it (`Transport.batch_lease`), the leases of those in place ended
        by `held`. An owner that does not answer in time is abandoned (its connection aborted, which ends
        its leases): its keys are misses."""
        live = self.live()
        out: list[memoryview | None] = [None] * len(keys)

        def lease(t: Transport, idx: list[int]) -> tuple[AbstractContextManager[Any] | None, list[memoryview | None]]:
            leasing = t.batch_lease([keys[i] for i in idx])
            views = leasing.__enter__()
            if isinstance(t, ShmTransport):
                return leasing, views  # in place: ended when the caller's `with` ends
            leasing.__exit__(None, None, None)  # copies: nothing held
            return None, views

        for _, idx, (leasing, views) in self.fanout.each(live, self._replica_groups(self._owners(keys, live)),
                                                           lease, deadline, reads=True):
            if leasing is not None:
                held.push(leasing.__exit__)
            for i, v in zip(idx, views):
                out[i] = v
        return out

    def _newest_copies(self, keys: Sequence[bytes], deadline: float) -> list[memoryview | None]:
        """A copy of each block's newest version among its owners (`_get_into`, `copies`); a key not
        reached by `deadline` is a miss."""
        def get_into(one: Sequence[bytes], into: Sequence[Any]) -> list[int]:
            return self._get_into(one, into, deadline) if time.monotonic() < deadline else [-1]
        return copies(keys, self.max_block, get_into)

    def clear(self, prefix: bytes | None = None) -> None:
        """Clear every live worker; PartialFailure naming those that did not answer where others did
        (PoolUnavailable where none did): they keep their blocks, and the caller may want to clear again
        once they are back."""
        live = self.live()
        cleared = {w for w, _, _ in self.fanout.each(live, {w: [] for w in live}, lambda t, idx: t.clear(prefix),
                                                     self._deadline())}
        if cleared != live.keys():
            missing = ", ".join(sorted(live.keys() - cleared))
            why = f"clear reached {len(cleared)} of {len(live)} live workers; not {missing}"
            if cleared:  # the pool answers: those workers did not, in time
                raise PartialFailure(why)
            raise PoolUnavailable(why)

    def stats(self) -> PoolStats:
        live = self.live()
        out = {w: WorkerStats(info, error="no answer") for w, info in live.items()}
        for w, _, s in self.fanout.each(live, {w: [] for w in live}, lambda t, idx: t.stats(), self._deadline(),
                                        reads=True):
            (got,) = s.workers.values()  # a transport's stats: its one worker; its entry's heartbeat
            out[w] = dataclasses.replace(got, info=dataclasses.replace(got.info, ts=live[w].ts))  # from NATS
        return PoolStats.of_workers(out)

    def members(self) -> dict[str, WorkerInfo]:
        return self.membership.members()

    def wait_for_members(self, predicate: MembersPredicate, timeout_s: float) -> bool:
        return self.membership.wait_for(predicate, timeout_s)

    def close(self) -> None:
        if self._forked:
            return  # its threads and connections are the parent's: nothing of the child's to release
        self.supersedes.close(flush=True)  # first: what the puts made owe the workers below the owners
        self.missed.close()  # then what is owed to owners that missed writes, tried once more
        self.fanout.close()  # then: a repair under way fails fast, and connects nowhere new
        self.repairs.close()
        self.membership.close()

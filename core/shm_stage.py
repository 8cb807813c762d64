"""Puts that do not wait for the worker: one producer's run of same-node puts (a handoff's layers).

A same-node put (`shm_put`) waits for the worker twice: for its slots (ALLOC) and for the COMMIT of
what it copied there. A producer that puts layer after layer of the same shape need wait for neither:
`Stager` keeps the slots of the next `LOOKAHEAD` puts asked for (the sizes of the last put), copies
the next put's blocks straight into them, sends their COMMIT and returns; it reads the worker's
answers when it comes back, only as far as the slots it needs.

The COMMIT is COMMIT_UNCHECKED: the worker does not hash the blocks then, but at each one's first read
through it (a block whose bytes disagree with its checksum, which only a bug or bad memory makes, is
then a miss): a handoff's reader copies the layer from its place and checks its own copy, so the bytes
of a layer that nobody else reads are hashed once on each side, not twice on the producer's.

What that costs its caller:
- a put returns before the worker has committed it: a reader on another node that asks the worker for
  a block the moment it hears of it may find it not there yet (`kvpool.streams` retries such a miss
  briefly); a reader on this node copies it from its place, checked against its checksum;
- a refused commit raises from a later `put` or `settle`; so does a connection lost with commits
  unanswered (PoolUnavailable: whether those were stored is not known);
- a block whose key the worker holds a version as new or newer of is not stored, and not put again
  above it as `Connection.batch_put` does (its bytes may have changed since): a producer's layers go
  under keys of their own request.
A Stager holds a connection of its own to the worker; the slots it keeps for next puts (`LOOKAHEAD`
puts' worth) go back when it closes, or when the worker sees the connection close.
"""
from __future__ import annotations

import socket
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from . import protocol as P
from .auth import unix_socket_usable
from .client import PoolClient
from .cluster_backend import ClusterBackend
from .connection import pin_request, raise_item
from .errors import KVPoolError, PoolUnavailable
from .fanout import Departures
from .fastcopy import copy_into
from .shm_put import PART_BYTES, part_slices, recv_column
from .shm_refs import Place
from .transport import ShmTransport
from .versions import CLOCK

__all__ = ["Stager", "Stagers", "LOOKAHEAD"]

LOOKAHEAD = 2
"""Puts whose slots a stager keeps asked for ahead: the worker commits one put while the producer copies
the next, and the producer never waits for the worker's answer to the put it just made (with one
ahead, the answer it waited for took the worker's whole turn: 358 -> 281 us per 1 MiB put here)."""


class Stager:
    """Same-node puts through `transport` (a connection of the stager's own to the worker whose arena is
    `arena`) that return without waiting for the worker (see the module's doc). Not thread-safe: one
    producer's."""

    def __init__(self, transport: ShmTransport, arena: str) -> None:
        self.transport, self.arena = transport, arena  # (the arena of the worker it was made for)
        self._owed: deque[tuple[int, list[bytes], np.ndarray]] = deque()
        """(op, keys, sizes) of each request sent and not yet answered, in order."""
        self._spares: deque[tuple[tuple[int, ...], np.ndarray]] = deque()
        """(sizes, offsets) of slots reserved for next puts of those sizes, oldest first."""
        self._failed: BaseException | None = None
        self._held: list[tuple[int, bytes]] = []
        """Requests of the last put, made with `hold` and not sent yet; (op, keys, sizes) of those owed
        an answer once they are."""
        self._held_owed: list[tuple[int, list[bytes], np.ndarray]] = []
        self._fitted: tuple[int, ...] | None = None  # the last shape `fits` said yes to

    def fits(self, sizes: Sequence[int]) -> bool:
        """Whether a put of blocks of `sizes` can go this way: one frame, and with the spare slots
        within what the worker lets one connection hold reserved (the answer for the last shape that
        fitted is kept: a producer's layers have one shape)."""
        shape = tuple(sizes)
        if shape == self._fitted:
            return True
        info = self.transport.hello()
        budget = (info.max_reserve or P.MAX_DATA) // (1 + LOOKAHEAD)
        fit = bool(sizes) and len(P.frames(len(sizes), sizes, budget)) == 1 and sum(sizes) <= budget \
            and max(sizes) <= info.max_block
        if fit:
            self._fitted = shape
        return fit

    def put(self, keys: list[bytes], views: Sequence[memoryview], pin_s: float = 0.0, *,
            hold: bool = False) -> tuple[list[Place], list[int]]:
        """Copy the blocks into the worker's arena and send their COMMIT (pinned `pin_s` seconds if > 0);
        where each lies, and its checksum. Raises the failure of an earlier put first (see the module's
        doc). `hold`: the COMMIT waits for `send_held` (or this stager's next call): a producer announces
        the blocks first, and the worker's commit does not delay the announcement (a reader on this node
        copies them from their places, checked against their checksums, before or after the commit)."""
        sizes = np.array([v.nbytes for v in views], dtype="<i8")
        versions = CLOCK.batch_array(len(keys))
        t = self.transport
        try:
            with t.held() as (sock, arena, pages):
                self._send_held(sock)
                offsets = self._slots(sock, keys, sizes)
                pages.ready(offsets, sizes)
                csums = np.empty(len(views), dtype="<u8")
                for part in part_slices(sizes.tolist(), PART_BYTES):  # a close waits for a part at most
                    with t.copying(sock):
                        csums[part] = copy_into(arena, offsets[part], views[part])
                self._held = [pin_request(keys, pin_s)] if pin_s > 0 else []
                self._held.append((P.Op.COMMIT_UNCHECKED, P.pack_batch(keys, offsets, sizes, csums, versions)))
                self._held_owed = [(P.Op.COMMIT_UNCHECKED, keys, sizes)]
                ahead = len(self._spares) + sum(op == P.Op.ALLOC for op, _, _ in self._owed)
                for _ in range(LOOKAHEAD - ahead):  # the next puts' slots
                    self._held.append((P.Op.ALLOC, P.pack_batch(keys, sizes)))
                    self._held_owed.append((P.Op.ALLOC, keys, sizes))
                if not hold:
                    self._send_held(sock)
        except PoolUnavailable:  # the connection is closed (PoolTimeout too)
            self._forget()
            raise
        info = t.info
        return [Place(info.worker_id, info.arena, off, size, version)
                for off, size, version in zip(offsets.tolist(), sizes.tolist(), versions.tolist())], csums.tolist()

    def send_held(self) -> None:
        """Send the COMMIT of a put made with `hold` (nothing if none is held)."""
        if self._held:
            try:
                with self.transport.held() as (sock, _, _):
                    self._send_held(sock)
            except PoolUnavailable:
                self._forget()
                raise

    def _send_held(self, sock: socket.socket) -> None:
        if self._held:
            P.send_frames(sock, self._held)  # one wake-up of the worker for the pin, commit and next alloc
            self._owed += self._held_owed
            self._held, self._held_owed = [], []

    def _send(self, sock: socket.socket, op: int, keys: list[bytes], sizes: np.ndarray, meta: bytes) -> None:
        self._owed.append((op, keys, sizes))
        P.send_frame(sock, op, meta)

    def _slots(self, sock: socket.socket, keys: list[bytes], sizes: np.ndarray) -> np.ndarray:
        """Offsets of slots for blocks of `sizes`: the oldest spare ones, reading the worker's answers
        only until they are there; else asked for now (spare ones of other sizes given back). Raises
        the failure of an earlier put first; CapacityError if the worker has no room."""
        shape = tuple(sizes.tolist())
        while self._owed and not (self._spares and self._spares[0][0] == shape):
            self._answer(sock)
        if not self._spares or self._spares[0][0] != shape:
            self._give_back(sock)
            self._send(sock, P.Op.ALLOC, keys, sizes, P.pack_batch(keys, sizes))
            self._answers(sock)
        self._raise_failed()
        if not self._spares:
            raise_item(P.ITEM_FULL, keys[0], int(sizes.sum()), 0)
        return self._spares.popleft()[1]

    def _answers(self, sock: socket.socket) -> None:
        """Read the answer to every request sent."""
        while self._owed:
            self._answer(sock)

    def _answer(self, sock: socket.socket) -> None:
        """Read the answer to the oldest request sent (the worker answers in order)."""
        if self._owed:
            op, keys, sizes = self._owed[0]
            got = recv_column(sock, op, len(keys))
            self._owed.popleft()
            if op == P.Op.COMMIT_UNCHECKED:  # one superseded (a newer version held) is not a failure
                bad = np.flatnonzero((got != 0) & (got != P.ITEM_SUPERSEDED))
                if bad.size and self._failed is None:
                    i = int(bad[0])
                    try:
                        raise_item(int(got[i]), keys[i], int(sizes[i]), self.transport.info.max_block)
                    except KVPoolError as e:  # kept for the caller's next put or settle
                        self._failed = e
            elif (got >= 0).all():
                self._spares.append((tuple(sizes.tolist()), got.copy()))
            elif (held := got[got >= 0]).size:  # no room for all: what was granted goes back
                P.send_frame(sock, P.Op.ABORT, held.tobytes())

    def _give_back(self, sock: socket.socket) -> None:
        if self._spares:
            P.send_frame(sock, P.Op.ABORT, np.concatenate([offsets for _, offsets in self._spares]).tobytes())
            self._spares.clear()

    def _raise_failed(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _forget(self) -> None:
        """The connection is closed: nothing is owed on it and its slots went back with it."""
        self._owed.clear()
        self._held, self._held_owed = [], []
        self._spares.clear()
        self.transport.close()

    def settle(self) -> None:
        """Wait until the worker answered every put sent; raise the first failure."""
        if self._owed or self._held:
            try:
                with self.transport.held() as (sock, _, _):
                    self._send_held(sock)
                    self._answers(sock)
            except PoolUnavailable:
                self._forget()
                raise
        self._raise_failed()

    def close(self) -> None:
        """Send a held put's COMMIT, give the spare slots back and close the connection (puts still
        unanswered are not waited for)."""
        try:
            if self._held or (self._spares and not self._owed):
                with self.transport.held() as (sock, _, _):
                    self._send_held(sock)
                    if not self._owed:
                        self._give_back(sock)
        except PoolUnavailable:
            pass  # gone already: the worker freed them with the connection
        finally:
            self._owed.clear()
            self._held, self._held_owed = [], []
            self._spares.clear()
            self.transport.close()


class Stagers:
    """A producer's stagers, one per same-node worker its puts went to: `for_keys` picks the one for a
    put, or None where the put must go the ordinary way (another node, several owners or copies, an
    embedded pool, blocks too large to keep spare slots for). In a cluster, picking one first has the
    keys' worker next in line drop older copies of them, as an ordinary put does
    (`ClusterBackend.supersede_next_in_line`)."""

    def __init__(self, pool: PoolClient) -> None:
        self.pool = pool
        self._stagers: dict[str, Stager] = {}  # by worker id
        self._departures = Departures()

    def for_keys(self, keys: Sequence[bytes], sizes: Sequence[int]) -> Stager | None:
        backend = self.pool.backend
        if isinstance(backend, ShmTransport):
            info = backend.hello()
            where = (backend.address, backend.token, backend.timeout_s)
        elif isinstance(backend, ClusterBackend):
            for gone in self._departures.gone(self._stagers, backend.members()):
                self._stagers.pop(gone).close()  # it maps the departed worker's arena
            owner = backend.sole_owner(keys)
            fanout = backend.fanout
            if owner is None or owner.node_id != fanout.node_id:
                return None
            info = owner
            where = (owner.unix, fanout.token, fanout.timeout_s)
        else:
            return None
        stager = self._stagers.get(info.worker_id)
        if stager is not None and stager.arena != info.arena:  # the worker restarted: its old self is gone
            stager.close()
            stager = None
        if stager is None:
            if isinstance(backend, ClusterBackend) and not unix_socket_usable(where[0]):
                return None  # another user's worker: reached over TCP
            stager = self._stagers[info.worker_id] = Stager(ShmTransport(*where), info.arena)
        if not stager.fits(sizes):
            return None
        if isinstance(backend, ClusterBackend):
            backend.supersede_next_in_line(keys)  # as the ordinary put does
        return stager

    def send_held(self) -> None:
        """`Stager.send_held` of each; raises the first failure after trying all."""
        self._each(Stager.send_held)

    def settle(self) -> None:
        """`Stager.settle` of each; raises the first failure after settling all."""
        self._each(Stager.settle)

    def _each(self, call: Callable[[Stager], None]) -> None:
        failure: BaseException | None = None
        for stager in self._stagers.values():
            try:
                call(stager)
            except KVPoolError as e:
                failure = failure or e
        if failure is not None:
            raise failure

    def close(self) -> None:
        for stager in self._stagers.values():
            stager.close()
        self._stagers.clear()

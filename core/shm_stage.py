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
A Stager holds a connection of its own to the worker; the slots it keeps for next puts go back when
it closes, or when the worker sees the connection close.

Commits go together while puts come fast. Each request to the worker costs both sides a turn (the worker
~60 us of CPU here, whatever its size), and a same-node handoff made three a layer: the worker's ~200 us
of the ~1.2 ms of CPU a 1 MiB layer took across four processes. So a stager holds the COMMITs (and pins)
of up to `batch` puts (`HOLD_PUTS` at most, fewer where the worker's reserve for one connection would
not hold that many puts of the shape and the slots asked for ahead, or they would pass `BATCH_KEYS`
keys) and sends them in one request, with one ALLOC for the next `batch` puts' slots. The producer's own
put sends them where the next put, as far behind as this one came after the last, would find the
first of them `HOLD_S` old; the stager's own thread sends them `HOLD_S` after the producer's last put,
should it not come back by then (so no commit waits `2 * HOLD_S`, and while puts come faster than
`HOLD_S` that thread does not wake for each: 32 x 1 MiB layers here, its CPU 30-40 -> under 10 us a
layer, and the handoff's wall time per layer 641-674 -> 571-615 us); a put after a pause longer than
`HOLD_S` goes out at once; `settle` and `close` send what is held. A reader on this node copies a block
from its place whether or not it is committed (checked against its checksum); one on another node
waits for the commit (`kvpool.streams` asks again for a block its message names for up to half a
second).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import numpy as np

from . import protocol as P
from .auth import unix_socket_usable
from .background import Alarm
from .client import PoolClient
from .cluster_backend import ClusterBackend
from .connection import item_error, raise_item
from .errors import KVPoolError, PoolUnavailable
from .fanout import Departures
from .fastcopy import copy_into
from .shm_put import PART_BYTES, part_slices, recv_column, still_open
from .shm_refs import Place
from .transport import ShmTransport
from .versions import CLOCK

__all__ = ["Stager", "Stagers", "LOOKAHEAD", "HOLD_PUTS", "HOLD_S"]

log = logging.getLogger("kvpool.client")

LOOKAHEAD = 2
"""Puts whose slots a stager keeps asked for ahead, at least: the worker commits one put while the producer
copies the next, and the producer never waits for the worker's answer to the put it just made (with one
ahead, the answer it waited for took the worker's whole turn: 358 -> 281 us per 1 MiB put here)."""
HOLD_PUTS = 8
"""Most puts whose commits a stager sends in one request (and whose slots it asks for in one ALLOC).
A same-node handoff of 32 x 1 MiB layers here, best request of ~200, commits held without a time
bound, 2, 4, 8 and 16 at a time: 17.4, 15.2, 14.4, 13.7 ms (16.6-17.9 one at a time); the worker's CPU
per layer 150, 105, 95, 71 us (180-215). docs/BENCHMARKS.md, run AH."""
BATCH_KEYS = 4096
"""Most keys whose commits (or slots) one request of a stager's carries, unless one put has more: the
worker's answers that the stager has not read yet (an ALLOC's: 8 bytes a key) must fit in the socket's
buffer while the stager sends its next request, or both wait on each other until the timeout."""
HOLD_S = 0.002
"""How long a held commit waits for the puts after it (less than twice this: see the module's doc); a put
coming later than this after the one before it is committed at once (the first layer of a request, a
producer slower than this)."""


class Stager:
    """Same-node puts through `transport` (a connection of the stager's own to the worker whose arena is
    `arena`) that return without waiting for the worker (see the module's doc). Not thread-safe: one
    producer's."""

    def __init__(self, transport: ShmTransport, arena: str) -> None:
        self.transport, self.arena = transport, arena  # (the arena of the worker it was made for)
        self._owed: deque[tuple[int, list[bytes], np.ndarray]] = deque()
        """(op, keys, sizes) of each request sent and not yet answered, in order (an ALLOC's keys and
        sizes: one put's, its sizes repeated for each put it asks slots for)."""
        self._spares: deque[tuple[tuple[int, ...], np.ndarray]] = deque()
        """(sizes, offsets) of slots reserved for next puts of those sizes, oldest first."""
        self._failed: BaseException | None = None
        self._held = _Held()
        self._batch = 1  # puts whose commits go in one request, for the last shape `fits` said yes to
        self._fitted: tuple[int, ...] | None = None  # that shape
        self._last_put = 0.0  # (time.monotonic)
        self._lock = threading.Lock()  # the producer's calls against the flusher's
        self._flusher: Alarm | None = None  # made at the first commit held past its put
        self._lost: PoolUnavailable | None = None
        """The flusher's failure to send (the connection gone): raised by the next put or settle, unless
        the producer's own call met the loss first (`_forget`)."""

    def fits(self, sizes: Sequence[int]) -> bool:
        """Whether a put of blocks of `sizes` can go this way: one frame, and with the spare slots
        within what the worker lets one connection hold reserved (the answer for the last shape that
        fitted is kept: a producer's layers have one shape)."""
        shape = tuple(sizes)
        if shape == self._fitted:
            return True
        info = self.transport.hello()
        reserve = info.max_reserve or P.MAX_DATA
        budget = reserve // (1 + LOOKAHEAD)
        total = sum(sizes) + P.RESERVE_FLOOR * len(sizes)  # as the worker charges them
        fit = bool(sizes) and len(P.frames(len(sizes), sizes, budget, P.RESERVE_FLOOR)) == 1 and total <= budget \
            and max(sizes) <= info.max_block
        if fit:
            # held (batch), asked for ahead (up to 2 x batch - 1) and the put under way: within the reserve;
            # and a batch's requests within the protocol's limits (`_puts_per_request`)
            self._fitted, self._batch = shape, max(1, min(HOLD_PUTS, reserve // (3 * max(total, 1)),
                                                          BATCH_KEYS // len(sizes)))
        return fit

    def put(self, keys: list[bytes], views: Sequence[memoryview], pin_s: float = 0.0, *,
            hold: bool = False) -> tuple[list[Place], list[int]]:
        """Copy the blocks into the worker's arena and send their COMMIT (pinned `pin_s` seconds if > 0);
        where each lies, and its checksum. Raises the failure of an earlier put first (see the module's
        doc). `hold`: the COMMIT waits for `send_held` (or this stager's next call): a producer announces
        the blocks first, and the worker's commit does not delay the announcement (a reader on this node
        copies them from their places, checked against their checksums, before or after the commit)."""
        if not keys:
            return [], []
        sizes = np.array([v.nbytes for v in views], dtype="<i8")
        versions = CLOCK.batch_array(len(keys))
        t = self.transport
        now = time.monotonic()
        gap = now - self._last_put
        paused, self._last_put = gap > HOLD_S, now
        try:
            with self._lock, t.held() as (sock, arena, pages):
                still_open(sock)
                meta = _meta_bytes(keys)
                per_request = _puts_per_request(len(keys), meta)
                limit = min(self._batch, per_request)
                if self._held.due or (self._held.puts and (now - self._held.since >= HOLD_S
                                                           or not self._held.has_room(len(keys), meta))):
                    self._send_held(sock)  # (a put made with `hold`, then no `send_held`; a late flusher; full)
                offsets = self._slots(sock, keys, sizes)
                pages.ready(offsets, sizes)
                csums = np.empty(len(views), dtype="<u8")
                for part in part_slices(sizes.tolist(), PART_BYTES):  # a close waits for a part at most
                    with t.copying(sock):
                        csums[part] = copy_into(arena, offsets[part], views[part])
                held = self._held
                held.add(now, keys, meta, offsets, sizes, csums, versions, pin_s)
                held.generation = t.generation
                asked = sum(len(s) // len(keys) for op, _, s in self._owed if op == P.Op.ALLOC)
                ahead = len(self._spares) + asked
                if held.alloc is None and ahead < max(limit, LOOKAHEAD):  # the next puts' slots
                    held.alloc = (keys, sizes, max(limit, min(LOOKAHEAD - ahead, per_request)))
                # go now unless more puts are coming soon (the next one, as far behind as this one, while
                # the first held is under HOLD_S old) and the next one has slots without these
                held.due = (paused or held.puts >= limit or not (self._spares or asked)
                            or now + gap > held.since + HOLD_S)
                if held.due and not hold:
                    self._send_held(sock)
            if held.puts and not held.due:
                self._flush_by(now + HOLD_S)
        except PoolUnavailable:  # the connection is closed (PoolTimeout too)
            self._forget()
            raise
        info = t.info
        return [Place(info.worker_id, info.arena, off, size, version)
                for off, size, version in zip(offsets.tolist(), sizes.tolist(), versions.tolist())], csums.tolist()

    def send_held(self) -> None:
        """Send the commits held that are due (see the module's doc): those of a put made with `hold`
        that would have gone at once without it."""
        if self._held.due:
            try:
                with self._lock, self.transport.held() as (sock, _, _):
                    self._send_held(sock)
            except PoolUnavailable:
                self._forget()
                raise

    def _send_held(self, sock: socket.socket) -> None:
        """Send what is held: pins, commits and the next puts' ALLOC in one send (one wake-up of the
        worker for all)."""
        held = self._held
        if held.puts or held.alloc is not None:
            requests, owed = held.requests()
            P.send_frames(sock, requests)
            self._owed += owed
            self._held = _Held()

    def _flush_by(self, when: float) -> None:
        """Have the flusher send the held commits at `when` (time.monotonic), unless sent before."""
        if self._flusher is None:
            self._flusher = Alarm(weakref.WeakMethod(self._flush_late), "kvpool-stage-flush", "sending held commits")
            weakref.finalize(self, self._flusher.stop, False)  # a stager dropped unclosed takes it along
        self._flusher.arm(when)

    def _flush_late(self) -> None:
        """The flusher's turn: send the commits held, `HOLD_S` after the producer's last put. A failure is
        raised by the producer's next put or settle (whether those puts were stored is not known)."""
        with self._lock:
            held = self._held
            if not held.puts:
                return
            due = self._last_put + HOLD_S
            if due > time.monotonic():  # (armed for earlier puts, whose commits went meanwhile)
                self._flush_by(due)
                return
            try:  # on the connection the slots were reserved on, or none
                with self.transport.held(held.generation) as (sock, _, _):
                    self._send_held(sock)
            except PoolUnavailable as e:  # (closed): as `_forget`, and the producer's next call raises it
                self._lost = e
                self._owed.clear()
                self._held = _Held()
                self._spares.clear()

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
            got = recv_column(sock, op, len(sizes))
            self._owed.popleft()
            if op == P.Op.COMMIT_UNCHECKED:  # one superseded (a newer version held) is not a failure
                bad = np.flatnonzero((got != 0) & (got != P.ITEM_SUPERSEDED))
                if bad.size and self._failed is None:
                    i = int(bad[0])  # kept for the caller's next put or settle
                    self._failed = item_error(int(got[i]), keys[i], int(sizes[i]), self.transport.info.max_block)
            elif (got >= 0).all():
                puts = len(sizes) // len(keys)  # (an ALLOC asks for that many puts' slots; a put has keys)
                shape = tuple(sizes[:len(keys)].tolist())
                self._spares.extend((shape, offsets) for offsets in np.split(got.copy(), puts))
            elif (held := got[got >= 0]).size:  # no room for all: what was granted goes back
                P.send_frame(sock, P.Op.ABORT, held.tobytes())

    def _give_back(self, sock: socket.socket) -> None:
        if self._spares:
            P.send_frame(sock, P.Op.ABORT, np.concatenate([offsets for _, offsets in self._spares]).tobytes())
            self._spares.clear()

    def _raise_failed(self) -> None:
        failed, self._failed = self._failed or self._lost, None
        self._lost = None
        if failed is not None:
            raise failed

    def _forget(self) -> None:
        """The connection is closed: nothing is owed on it and its slots went back with it (the caller
        raises that; a loss the flusher met too is not raised again)."""
        with self._lock:
            self._owed.clear()
            self._held = _Held()
            self._spares.clear()
            self._lost = None
        self.transport.close()

    def settle(self) -> None:
        """Send what is held and wait until the worker answered every put; raise the first failure."""
        try:
            with self._lock:  # (the flusher may be moving held commits to `_owed`)
                if self._owed or self._held.puts:
                    with self.transport.held() as (sock, _, _):
                        self._send_held(sock)
                        self._answers(sock)
                self._raise_failed()
        except PoolUnavailable:
            self._forget()
            raise

    def close(self) -> None:
        """Send the held commits, wait for the worker's answers (within the connection's timeout: a
        worker that finds the connection closed while it still answers drops the requests after), give
        the spare slots back and close the connection. Failures are not raised."""
        if self._flusher is not None:
            self._flusher.stop()  # (before the lock: its last turn may be waiting for it)
        try:
            with self._lock:
                if self._held.puts or self._owed or self._spares:
                    with self.transport.held() as (sock, _, _):
                        self._send_held(sock)
                        self._answers(sock)
                        self._give_back(sock)
        except PoolUnavailable:
            pass  # gone already: the worker freed them with the connection
        finally:
            self._owed.clear()
            self._held = _Held()
            self._spares.clear()
            self.transport.close()


def _meta_bytes(keys: list[bytes]) -> int:
    """What `keys` add to a COMMIT's metadata (the most of any request a put makes: 34 bytes a key
    besides the key)."""
    return sum(map(len, keys)) + 34 * len(keys)


def _puts_per_request(count: int, meta: int) -> int:
    """Puts of `count` keys (`meta` bytes of a COMMIT's metadata: `_meta_bytes`) whose commits (or slots)
    one request may carry: `BATCH_KEYS` keys, within the protocol's limit on metadata."""
    return max(1, min(BATCH_KEYS // count, (P.MAX_META - 4) // meta))


class _Held:
    """The puts a stager has copied in and not sent the commits of yet, and the ALLOC to send with them."""

    def __init__(self) -> None:
        self.puts = 0
        self._count = self._meta = 0  # keys, and their metadata bytes, of all the puts
        self.since = 0.0  # when the first was put (time.monotonic)
        self.due = False  # whether they go at the producer's next `send_held` (else by `since + HOLD_S`)
        self.alloc: tuple[list[bytes], np.ndarray, int] | None = None  # (keys, sizes, puts) to ask slots for
        self.generation = 0  # the connection's (`Connection.generation`) the slots were reserved on
        self._keys: list[bytes] = []
        self._columns: list[tuple[np.ndarray, ...]] = []  # (offsets, sizes, checksums, versions) of each put
        self._pins: list[np.ndarray] = []  # seconds, per key (0: not pinned)

    def add(self, now: float, keys: list[bytes], meta: int, offsets: np.ndarray, sizes: np.ndarray,
            csums: np.ndarray, versions: np.ndarray, pin_s: float) -> None:
        if not self.puts:
            self.since = now
        self.puts += 1
        self._count += len(keys)
        self._meta += meta
        self._keys += keys
        self._columns.append((offsets, sizes, csums, versions))
        self._pins.append(np.full(len(keys), pin_s, dtype="<f8"))

    def has_room(self, count: int, meta: int) -> bool:
        """Whether the commit of a put of `count` keys (`meta` bytes) still fits in one request with these."""
        return self._count + count <= BATCH_KEYS and self._meta + meta <= P.MAX_META - 4

    def requests(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, list[bytes], np.ndarray]]]:
        """The requests to send, in order (PIN, COMMIT_UNCHECKED, ALLOC), and (op, keys, sizes) of those
        answered."""
        requests: list[tuple[int, bytes]] = []
        owed: list[tuple[int, list[bytes], np.ndarray]] = []
        if self.puts:
            pins = np.concatenate(self._pins)
            pinned = np.flatnonzero(pins > 0)
            if pinned.size:
                requests.append((P.Op.PIN, P.pack_batch([self._keys[i] for i in pinned.tolist()], pins[pinned])))
            offsets, sizes, csums, versions = (np.concatenate(c) for c in zip(*self._columns))
            requests.append((P.Op.COMMIT_UNCHECKED, P.pack_batch(self._keys, offsets, sizes, csums, versions)))
            owed.append((P.Op.COMMIT_UNCHECKED, self._keys, sizes))
        if self.alloc is not None:
            keys, sizes, puts = self.alloc
            tiled = np.tile(sizes, puts)
            requests.append((P.Op.ALLOC, P.pack_batch(keys * puts, tiled)))
            owed.append((P.Op.ALLOC, keys, tiled))
        return requests, owed


class Stagers:
    """A producer's stagers, one per same-node worker its puts went to: `for_keys` picks the one for a
    put, or None where the put must go the ordinary way (another node, several owners or copies, an
    embedded pool, blocks too large to keep spare slots for). In a cluster, picking one first has the
    workers below the keys' owners drop older copies of them, as an ordinary put does
    (`ClusterBackend.supersede_below_owners`)."""

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
            live = backend.live()  # (one look at the members for the whole call)
            for gone in self._departures.gone(self._stagers, live):
                self._stagers.pop(gone).close()  # it maps the departed worker's arena
            owner = backend.sole_owner(keys, live)
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
            transport = ShmTransport(*where)
            if isinstance(backend, ClusterBackend):  # another worker answering at a member's address (a
                transport.expect_id = info.worker_id  # restart) is not that member: as the fan-out's connections
            stager = self._stagers[info.worker_id] = Stager(transport, info.arena)
        if not stager.fits(sizes):
            return None
        if isinstance(backend, ClusterBackend):
            backend.supersede_below_owners(keys, live)  # as the ordinary put does
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
        """Close every stager, each whatever the one before raised (a failure is raised once all are)."""
        stagers, self._stagers = list(self._stagers.values()), {}
        with ExitStack() as stack:
            for stager in stagers:
                stack.callback(stager.close)

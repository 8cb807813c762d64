"""Client side of the worker protocol: the two ways block bytes travel to and from one worker.

`TcpTransport` streams block bytes in frames and receives replies straight into the caller's
buffers (many small blocks per system call), hashing each group as it lands; a put sends its frames
back to back. `ShmTransport` maps the worker's arena and moves bytes with one memcpy each way, sending
only control messages over the Unix socket: a put ALLOCs and COMMITs its batch in parts
(`kvpool.core.shm_put`: the worker reserves the next part and verifies the last while one is
copied); a get LEASEs its batch in two requests sent back to back (the first part is copied while
the worker serves the second) and RELEASEs it in one; a small put goes as `TcpTransport`'s do, in
frames over the Unix socket (one request instead of two). Both are `PoolBackend`s (local mode) and the
cluster's connections to its workers. Socket failures are PoolUnavailable / PoolTimeout. Every
block's checksum is verified: a put damaged on its way is refused by the worker (CorruptBlock,
nothing stored); a get damaged on its way is a miss, counted in `checksum_failures` and logged, the
same as a block found corrupt at rest.
"""
from __future__ import annotations

import functools
import logging
import mmap
import socket
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from typing import Any

import numpy as np

from . import protocol as P
from .arena_pages import ArenaPages
from .blocks import checksum
from .buffers import Destination, destination_views, destinations, finish_all, readable_all
from .connection import Busy, Connection, max_block_of, put_outcome, refuse_too_large, send_pin
from .errors import BufferSizeError, PoolUnavailable, ProtocolError
from .fastcopy import copy_from, writable_all
from .pool_backend import leases_by_copy
from .shm_put import PartedPut, SpareSlots
from .shm_refs import committed, recording_now
from .sparse_log import SparseLog
from .tiers.dram import DramArena
from .versions import CLOCK

__all__ = ["TcpTransport", "ShmTransport", "connect"]

log = logging.getLogger("kvpool.transport")
_CORRUPT_LOG = SparseLog(log)
"""Blocks that arrived corrupt (a flaky link): a warning a minute at most, not one per block per call."""

_FRAME_BYTES = 4 << 20
"""A TCP put sends its batch in frames of a quarter of it, at most this many bytes ..."""
_MIN_FRAME_BYTES = 512 << 10
"""... and at least this many (each frame costs the worker a request: 64 KiB blocks, frames of 1 MiB)."""
_FRAMES_IN_FLIGHT = 8
"""PUT frames sent before their replies are read (each reply is a byte per block)."""
SOCKET_PUT_BYTES = 128 << 10
"""A same-node put of at most this many bytes goes in PUT frames over the Unix socket, as a TCP put does:
one request, whose bytes the worker receives and hashes, where the arena's way takes two (the COMMIT,
and the ALLOC of the next put's slots, whose answer the next put waits for). Here (a put in a loop,
median): 1 x 16 KiB 241 -> 179 µs, 1 x 64 KiB 252 -> 203, 2 x 64 KiB 280 -> 221, 8 x 16 KiB 291 -> 250;
at 256 KiB the arena's way is faster (4 x 64 KiB 273 against 375). Not while someone records where puts
lie (`shm_refs.recording`): only the arena's way has a place to tell. (Gets stay in the arena: a GET
frame was no faster at 16-64 KiB and slower above.)"""
_SPLIT_LEASE = range(8, 1025)
"""A same-node get of so many blocks LEASEs them in two requests (see `_get_frame`); more would risk both
sides blocking on full socket buffers, the second request's keys one way and the first's reply the other."""


class TcpTransport(Connection):
    """Blocks over TCP frames (any node)."""

    def put_as_of(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float,
                  versions: Sequence[int] | None) -> list[int]:
        """`Connection.put_as_of`: the batch goes in frames of a few MiB sent back to back (at most
        `_FRAMES_IN_FLIGHT` unanswered): the worker receives, hashes and commits one while the next is
        hashed and sent. A block the worker refuses fails alone; the error raised is the first failed
        block's."""
        views = readable_all(buffers)
        status = self._put_statuses(keys, views, pin_s, versions)
        return put_outcome(status, keys, [v.nbytes for v in views], max_block_of(self.info))

    def put_statuses(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float,
                     versions: Sequence[int] | None) -> list[int]:
        """`Connection.put_statuses`, as `put_as_of` puts."""
        return self._put_statuses(keys, readable_all(buffers), pin_s, versions)

    def _put_statuses(self, keys: Sequence[bytes], views: Sequence[memoryview], pin_s: float,
                      versions: Sequence[int] | None) -> list[int]:
        """`put_statuses` of the buffers' byte views (`readable_all`), through the socket."""
        lens = [v.nbytes for v in views]
        refuse_too_large(keys, lens, self.max_block)
        stamps = _stamps(versions, len(keys))
        status: list[int] = []
        with self._session() as sock:
            unanswered: deque[int] = deque()  # blocks of each frame sent and not answered yet
            for f in P.frames(len(keys), lens, min(_FRAME_BYTES, max(_MIN_FRAME_BYTES, sum(lens) // 4))):
                if pin_s > 0:
                    send_pin(sock, keys[f], pin_s)
                self._send_put(sock, keys[f], views[f], stamps[f])
                unanswered.append(f.stop - f.start)
                if len(unanswered) > _FRAMES_IN_FLIGHT:
                    status += self._put_reply(sock, unanswered.popleft())
            while unanswered:
                status += self._put_reply(sock, unanswered.popleft())
        return status

    @staticmethod
    def _send_put(sock: Any, keys: Sequence[bytes], views: Sequence[memoryview], versions: np.ndarray) -> None:
        sizes = np.array([v.nbytes for v in views], dtype="<i8")
        csums = np.array([checksum(v) for v in views], dtype="<u8")
        P.send_frame(sock, P.Op.PUT, P.pack_batch(list(keys), sizes, csums, versions), data=list(views))

    @staticmethod
    def _put_reply(sock: Any, n: int) -> list[int]:
        """The statuses of a PUT frame of `n` blocks."""
        meta = P.recv_reply(sock, P.Op.PUT).meta
        if len(meta) != n:
            raise ProtocolError(f"PUT reply of {len(meta)} statuses for {n} blocks")
        status: list[int] = np.frombuffer(meta, dtype="<i1").tolist()
        return status

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        """Sizes (-1 on a miss or a corrupt block); bytes land directly in the buffers."""
        return self.batch_get_versions_into(keys, buffers)[0]

    def batch_get_versions_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> tuple[list[int], list[int]]:
        """`batch_get_into`, and each key's version as the worker knows it (a miss: its removal's, or 0)."""
        dests = destinations(buffers)
        sizes: list[int] = []
        versions: list[int] = []
        for f in P.frames(len(keys), [d.nbytes for d in dests]):  # (a reply is as large as its buffers at most)
            sizes += self._get_sent(keys[f], dests[f], versions)
        return sizes, _observed(versions)

    def _get_sent(self, keys: Sequence[bytes], dests: Sequence[Destination], versions: list[int]) -> list[int]:
        """GET a frame's blocks: the worker sends their bytes on the connection."""
        too_small: tuple[bytes, int, int] | None = None
        out: list[int] = []
        with self._session() as sock:
            P.send_frame(sock, P.Op.GET, P.pack_batch(list(keys)))
            reply = P.recv_reply(sock, P.Op.GET)
            n = len(keys)
            if len(reply.meta) != 24 * n:
                raise ProtocolError(f"GET reply metadata is {len(reply.meta)} bytes for {n} keys")
            sizes = np.frombuffer(reply.meta, dtype="<i8", count=n).tolist()
            if sum(s for s in sizes if s > 0) != reply.data_len:  # else the next reply is read out of step
                raise ProtocolError(f"GET reply of {reply.data_len} data bytes for blocks of {sizes} bytes")
            csums = np.frombuffer(reply.meta, dtype="<u8", count=n, offset=8 * n).tolist()
            versions += np.frombuffer(reply.meta, dtype="<u8", count=n, offset=16 * n).tolist()
            # Each block lands in its destination; one too large for it is read whole, then dropped. They are
            # received a group at a time and hashed while the group is still in cache.
            parts: list[memoryview | int] = []
            for key, size, dest in zip(keys, sizes, dests):
                if size > dest.nbytes:
                    parts.append(size)
                    too_small = too_small or (key, size, dest.nbytes)
                elif size >= 0:
                    parts.append(dest.view[:size])
            sums = iter(P.recv_blocks(sock, parts))
            for key, size, csum in zip(keys, sizes, csums):
                got = None if size < 0 else next(sums)
                if got is None:
                    out.append(-1)
                elif got == csum:
                    out.append(size)
                else:
                    out.append(-1)
                    self.checksum_failures += 1
                    _CORRUPT_LOG.log("block %r from worker %s failed its checksum; served as a miss", key[:24],
                                     self.address)
        if too_small:
            key, size, room = too_small
            raise BufferSizeError(f"block {key[:24]!r} is {size} bytes; the destination holds {room}",
                                  key=key, size=size, limit=room)
        finish_all(dests, out)
        return out

    def batch_lease(self, keys: Sequence[bytes]) -> AbstractContextManager[list[memoryview | None]]:
        """Copies: this process does not share the worker's memory."""
        return leases_by_copy(self, keys)


class ShmTransport(TcpTransport):
    """Blocks through the worker's shared-memory arena (same node); control over a Unix socket. A small
    put goes as a TCP transport's does, its bytes through the Unix socket (`SOCKET_PUT_BYTES`)."""

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 5.0, *, spin: bool = True) -> None:
        super().__init__(address, token, timeout_s, spin=spin)
        self._arena: memoryview | None = None
        self._arena_rw: memoryview | None = None
        self._pages: ArenaPages | None = None
        self._pages_rw: ArenaPages | None = None
        self._spare = SpareSlots()
        """Slots reserved for the next put of the last one's shape (`kvpool.core.shm_put`)."""
        self._leased = (0, 0)  # (connection generation, leases held on it): `batch_lease` keeps to MAX_LEASES
        self._leased_lock = threading.Lock()

    @contextmanager
    def _session(self, generation: int | None = None, *, idle: bool = False) -> Iterator[socket.socket]:
        """`Connection._session`, the answer a put left unread read first (`SpareSlots`); with `idle`,
        `Busy` while one is unread (reading it may wait on the worker)."""
        with super()._session(generation, idle=idle) as sock:
            if idle and self._spare.unread:
                raise Busy(f"an answer of worker {self.address} is still to be read")
            self._spare.read_answer(sock, self.generation)
            yield sock

    @property
    def arena(self) -> memoryview:
        """The worker's arena mapped read-only: what gets and leases read."""
        with self._session():
            return self._mapped(writable=False)[0]

    @property
    def writable_arena(self) -> memoryview:
        """The arena mapped read-write, made at the first put: a writer copies into the slots it
        ALLOCs (the worker checks each block's checksum before it commits it)."""
        with self._session():
            return self._mapped(writable=True)[0]

    @contextmanager
    def held(self, generation: int | None = None) -> Iterator[tuple[socket.socket, memoryview, ArenaPages]]:
        """The connection, the arena mapped read-write and its pages, held for a run of requests of
        the caller's own (`kvpool.core.shm_stage.Stager`); failures as any exchange's. `generation`:
        only that connection (`_session`)."""
        with self._session(generation) as sock:
            yield sock, *self._mapped(writable=True)

    @contextmanager
    def copying(self, sock: socket.socket) -> Iterator[None]:
        """Hold off `close` and `abort` (from other threads) while this call copies into slots it reserved
        on `sock`, its session's connection: the worker frees a closed connection's reserved slots and may
        give them to another writer at once, so no copy may land after the close. PoolUnavailable if the
        connection closed already. Keep the copy short (a part): a close waits for it."""
        with self._gate:
            if self._sock is not sock or self._aborted:
                raise PoolUnavailable(f"the connection to worker {self.address} was closed during the put: "
                                      "the slots it reserved are the worker's again")
            yield

    def _mapped(self, writable: bool) -> tuple[memoryview, ArenaPages]:
        """The arena mapping (made at first use) and its pages. Called within a session (connected, so
        `info` is known; the connection's lock held, so that `close` in another thread cannot release
        the mapping while the call copies through it); a failure to map is the worker's, typed."""
        # (read once into locals: `close` in another thread clears the fields without the lock)
        arena, pages = (self._arena_rw, self._pages_rw) if writable else (self._arena, self._pages)
        if arena is None or pages is None:
            arena = DramArena.attach(self.info.arena, self.info.arena_size, writable)
            pages = ArenaPages(arena, writable=writable, background=True)
            if writable:
                self._arena_rw, self._pages_rw = arena, pages
            else:
                self._arena, self._pages = arena, pages
        return arena, pages

    def _put_statuses(self, keys: Sequence[bytes], views: Sequence[memoryview], pin_s: float,
                      versions: Sequence[int] | None) -> list[int]:
        """`put_statuses` (and so `put_as_of`): a batch larger than the worker lets one connection reserve
        at once goes in several rounds; one of at most `SOCKET_PUT_BYTES` through the socket."""
        lens = [v.nbytes for v in views]
        if sum(lens) <= SOCKET_PUT_BYTES and not recording_now():
            if self._spare.pending:  # slots a run of arena puts kept: this put will not use them
                with self._session() as sock:
                    self._spare.give_back(sock, self.generation)
            return super()._put_statuses(keys, views, pin_s, versions)
        stamps = _stamps(versions, len(keys))
        status: list[int] = []
        with self._session() as sock:  # one exchange for the batch (a session is ~10 µs of Python)
            info = self.info
            refuse_too_large(keys, lens, max_block_of(info))
            for f in P.frames(len(keys), lens, info.max_reserve or P.MAX_DATA, P.RESERVE_FLOOR):
                status += self._put_frame(sock, keys[f], views[f], pin_s, stamps[f])
                if P.ITEM_FULL in status:  # no room: the rest is not tried (its blocks are not stored either)
                    return status + [P.ITEM_FULL] * (len(keys) - f.stop)
        return status

    def _put_frame(self, sock: socket.socket, keys: Sequence[bytes], views: Sequence[memoryview], pin_s: float,
                   versions: np.ndarray) -> list[int]:
        """Copy the frame's blocks into slots of the arena part by part (`kvpool.core.shm_put`); each
        block's item status. Within a session, on its connection `sock` (where a frame before this one
        may have asked for slots: their answer is read first)."""
        self._spare.read_answer(sock, self.generation)
        arena, pages = self._mapped(writable=True)
        if pin_s > 0:
            send_pin(sock, keys, pin_s)
        put = PartedPut(sock, arena, pages, keys, views, versions, functools.partial(self.copying, sock))
        try:
            offsets = put.run(self._spare.take(sock, self.generation, put.sizes),
                              functools.partial(self._spare.ask, sock, self.generation, keys, put.sizes))
        except BaseException:
            self.close()  # replies may be unread; the worker frees the slots of a closed connection
            raise
        status = put.status
        sizes = put.sizes
        if status.any():  # (ITEM_OK is 0: every block stored is the usual batch) not stored: they lie nowhere
            kept = (status == P.ITEM_OK) | (status == P.ITEM_STORAGE)
            keys, offsets, sizes, versions = [k for k, ok in zip(keys, kept.tolist()) if ok], offsets[kept], \
                sizes[kept], versions[kept]
        committed(self.info, keys, offsets, sizes, versions)  # where they lie, for whoever records it
        out: list[int] = status.tolist()  # (ints: an int8 array's items)
        return out

    @contextmanager
    def batch_lease(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        """Read-only views straight into the arena (zero copy), valid until the block exits; past the
        `MAX_LEASES` a connection may hold, copies (each frame leased, copied and released at once)."""
        room = max(0, P.MAX_LEASES - self._leases_held(self.generation))  # (other calls' leases count too)
        held, rest = keys[:room], keys[room:]
        copied: list[memoryview | None] = []
        for f in P.frames(len(rest)):  # (first: while the others are held, no lease is left to take)
            with self._lease_frame(rest[f]) as leased:
                copied += [None if v is None else memoryview(v.tobytes()) for v in leased]
        with ExitStack() as stack:
            leased = [view for f in P.frames(len(held)) for view in stack.enter_context(self._lease_frame(held[f]))]
            yield leased + copied

    @contextmanager
    def _lease_frame(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        """Lease the blocks of `keys`: a view of each in the read-only mapping (None: a miss), until the
        block exits. The worker verified each block's checksum at commit.

        Leases live as long as the connection they were taken on: if it closed meanwhile (a timeout or
        a lost worker, in any thread using this transport), the worker has ended them and their slots
        may hold other blocks since; the block then raises PoolUnavailable as it exits normally (the
        views may have changed under the caller), and sends no RELEASE (lease ids are the connection's,
        and the next connection's leases may carry the same ones)."""
        with self._session() as sock:  # a malformed reply drops the connection (PoolUnavailable), as any protocol error
            arena, pages = self._mapped(writable=False)
            P.send_frame(sock, P.Op.LEASE, P.pack_batch(list(keys)))
            ids, offsets, sizes, versions = self._lease_reply(sock, len(keys), pages)
            _observed(versions.tolist())
            views = [None if off < 0 else arena[off:off + size] for off, size in zip(offsets.tolist(), sizes.tolist())]
            generation = self.generation
        held = ids[offsets >= 0]
        self._count_leases(generation, held.size)
        try:
            yield views
        except BaseException:
            with suppress(PoolUnavailable):  # the caller's error is the one to raise
                self._release(held, generation)
            raise
        finally:
            _let_go(views)
            self._count_leases(generation, -held.size)
        self._release(held, generation)

    def _count_leases(self, generation: int, n: int) -> None:
        """Count `n` leases more (or fewer) on connection `generation`; those of a connection older than
        the one counted ended with it, and change nothing (a lease held across a reconnect had reset the
        newer connection's count)."""
        with self._leased_lock:
            gen, held = self._leased
            if generation == gen:
                self._leased = (gen, held + n)
            elif generation > gen:
                self._leased = (generation, n)

    def _leases_held(self, generation: int) -> int:
        """Leases this process holds on connection `generation` (none on another: they ended with theirs)."""
        gen, held = self._leased
        return held if gen == generation else 0

    def _lease_reply(self, sock: socket.socket, n: int, pages: ArenaPages) -> tuple[np.ndarray, ...]:
        """A LEASE reply's columns for `n` keys: lease ids, offsets, sizes (the arena readied where they
        lie) and versions (the reply also carries checksums, which a same-node reader does not need)."""
        meta = P.recv_reply(sock, P.Op.LEASE).meta
        if len(meta) != 40 * n:
            raise ProtocolError(f"LEASE reply metadata is {len(meta)} bytes for {n} keys")
        ids, offsets, sizes = (np.frombuffer(meta, dtype="<i8", count=n, offset=8 * n * j) for j in range(3))
        pages.ready(offsets, sizes)
        return ids, offsets, sizes, np.frombuffer(meta, dtype="<u8", count=n, offset=32 * n)  # (then checksums)

    def _release(self, ids: np.ndarray, generation: int) -> None:
        """End the leases `ids` taken on connection `generation`; PoolUnavailable if it has closed since."""
        if ids.size:
            with self._session(generation) as sock:
                P.send_frame(sock, P.Op.RELEASE, ids.tobytes())

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        return self.batch_get_versions_into(keys, buffers)[0]

    def batch_get_versions_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> tuple[list[int], list[int]]:
        """`batch_get_into`, and each key's version as the worker knows it (a miss: its removal's, or 0)."""
        views: Sequence[Any]
        if writable_all(buffers):  # the usual batch (numpy arrays, bytearrays): copied into as they are
            views, dests = buffers, None
        else:
            views, dests = destination_views(buffers)
        out: list[int] = []
        versions: list[int] = []
        for f in P.frames(len(keys)):
            out += self._get_frame(keys[f], views[f], versions)
        if dests is not None:
            finish_all(dests, out)
        return out, _observed(versions)

    def _get_frame(self, keys: Sequence[bytes], views: Sequence[Any], versions: list[int]) -> list[int]:
        """LEASE a frame's blocks in two requests sent back to back (a quarter of them, then the rest),
        copy each part out as its reply arrives (the first while the worker serves the second), and
        RELEASE them together."""
        n = len(keys)
        cut = n // 4 if n in _SPLIT_LEASE else n
        parts = [p for p in (slice(0, cut), slice(cut, n)) if p.stop > p.start]
        out: list[int] = []
        held: list[np.ndarray] = []
        too_small: BufferSizeError | None = None
        with self._session() as sock:
            arena, pages = self._mapped(writable=False)
            for p in parts:
                P.send_frame(sock, P.Op.LEASE, P.pack_batch(list(keys[p])))
            try:
                for p in parts:
                    ids, offsets, sizes, vers = self._lease_reply(sock, p.stop - p.start, pages)
                    held.append(ids[offsets >= 0])
                    versions += vers.tolist()
                    if too_small is None:
                        try:
                            out += _copy_out(arena, keys[p], offsets, sizes, views[p])
                        except BufferSizeError as e:  # the caller's error: the rest is read, the connection kept
                            too_small = e
            except BaseException:
                if len(held) < len(parts):
                    self.close()  # a reply is unread: the worker ends the leases of a closed connection
                    held = []
                raise
            finally:
                if held:
                    P.send_frame(sock, P.Op.RELEASE, np.concatenate(held).tobytes())
        if too_small is not None:
            raise too_small
        return out

    def close(self) -> None:
        """Close the connection and let go of the arena mappings: released at once, unless a call in
        another thread holds the connection, when each is unmapped as that call lets go of it (the call
        fails on the closed socket; a put copies nothing more: `copying`). A mapping that still backs a
        caller's leased view goes with the view."""
        super().close()
        self._spare.forget()
        mappings = (self._arena, self._arena_rw)
        readiers = (self._pages, self._pages_rw)
        self._arena = self._arena_rw = None
        self._pages = self._pages_rw = None
        for pages in readiers:
            if pages is not None:
                pages.close()  # no thread of ours touches a mapping from here on
        if not self._lock.acquire(blocking=False):
            return
        try:
            for view in mappings:
                if view is None:
                    continue
                mapping = view.obj  # the mmap DramArena.attach made
                view.release()
                try:
                    if isinstance(mapping, mmap.mmap):
                        mapping.close()
                except BufferError:
                    pass  # a caller still holds a leased view; the mapping goes when it does
        finally:
            self._lock.release()


def _let_go(views: list[memoryview | None]) -> None:
    """Release leased views as their lease ends: a caller that kept one gets a ValueError on its next
    use, never a slot the worker may have given to another block since (nor the mapping of an arena
    whose worker is gone). One the caller exported (a numpy array over it) stays: the export holds it."""
    for view in views:
        if view is not None:
            with suppress(BufferError):
                view.release()


def _copy_out(arena: memoryview, keys: Sequence[bytes], offsets: np.ndarray, sizes: np.ndarray,
              views: Sequence[Any]) -> list[int]:
    """Copy each leased block (offset < 0: a miss) from the arena into its view (a writable C-contiguous
    buffer); the sizes copied, -1 for each miss (the slots were checked against the arena as the reply
    came: `ArenaPages.ready`). A view too small for its block raises BufferSizeError."""
    short = copy_from(views, arena, offsets, sizes)
    if short >= 0:
        key, size, room = keys[short], int(sizes[short]), memoryview(views[short]).nbytes
        raise BufferSizeError(f"block {key[:24]!r} is {size} bytes; the destination holds {room}",
                              key=key, size=size, limit=room)
    copied: list[int] = np.where(offsets < 0, -1, sizes).tolist()
    return copied


def _stamps(versions: Sequence[int] | None, n: int) -> np.ndarray:
    """The versions a put sends: the caller's, else `n` stamped now."""
    return np.asarray(versions, dtype="<u8") if versions is not None else CLOCK.batch_array(n)


def _observed(versions: list[int]) -> list[int]:
    """`versions` read from a worker, merged into this process's clock first."""
    if versions:
        CLOCK.observe(max(versions))
    return versions


def connect(address: str, token: str | None = None, timeout_s: float = 5.0,
            tls_ca: str | None = None, *, spin: bool = True) -> TcpTransport | ShmTransport:
    """A transport to the worker at `address`: a Unix socket path (shared memory) or host:port (TCP;
    over TLS verified against the CA file `tls_ca`, else `KVPOOL_TLS_CA`, when either is set). `spin`:
    the socket's receives spin for the answers first (`kvpool.core.reply_spin`; not over TLS); a
    worker's own connections to its peers do not."""
    if address.startswith("/"):
        return ShmTransport(address, token, timeout_s, spin=spin)
    return TcpTransport(address, token, timeout_s, tls_ca, spin=spin)

"""Client side of the worker protocol: the two ways block bytes travel to and from one worker.

`TcpTransport` streams block bytes in frames and `recv_into`s replies straight into the caller's
buffers. `ShmTransport` maps the worker's arena and moves bytes with one memcpy each way, sending
only control messages (alloc/commit, lease/release) over the Unix socket. Both are `PoolBackend`s
(local mode) and the cluster's connections to its workers. Socket failures are PoolUnavailable /
PoolTimeout. Every block's checksum is verified: a put damaged on its way is refused by the worker
(CorruptBlock, nothing stored); a get damaged on its way is a miss, counted in `checksum_failures`
and logged, the same as a block found corrupt at rest.
"""
from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import numpy as np

from . import protocol as P
from .blocks import checksum
from .buffers import Destination, readable
from .connection import Connection, raise_item, send_pin
from .errors import BufferSizeError, ProtocolError
from .pool_backend import leases_by_copy
from .tiers.dram import DramArena

__all__ = ["TcpTransport", "ShmTransport", "connect"]

log = logging.getLogger("kvpool.transport")


class TcpTransport(Connection):
    """Blocks over TCP frames (any node)."""

    def batch_put(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float = 0.0) -> None:
        """Store blocks; with `pin_s` > 0, pinned for that many seconds (see `batch_pin`)."""
        views = [readable(b) for b in buffers]
        for f in P.frames(len(keys), [v.nbytes for v in views]):
            self._put_frame(keys[f], views[f], pin_s)

    def _put_frame(self, keys: Sequence[bytes], views: Sequence[memoryview], pin_s: float) -> None:
        sizes = np.array([v.nbytes for v in views], dtype="<i8")
        csums = np.array([checksum(v) for v in views], dtype="<u8")
        with self._session() as sock:
            if pin_s > 0:
                send_pin(sock, keys, pin_s)
            reply = self._roundtrip(P.Op.PUT, P.pack_batch(list(keys), sizes, csums), list(views))
        for key, st, size in zip(keys, np.frombuffer(reply.meta, dtype="<i1").tolist(), sizes.tolist()):
            raise_item(st, key, size, self.info.max_block)

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        """Sizes (-1 on a miss or a corrupt block); bytes land directly in the buffers."""
        dests = [Destination(b) for b in buffers]
        return [n for f in P.frames(len(keys)) for n in self._get_frame(keys[f], dests[f])]

    def _get_frame(self, keys: Sequence[bytes], dests: Sequence[Destination]) -> list[int]:
        too_small: tuple[bytes, int, int] | None = None
        out: list[int] = []
        with self._session() as sock:
            P.send_frame(sock, P.Op.GET, P.pack_batch(list(keys)))
            reply = P.recv_frame(sock)
            P.check_reply(reply, P.Op.GET)
            n = len(keys)
            if len(reply.meta) != 16 * n:
                raise ProtocolError(f"GET reply metadata is {len(reply.meta)} bytes for {n} keys")
            sizes = np.frombuffer(reply.meta, dtype="<i8", count=n).tolist()
            csums = np.frombuffer(reply.meta, dtype="<u8", count=n, offset=8 * n).tolist()
            scratch: bytearray | None = None
            for key, size, csum, dest in zip(keys, sizes, csums, dests):
                if size < 0:
                    out.append(-1)
                    continue
                if size > dest.nbytes:
                    scratch = scratch if scratch is not None and len(scratch) >= size else bytearray(size)
                    P.recv_exactly(sock, memoryview(scratch)[:size])
                    too_small = too_small or (key, size, dest.nbytes)
                    out.append(-1)
                    continue
                view = dest.view[:size]
                P.recv_exactly(sock, view)
                if checksum(view) == csum:
                    out.append(size)
                else:
                    out.append(-1)
                    self.checksum_failures += 1
                    log.warning("block %r from worker %s failed its checksum; served as a miss", key[:24], self.address)
        if too_small:
            key, size, room = too_small
            raise BufferSizeError(f"block {key[:24]!r} is {size} bytes; the destination holds {room}",
                                  key=key, size=size, limit=room)
        for size, dest in zip(out, dests):
            dest.finish(size)
        return out

    def batch_lease(self, keys: Sequence[bytes]) -> AbstractContextManager[list[memoryview | None]]:
        """Copies: this process does not share the worker's memory."""
        return leases_by_copy(self, keys)


class ShmTransport(Connection):
    """Blocks through the worker's shared-memory arena (same node); control over a Unix socket."""

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 5.0) -> None:
        super().__init__(address, token, timeout_s)
        self._arena: memoryview | None = None
        self._arena_rw: memoryview | None = None

    @property
    def arena(self) -> memoryview:
        """The worker's arena mapped read-only: what gets and leases read."""
        if self._arena is None:
            self._arena = self._attach(writable=False)
        return self._arena

    @property
    def writable_arena(self) -> memoryview:
        """The arena mapped read-write, made at the first put: a writer copies into the slots it
        ALLOCs (the worker checks each block's checksum before it commits it)."""
        if self._arena_rw is None:
            self._arena_rw = self._attach(writable=True)
        return self._arena_rw

    def _attach(self, writable: bool) -> memoryview:
        with self._session():  # connecting fills self.info; a failure to map is the worker's, typed
            return DramArena.attach(self.info.arena, self.info.arena_size, writable)

    def batch_put(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float = 0.0) -> None:
        """Store blocks; with `pin_s` > 0, pinned for that many seconds (see `batch_pin`). A batch
        larger than the worker lets one connection reserve at once goes in several rounds."""
        views = [readable(b) for b in buffers]
        arena = self.writable_arena  # connects, so `info` is known
        budget = self.info.max_reserve or P.MAX_DATA
        for f in P.frames(len(keys), [v.nbytes for v in views], budget):
            self._put_frame(arena, keys[f], views[f], pin_s)

    def _put_frame(self, arena: memoryview, keys: Sequence[bytes], views: Sequence[memoryview], pin_s: float) -> None:
        sizes = np.array([v.nbytes for v in views], dtype="<i8")
        with self._session() as sock:
            if pin_s > 0:
                send_pin(sock, keys, pin_s)
            offsets = np.frombuffer(self._roundtrip(P.Op.ALLOC, P.pack_batch(list(keys), sizes)).meta, dtype="<i8")
            if (offsets < 0).any():
                held = offsets[offsets >= 0]
                if held.size:
                    P.send_frame(sock, P.Op.ABORT, held.tobytes())
                i = int(np.argmax(offsets < 0))
                raise_item(int(offsets[i]), keys[i], int(sizes[i]), self.info.max_block)
            csums = np.empty(len(keys), dtype="<u8")
            for i, (off, v) in enumerate(zip(offsets.tolist(), views)):
                slot = arena[off:off + v.nbytes]
                slot[:] = v
                csums[i] = checksum(slot)  # of what landed in the arena, while it is in cache
            reply = self._roundtrip(P.Op.COMMIT, P.pack_batch(list(keys), offsets, sizes, csums))
        for key, st, size in zip(keys, np.frombuffer(reply.meta, dtype="<i1").tolist(), sizes.tolist()):
            raise_item(st, key, size, self.info.max_block)

    @contextmanager
    def batch_lease(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        """Read-only views straight into the arena (zero copy), valid until the block exits."""
        with ExitStack() as stack:
            yield [v for f in P.frames(len(keys)) for v in stack.enter_context(self._lease_frame(keys[f]))]

    @contextmanager
    def _lease_frame(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        arena = self.arena
        n = len(keys)
        with self._session():  # a malformed reply drops the connection (PoolUnavailable), as any protocol error
            meta = self._roundtrip(P.Op.LEASE, P.pack_batch(list(keys))).meta
            if len(meta) != 32 * n:
                raise ProtocolError(f"LEASE reply metadata is {len(meta)} bytes for {n} keys")
        ids, offsets, sizes = (np.frombuffer(meta, dtype=dt, count=n, offset=8 * n * j)
                                      for j, dt in enumerate(("<i8", "<i8", "<i8")))
        # the worker verified each block's checksum at commit; this mapping is read-only
        views = [None if off < 0 else arena[off:off + size].toreadonly()
                 for off, size in zip(offsets.tolist(), sizes.tolist())]
        try:
            yield views
        finally:
            held = ids[offsets >= 0]
            if held.size:
                with self._session() as sock:
                    P.send_frame(sock, P.Op.RELEASE, held.tobytes())

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        dests = [Destination(b) for b in buffers]
        out: list[int] = []
        with self.batch_lease(keys) as views:
            for key, view, dest in zip(keys, views, dests):
                if view is None:
                    out.append(-1)
                    continue
                if view.nbytes > dest.nbytes:
                    raise BufferSizeError(f"block {key[:24]!r} is {view.nbytes} bytes; the destination holds "
                                          f"{dest.nbytes}", key=key, size=view.nbytes, limit=dest.nbytes)
                dest.view[:view.nbytes] = view
                out.append(view.nbytes)
        for size, dest in zip(out, dests):
            dest.finish(size)
        return out

    def close(self) -> None:
        super().close()
        for name in ("_arena", "_arena_rw"):
            view: memoryview | None = getattr(self, name)
            if view is None:
                continue
            mapping = view.obj  # the mmap DramArena.attach made
            view.release()
            setattr(self, name, None)
            try:
                if isinstance(mapping, mmap.mmap):
                    mapping.close()
            except BufferError:
                pass  # a caller still holds a leased view; the mapping goes when it does


def connect(address: str, token: str | None = None, timeout_s: float = 5.0) -> TcpTransport | ShmTransport:
    """A transport to the worker at `address`: a Unix socket path (shared memory) or host:port (TCP)."""
    cls = ShmTransport if address.startswith("/") else TcpTransport
    return cls(address, token, timeout_s)

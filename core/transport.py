"""Client side of the worker protocol: one connection to one worker, over TCP or shared memory.

`TcpTransport` streams block bytes in frames and `recv_into`s replies straight into the caller's
buffers. `ShmTransport` maps the worker's arena and moves bytes with one memcpy each way, sending
only control messages (alloc/commit, lease/release) over the Unix socket. Both verify every block's
checksum and map socket failures to PoolUnavailable / PoolTimeout.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from . import protocol as P
from .blocks import checksum
from .buffers import Destination
from .errors import (AuthError, BlockTooLarge, BufferSizeError, CapacityError, KVPoolError, PoolTimeout,
                     PoolUnavailable, ProtocolError)
from .tiers.dram import DramArena

log = logging.getLogger("kvpool.transport")


class _Connection:
    """A socket to one worker, one request at a time, reconnecting after a failure."""

    def __init__(self, address: str, token: str | None = None, timeout: float = 5.0) -> None:
        self.address = address
        self.token = token
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.info: dict[str, Any] = {}
        self.checksum_failures = 0
        """Blocks received from this worker whose bytes failed their checksum (each served as a miss)."""

    def _connect(self) -> socket.socket:
        try:
            if self.address.startswith("/"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.timeout)
                    sock.connect(self.address)
                except OSError:
                    sock.close()
                    raise
            else:
                host, _, port = self.address.rpartition(":")
                sock = socket.create_connection((host, int(port)), timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise PoolUnavailable(f"cannot connect to worker {self.address}: {e}") from e
        self._sock = sock
        self.info = P.unpack_json(self._roundtrip(P.Op.HELLO).meta)
        if self.info.get("auth") and not self.address.startswith("/"):
            if not self.token:
                self.close()
                raise KVPoolError(f"worker {self.address} requires a token (KVPOOL_TOKEN)") from None
            self._roundtrip(P.Op.AUTH, P.pack_json({"token": self.token}))
        return sock

    @contextmanager
    def _session(self) -> Iterator[socket.socket]:
        """Hold the connection for one exchange; any transport failure drops it and is typed."""
        with self._lock:
            try:
                yield self._sock or self._connect()
            except (AuthError, BufferSizeError, PoolUnavailable):
                self.close()
                raise
            except socket.timeout as e:
                self.close()
                raise PoolTimeout(f"worker {self.address} did not answer within {self.timeout} s") from e
            except (ConnectionError, OSError, ProtocolError) as e:
                self.close()
                raise PoolUnavailable(f"worker {self.address}: {e}") from e

    def _roundtrip(self, op: int, meta: bytes = b"", data: list[memoryview] | None = None) -> P.Frame:
        assert self._sock is not None
        P.send_frame(self._sock, op, meta, data=data)
        reply = P.recv_frame(self._sock)
        P.check_reply(reply, op)
        return reply

    def call(self, op: int, meta: bytes = b"") -> P.Frame:
        with self._session():
            return self._roundtrip(op, meta)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    # ----- operations common to both transports ----------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for f in P.frames(len(keys)):
            reply = self.call(P.Op.EXISTS, P.pack_batch(list(keys[f])))
            out += [bool(x) for x in np.frombuffer(reply.meta, dtype="<u1")]
        return out

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        total = 0
        for f in P.frames(len(keys)):
            n = int(P.unpack_json(self.call(P.Op.PREFIX, P.pack_batch(list(keys[f]))).meta)["n"])
            total += n
            if n < f.stop - f.start:
                break
        return total

    def remove(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for f in P.frames(len(keys)):
            reply = self.call(P.Op.REMOVE, P.pack_batch(list(keys[f])))
            out += [bool(x) for x in np.frombuffer(reply.meta, dtype="<u1")]
        return out

    def clear(self, prefix: bytes | None = None) -> None:
        self.call(P.Op.CLEAR, P.pack_batch([prefix]) if prefix is not None else b"")

    def pin(self, keys: Sequence[bytes], seconds: float) -> None:
        """Pin blocks for `seconds` (<= 0: unpin). One way: nothing waits for the worker."""
        with self._session() as sock:
            for f in P.frames(len(keys)):
                _send_pin(sock, keys[f], seconds)

    def stats(self) -> dict[str, Any]:
        return dict(P.unpack_json(self.call(P.Op.STATS).meta))


def _raise_item(status: int, key: bytes, size: int, max_block: int) -> None:
    if status == P.ITEM_TOO_LARGE:
        raise BlockTooLarge(f"block {key[:24]!r} is {size} bytes; the worker's max block is {max_block}")
    if status == P.ITEM_FULL:
        raise CapacityError(f"worker has no room for block {key[:24]!r} ({size} bytes)")
    if status == P.ITEM_CORRUPT:
        raise PoolUnavailable(f"block {key[:24]!r} arrived corrupt at the worker (checksum mismatch)")


def _send_pin(sock: socket.socket, keys: Sequence[bytes], seconds: float) -> None:
    """A PIN frame; the worker handles a connection's frames in order, so a put sent after it on the
    same connection commits its blocks pinned."""
    P.send_frame(sock, P.Op.PIN, P.pack_batch(list(keys), np.full(len(keys), seconds, dtype="<f8")))


class TcpTransport(_Connection):
    """Blocks over TCP frames (any node)."""

    def put_many(self, keys: Sequence[bytes], views: Sequence[memoryview], pin_s: float = 0.0) -> None:
        """Store blocks; with `pin_s` > 0, pinned for that many seconds (see `pin`)."""
        for f in P.frames(len(keys), [v.nbytes for v in views]):
            self._put_frame(keys[f], views[f], pin_s)

    def _put_frame(self, keys: Sequence[bytes], views: Sequence[memoryview], pin_s: float) -> None:
        sizes = np.array([v.nbytes for v in views], dtype="<i8")
        csums = np.array([checksum(v) for v in views], dtype="<u8")
        with self._session() as sock:
            if pin_s > 0:
                _send_pin(sock, keys, pin_s)
            reply = self._roundtrip(P.Op.PUT, P.pack_batch(list(keys), sizes, csums), list(views))
        for key, st, size in zip(keys, np.frombuffer(reply.meta, dtype="<i1").tolist(), sizes.tolist()):
            _raise_item(st, key, size, self.info.get("max_block", 0))

    def get_into_many(self, keys: Sequence[bytes], dests: Sequence[Destination]) -> list[int]:
        """Sizes (-1 on a miss or a corrupt block); bytes land directly in `dests`."""
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
            raise BufferSizeError(f"block {too_small[0][:24]!r} is {too_small[1]} bytes; the destination holds {too_small[2]}")
        for size, dest in zip(out, dests):
            dest.finish(size)
        return out


class ShmTransport(_Connection):
    """Blocks through the worker's shared-memory arena (same node); control over a Unix socket."""

    def __init__(self, address: str, token: str | None = None, timeout: float = 5.0) -> None:
        super().__init__(address, token, timeout)
        self._arena: memoryview | None = None

    @property
    def arena(self) -> memoryview:
        if self._arena is None:
            with self._session():  # connecting fills self.info; a failure to map is the worker's, typed
                if self._arena is None:
                    self._arena = DramArena.attach(self.info["arena"], int(self.info["arena_size"]))
        return self._arena

    def put_many(self, keys: Sequence[bytes], views: Sequence[memoryview], pin_s: float = 0.0) -> None:
        """Store blocks; with `pin_s` > 0, pinned for that many seconds (see `pin`). A batch larger
        than the worker lets one connection reserve at once goes in several rounds."""
        arena = self.arena  # connects, so `info` is known
        budget = int(self.info.get("max_reserve") or P.MAX_DATA)
        for f in P.frames(len(keys), [v.nbytes for v in views], budget):
            self._put_frame(arena, keys[f], views[f], pin_s)

    def _put_frame(self, arena: memoryview, keys: Sequence[bytes], views: Sequence[memoryview], pin_s: float) -> None:
        sizes = np.array([v.nbytes for v in views], dtype="<i8")
        with self._session() as sock:
            if pin_s > 0:
                _send_pin(sock, keys, pin_s)
            offsets = np.frombuffer(self._roundtrip(P.Op.ALLOC, P.pack_batch(list(keys), sizes)).meta, dtype="<i8")
            if (offsets < 0).any():
                held = offsets[offsets >= 0]
                if held.size:
                    P.send_frame(self._sock, P.Op.ABORT, held.tobytes())  # type: ignore[arg-type]
                i = int(np.argmax(offsets < 0))
                _raise_item(int(offsets[i]), keys[i], int(sizes[i]), self.info.get("max_block", 0))
            csums = np.empty(len(keys), dtype="<u8")
            for i, (off, v) in enumerate(zip(offsets.tolist(), views)):
                slot = arena[off:off + v.nbytes]
                slot[:] = v
                csums[i] = checksum(slot)  # of what landed in the arena, while it is in cache
            reply = self._roundtrip(P.Op.COMMIT, P.pack_batch(list(keys), offsets, sizes, csums))
        for key, st, size in zip(keys, np.frombuffer(reply.meta, dtype="<i1").tolist(), sizes.tolist()):
            _raise_item(st, key, size, self.info.get("max_block", 0))

    @contextmanager
    def lease(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        """Read-only views straight into the arena (zero copy), valid until the block exits."""
        with ExitStack() as stack:
            yield [v for f in P.frames(len(keys)) for v in stack.enter_context(self._lease_frame(keys[f]))]

    @contextmanager
    def _lease_frame(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        arena = self.arena
        with self._session():
            meta = self._roundtrip(P.Op.LEASE, P.pack_batch(list(keys))).meta
        n = len(keys)
        if len(meta) != 32 * n:
            raise PoolUnavailable(f"LEASE reply metadata is {len(meta)} bytes for {n} keys")
        ids, offsets, sizes = (np.frombuffer(meta, dtype=dt, count=n, offset=8 * n * j)
                                      for j, dt in enumerate(("<i8", "<i8", "<i8")))
        # the worker verified each block's checksum at commit; the arena is this node's own memory
        views = [None if off < 0 else arena[off:off + size].toreadonly()
                 for off, size in zip(offsets.tolist(), sizes.tolist())]
        try:
            yield views
        finally:
            held = ids[offsets >= 0]
            if held.size:
                with self._session() as sock:
                    P.send_frame(sock, P.Op.RELEASE, held.tobytes())

    def get_into_many(self, keys: Sequence[bytes], dests: Sequence[Destination]) -> list[int]:
        out: list[int] = []
        with self.lease(keys) as views:
            for key, view, dest in zip(keys, views, dests):
                if view is None:
                    out.append(-1)
                    continue
                if view.nbytes > dest.nbytes:
                    raise BufferSizeError(f"block {key[:24]!r} is {view.nbytes} bytes; the destination holds {dest.nbytes}")
                dest.view[:view.nbytes] = view
                out.append(view.nbytes)
        for size, dest in zip(out, dests):
            dest.finish(size)
        return out

    def close(self) -> None:
        super().close()
        if self._arena is not None:
            mapping = self._arena.obj
            self._arena.release()
            self._arena = None
            try:
                mapping.close()  # type: ignore[union-attr]
            except BufferError:
                pass  # a caller still holds a leased view; the mapping goes when it does


def connect(address: str, token: str | None = None, timeout: float = 5.0) -> TcpTransport | ShmTransport:
    """A transport to the worker at `address`: a Unix socket path (shared memory) or host:port (TCP)."""
    return ShmTransport(address, token, timeout) if address.startswith("/") else TcpTransport(address, token, timeout)

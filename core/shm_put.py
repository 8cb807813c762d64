"""A same-node put of one frame: its blocks copied into the worker's arena part by part.

The client asks for each part's slots (ALLOC) one part ahead, copies and hashes the part into them
and sends its COMMIT without waiting: the worker reserves the next part's slots and verifies and
commits the previous part while this one is copied, so on two cores the put costs about the copy
(plus one part's reservation at the start and one part's commit at the end). Replies come back in
the order the requests went, and are read as the slots they carry are needed, the rest at the end.

A part the worker refuses (a block whose bytes do not match its checksum: CorruptBlock; no room:
CapacityError) fails its own blocks only; the others of the batch are stored. The error raised is
that of the batch's first failed block.

A put of a frame of at most `SPARE_BYTES` that follows one of the same block sizes within `RUN_S` also
asks, as it ends, for the slots of a next put of that shape (`SpareSlots`), without waiting for the
answer: the connection's next exchange reads it, and the next put of that shape copies its first part
at once instead of waiting for an ALLOC (batches of 64 x 16 KiB: the first part's wait was ~115 of a
put's ~620 µs; `kvpool bench transport`'s 16 KiB puts went 0.23-0.25 -> 0.26-0.27 of memcpy, its 64 KiB
ones, where the worker's hashing and commits bound the put, not at all). A put of another shape gives
them back first.
"""
from __future__ import annotations

import select
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import numpy as np

from . import protocol as P
from .arena_pages import ArenaPages
from .errors import ProtocolError
from .fastcopy import copy_into

__all__ = ["PART_BYTES", "MIN_PART_BYTES", "PARTS_PER_ALLOC", "SPARE_BYTES", "alloc_chunks", "part_slices",
           "PartedPut", "SpareSlots", "recv_column", "still_open"]

PART_BYTES = 2 << 20
"""A part is a quarter of its batch, but at most this (well within the shared cache: the worker
verifies it while it is still there; 256 KiB blocks on a quiet 2-core machine: 0.37 of memcpy in one
part, 0.60 in parts of 2 MiB) ..."""
MIN_PART_BYTES = 512 << 10
"""... and at least this: a part costs both sides a message (batches of 64 blocks of 16 KiB, in two
parts: 0.25-0.26 of memcpy against 0.24 in four, three runs each; in one, 0.22)."""
PARTS_PER_ALLOC = 8
"""Parts whose slots one ALLOC asks for (after the first part's, asked alone)."""
SPARE_BYTES = 1 << 20
"""The largest frame whose put asks for the next put's slots as it ends (64 blocks of 16 KiB): what a
client keeps of the arena reserved between its puts, per connection ..."""
RUN_S = 0.05
"""... once its puts of one shape come in a run, each less than this after the one before."""


def part_slices(lens: Sequence[int], part_bytes: int) -> list[slice]:
    """Consecutive slices of the blocks of `lens`, each closed once it holds `part_bytes` or more."""
    out: list[slice] = []
    start = held = 0
    for i, n in enumerate(lens):
        held += n
        if held >= part_bytes:
            out.append(slice(start, i + 1))
            start, held = i + 1, 0
    if start < len(lens):
        out.append(slice(start, len(lens)))
    return out


def alloc_chunks(parts: list[slice]) -> list[slice]:
    """The block slices ALLOCated together: the first part alone (the put waits for its slots), then
    up to `PARTS_PER_ALLOC` parts at a time, asked for a chunk ahead."""
    out = parts[:1]
    for i in range(1, len(parts), PARTS_PER_ALLOC):
        group = parts[i:i + PARTS_PER_ALLOC]
        out.append(slice(group[0].start, group[-1].stop))
    return out


def recv_column(sock: socket.socket, op: int, n: int) -> np.ndarray:
    """The answer to an ALLOC (each block's offset; < 0: its item status) or a COMMIT (each block's
    item status; 0: stored) of `n` blocks."""
    meta = P.recv_reply(sock, op).meta
    dtype = np.dtype("<i8" if op == P.Op.ALLOC else "<i1")
    if len(meta) != n * dtype.itemsize:
        raise ProtocolError(f"{P.Op(op).name} reply of {len(meta)} bytes for {n} blocks")
    return np.frombuffer(meta, dtype=dtype)


class PartedPut:
    """One frame's put over a connected Unix socket (`run` once). The caller closes the connection if
    `run` raises anything but a block's own error (`raise_item`'s): replies may be left unread."""

    def __init__(self, sock: socket.socket, arena: memoryview, pages: ArenaPages, keys: Sequence[bytes],
                 views: Sequence[memoryview], versions: np.ndarray,
                 copying: Callable[[], AbstractContextManager[None]]) -> None:
        self.sock, self.arena, self.pages, self.keys, self.views = sock, arena, pages, keys, views
        self.copying = copying
        """Held around each part's copy: a close of the connection waits for it, and after one, no copy
        starts (`ShmTransport.copying`)."""
        self.versions = versions
        self.lens = lens = [v.nbytes for v in views]
        self.sizes = np.array(lens, dtype="<i8")
        self.parts = part_slices(lens, min(PART_BYTES, max(MIN_PART_BYTES, sum(lens) // 4)))
        self.offsets = np.full(len(keys), -1, dtype="<i8")
        self.status = np.zeros(len(keys), dtype="<i1")
        """Each block's: 0 stored (or not yet answered), else the worker's item status (ITEM_FULL, once `run`
        returns, for a block the put gave up on when a part found no room)."""
        self._replies: deque[tuple[int, slice]] = deque()  # (op, blocks) of each request not yet answered
        self._refused = False  # a part found no room: the rest of the batch is not put

    def run(self, slots: np.ndarray | None = None, sent: Callable[[], None] | None = None) -> np.ndarray:
        """Store the blocks; their offsets in the arena. Returns once the worker has answered every
        request; the caller raises the first failed block's error (`status`). `slots`: reserved on this
        connection already, one per block (`SpareSlots.take`): nothing is ALLOCated. `sent`: called once
        every part's COMMIT is sent, before their answers are read, unless a part found no room (a
        request sent then is answered after those commits, while this put waits for them)."""
        if slots is not None:
            self.pages.ready(slots, self.sizes)
            self.offsets[:] = slots
            for part in self.parts:
                self._copy_and_commit(part)
        else:
            self._alloc_copy_and_commit()
        if sent is not None and not self._refused:
            sent()
        while self._replies:
            self._read()
        if self._refused:  # the blocks left without a slot (granted ones given back included) are not stored
            self.status[(self.status == 0) & (self.offsets < 0)] = P.ITEM_FULL
        return self.offsets

    def _alloc_copy_and_commit(self) -> None:
        """Each part copied and committed as its slots arrive, asked for a chunk ahead."""
        chunks = alloc_chunks(self.parts)
        for chunk in chunks[:2]:
            self._send(P.Op.ALLOC, chunk)
        ahead, needed = 2, 0  # the next chunk to ask for; the next whose slots are needed
        for part in self.parts:
            if needed < len(chunks) and part.start == chunks[needed].start:
                reply = (P.Op.ALLOC, chunks[needed])
                while self._replies[0] != reply:
                    self._read()
                self._read()
                needed += 1
                if self._refused:
                    return  # no room: nothing more is asked, and slots granted ahead go back
                if ahead < len(chunks):
                    self._send(P.Op.ALLOC, chunks[ahead])
                    ahead += 1
            self._copy_and_commit(part)

    def _send(self, op: int, part: slice, csums: np.ndarray | None = None) -> None:
        keys = list(self.keys[part])
        if csums is None:
            meta = P.pack_batch(keys, self.sizes[part])
        else:
            meta = P.pack_batch(keys, self.offsets[part], self.sizes[part], csums, self.versions[part])
        P.send_frame(self.sock, op, meta)
        self._replies.append((op, part))

    def _read(self) -> None:
        op, part = self._replies.popleft()
        got = recv_column(self.sock, op, part.stop - part.start)
        if op == P.Op.COMMIT:
            self.status[part] = got
            return
        failed = got < 0
        if not failed.any() and not self._refused:
            self.offsets[part] = got
            self.pages.ready(got, self.sizes[part])
            return
        held = got[~failed]  # a refused chunk's, or one granted ahead of it: they go back
        if held.size:
            P.send_frame(self.sock, P.Op.ABORT, held.tobytes())
        if not self._refused:
            self._refused = True
            self.status[part] = np.where(failed, got, 0)

    def _copy_and_commit(self, part: slice) -> None:
        """Copy the part's blocks into their slots, hashing each as it lands, and COMMIT them."""
        with self.copying():
            csums = copy_into(self.arena, self.offsets[part], self.views[part])
        self._send(P.Op.COMMIT, part, csums)


class SpareSlots:
    """Slots one connection holds reserved for its next put of one shape (see the module's doc): asked
    for as a put ends (`ask`, the answer left unread), read at the connection's next exchange
    (`read_answer`), taken by the next put of that shape (`take`) or given back by one of another (by
    `take`; by `give_back` where that put goes through the socket: `transport.SOCKET_PUT_BYTES`). All
    are called within a session (the connection's lock held); a closed connection's are forgotten
    (`generation`: the worker freed them with it)."""

    def __init__(self) -> None:
        self._asked: tuple[tuple[int, ...], int] | None = None  # (shape, generation) of the unread ALLOC
        self._held: tuple[tuple[int, ...], int, np.ndarray] | None = None  # (shape, generation, offsets)
        self._last: tuple[tuple[int, ...], float] = ((), 0.0)  # the last put's shape, and when it ended

    def ask(self, sock: socket.socket, generation: int, keys: Sequence[bytes], sizes: np.ndarray) -> None:
        """A put of `sizes` sent its last COMMIT (`PartedPut.run`'s `sent`): ask for the next one's slots
        if it is one of a run. Asked before the put's answers are read, the worker reserves them right
        after its commits, and the next put finds them answered (asked once the put had returned, the
        next one waited for that ALLOC: ~100 of a 64 x 16 KiB put's ~650 µs)."""
        shape, now = tuple(sizes.tolist()), time.monotonic()
        last, self._last = self._last, (shape, now)
        if last[0] == shape and now - last[1] < RUN_S and sum(shape) <= SPARE_BYTES:
            P.send_frame(sock, P.Op.ALLOC, P.pack_batch(list(keys), sizes))
            self._asked = (shape, generation)

    @property
    def unread(self) -> bool:
        """Whether an answer to `ask` is still to be read (`read_answer`)."""
        return self._asked is not None

    def read_answer(self, sock: socket.socket, generation: int) -> None:
        """Read the answer to the ALLOC `ask` sent on this connection, if one is due (before anything
        else is read from it); slots granted for only part of the shape go back at once."""
        asked, self._asked = self._asked, None
        if asked is None or asked[1] != generation:
            return  # (none; or asked on a connection closed since, its answer gone with it)
        shape = asked[0]
        got = recv_column(sock, P.Op.ALLOC, len(shape))
        if bool((got >= 0).all()):
            self._held = (shape, generation, got)
        elif bool((got >= 0).any()):
            P.send_frame(sock, P.Op.ABORT, got[got >= 0].tobytes())

    def take(self, sock: socket.socket, generation: int, sizes: np.ndarray) -> np.ndarray | None:
        """The spare slots if they are of `sizes`' shape (else given back: None), once the worker is
        seen not to have closed the connection (it frees a closed one's slots for other writers)."""
        held, self._held = self._held, None
        if held is None or held[1] != generation:
            return None
        still_open(sock)
        if held[0] == tuple(sizes.tolist()):
            return held[2]
        P.send_frame(sock, P.Op.ABORT, held[2].tobytes())
        return None

    @property
    def pending(self) -> bool:
        """Whether slots are held, or asked for, on the connection (`give_back` would give some back)."""
        return self._asked is not None or self._held is not None

    def give_back(self, sock: socket.socket, generation: int) -> None:
        """Give back the slots held (a put that takes another way: they are nobody's to use otherwise);
        called after `read_answer`."""
        held, self._held = self._held, None
        if held is not None and held[1] == generation:
            P.send_frame(sock, P.Op.ABORT, held[2].tobytes())

    def forget(self) -> None:
        """The connection closed: its slots are the worker's again."""
        self._asked = self._held = None


def still_open(sock: socket.socket) -> None:
    """ConnectionError if the worker closed the connection (it then gave this connection's slots to other
    writers: no put may copy into a slot reserved before). Seen only where no answer is left unread before
    the close."""
    poller = select.poll()  # (the socket has a timeout: a receive would wait for a byte first)
    poller.register(sock, select.POLLIN)
    if poller.poll(0) and sock.recv(1, socket.MSG_PEEK) == b"":
        raise ConnectionError("the worker closed the connection")

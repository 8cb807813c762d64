"""A same-node get LEASEs a batch in two requests sent back to back and copies the first part while the
worker serves the second: hits and misses land in both parts, a destination too small raises with no
lease left held, and the connection stays in step."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core.errors import BufferSizeError, PoolUnavailable
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport

pytestmark = pytest.mark.usefixtures("arena_only")  # (the arena's way, with small blocks)


def _leases_held(worker: Worker) -> int:
    return sum(len(c.leases) for c in list(worker._conns))


def test_hits_and_misses_in_both_parts(worker: Worker) -> None:
    blocks = [np.full(5000 + i, i, dtype=np.uint8) for i in range(40)]
    keys = [f"k{i}".encode() for i in range(40)]
    t = ShmTransport(worker.unix_path)
    try:
        stamps = [1000 + i for i in range(0, 40, 2)]
        t.batch_put(keys[::2], blocks[::2], versions=stamps)  # every other key: misses in both parts
        t.batch_remove([keys[1]], versions=[77])  # a removal's version is a miss's
        out = [np.zeros(6000, dtype=np.uint8) for _ in keys]
        sizes, versions = t.batch_get_versions_into(keys, out)
        assert sizes == [b.nbytes if i % 2 == 0 else -1 for i, b in enumerate(blocks)]
        assert versions == [1000 + i if i % 2 == 0 else 77 if i == 1 else 0 for i in range(40)]
        assert all(np.array_equal(o[:b.nbytes], b) for o, b in zip(out[::2], blocks[::2]))
        assert all(not o.any() for o in out[1::2])
        assert t.batch_exists(keys[:2]) == [True, False]  # in step
        deadline = time.monotonic() + 5
        while _leases_held(worker) and time.monotonic() < deadline:  # RELEASE needs no reply
            time.sleep(0.01)
        assert _leases_held(worker) == 0
    finally:
        t.close()


@pytest.mark.parametrize("small", [3, 30])  # in the first part; in the second
def test_a_destination_too_small_raises_and_holds_nothing(worker: Worker, small: int) -> None:
    keys = [f"k{i}".encode() for i in range(40)]
    t = ShmTransport(worker.unix_path)
    try:
        t.batch_put(keys, [np.full(4096, i, dtype=np.uint8) for i in range(40)])
        out = [np.zeros(4096 if i != small else 100, dtype=np.uint8) for i in range(40)]
        with pytest.raises(BufferSizeError) as e:
            t.batch_get_into(keys, out)
        assert e.value.key == keys[small]
        deadline = time.monotonic() + 5
        while _leases_held(worker) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _leases_held(worker) == 0  # released, or ended with the connection
        out[small] = np.zeros(4096, dtype=np.uint8)
        assert t.batch_get_into(keys, out) == [4096] * 40  # the client carries on
        assert all((o == i).all() for i, o in enumerate(out))
    finally:
        t.close()


@pytest.mark.parametrize("small", [3, 30])
def test_a_destination_too_small_leaves_the_connection_and_open_leases_alone(worker: Worker, small: int) -> None:
    keys = [f"k{i}".encode() for i in range(40)]
    t = ShmTransport(worker.unix_path)
    try:
        t.batch_put([b"held", *keys], [np.full(4096, 7, dtype=np.uint8), *[np.full(4096, i, dtype=np.uint8)
                                                                         for i in range(40)]])
        with t.batch_lease([b"held"]) as (view,):
            generation = t.generation
            out = [np.zeros(4096 if i != small else 100, dtype=np.uint8) for i in range(40)]
            with pytest.raises(BufferSizeError):
                t.batch_get_into(keys, out)  # the caller's mistake: the worker's answers are all read
            assert t.generation == generation  # so the connection, and the lease taken on it, live on
            t.batch_remove([b"held"])
            t.batch_put([f"other{i}".encode() for i in range(64)], [np.full(4096, 9, dtype=np.uint8)] * 64)
            assert view is not None and bytes(view) == b"\x07" * 4096  # its slot was not given away
    finally:
        t.close()


def test_leases_whose_connection_closed_end_with_an_error_and_release_nothing_of_the_next(worker: Worker) -> None:
    """A lease outlives its connection (a timeout, say, in another thread): its exit says the views may
    have changed, and does not RELEASE its ids on the next connection, whose leases may have the same."""
    t = ShmTransport(worker.unix_path)
    try:
        t.batch_put([b"a", b"b"], [np.full(4096, 1, dtype=np.uint8), np.full(4096, 2, dtype=np.uint8)])
        first = t.batch_lease([b"a"])
        first.__enter__()
        t.close()  # as a failed exchange would: the worker ends the connection's leases
        with t.batch_lease([b"b"]) as (view,):  # lease ids start again on the new connection
            with pytest.raises(PoolUnavailable, match="closed meanwhile"):
                first.__exit__(None, None, None)
            t.batch_remove([b"b"])
            t.batch_put([f"other{i}".encode() for i in range(64)], [np.full(4096, 9, dtype=np.uint8)] * 64)
            assert view is not None and bytes(view) == b"\x02" * 4096  # still leased: not released by `first`
        with t.batch_lease([b"missing"]) as (none,):  # nothing held: nothing to lose
            t.close()
        assert none is None
    finally:
        t.close()


@pytest.mark.parametrize("past", [1, 1 << 40])
def test_a_lease_reply_naming_a_slot_outside_the_arena_drops_the_connection(
        worker: Worker, monkeypatch: pytest.MonkeyPatch, past: int) -> None:
    """The offsets come from the worker: one outside the arena (a worker that lost its mind, or not ours)
    is its failure (PoolUnavailable, the connection dropped), not the caller's bad argument, and nothing
    is copied from beyond the mapping."""
    keys = [f"k{i}".encode() for i in range(40)]
    t = ShmTransport(worker.unix_path)
    try:
        t.batch_put(keys, [np.full(4096, i, dtype=np.uint8) for i in range(40)])
        real = P.recv_reply

        def beyond(sock, op):  # type: ignore[no-untyped-def]
            reply = real(sock, op)
            if op == P.Op.LEASE:  # the offsets column (the second of five) moved past the arena's end
                n = len(reply.meta) // 40
                offsets = np.frombuffer(reply.meta, "<i8", n, 8 * n) + t.info.arena_size - 4096 + past
                reply.meta = reply.meta[:8 * n] + offsets.tobytes() + reply.meta[16 * n:]
            return reply

        monkeypatch.setattr(P, "recv_reply", beyond)
        generation = t.generation
        out = [np.zeros(4096, dtype=np.uint8) for _ in keys]
        with pytest.raises(PoolUnavailable, match="outside its arena"):
            t.batch_get_into(keys, out)
        assert t.generation != generation or t._sock is None  # dropped
        assert all(not o.any() for o in out)
        monkeypatch.undo()
        assert t.batch_get_into(keys, out) == [4096] * 40  # a new connection serves as before
        assert all((o == i).all() for i, o in enumerate(out))
    finally:
        t.close()


def test_every_kind_of_destination_gets_the_same_bytes(worker: Worker) -> None:
    """Writable C-contiguous buffers of any dtype or shape are copied into as they are (`writable_all`);
    a torch tensor through a flat byte view as before; a read-only or strided one is refused, as before,
    before a byte moves."""
    import torch

    keys = [f"d{i}".encode() for i in range(6)]
    blocks = [np.frombuffer(bytes([i + 1]) * 4096, dtype=np.uint8) for i in range(6)]
    t = ShmTransport(worker.unix_path)
    try:
        t.batch_put(keys, blocks)
        out = [np.zeros(4096, np.uint8), np.zeros(1024, np.float32), np.zeros((64, 64), np.uint8), bytearray(4096),
               memoryview(bytearray(4096)), torch.zeros(4096, dtype=torch.uint8)]
        assert t.batch_get_into(keys, out) == [4096] * 6
        got = [bytes(memoryview(np.ascontiguousarray(o.numpy() if isinstance(o, torch.Tensor) else o)).cast("B"))
               for o in out]
        assert got == [b.tobytes() for b in blocks]
        frozen = np.zeros(4096, np.uint8)
        frozen.flags.writeable = False
        for refused in (frozen, np.zeros(8192, np.uint8)[::2]):
            with pytest.raises(BufferSizeError):
                t.batch_get_into(keys[:2], [np.zeros(4096, np.uint8), refused])
        assert t.batch_get_into(keys[:1], [frozen.copy()]) == [4096]  # in step
    finally:
        t.close()

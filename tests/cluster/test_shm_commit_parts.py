"""A same-node put ALLOCs ahead, copies and COMMITs in parts (the worker verifies one part while the next
is copied): every block lands, a part the worker refuses fails only its own blocks, a batch that finds no
room stops with nothing held, and the connection stays in step. A TCP put sends its frames back to back:
a block refused in one fails alone."""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core import shm_put, transport
from kvpool.core.blocks import checksum
from kvpool.core.errors import CapacityError, CorruptBlock, PoolUnavailable
from kvpool.core.fastcopy import copy_into
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport, TcpTransport

pytestmark = pytest.mark.usefixtures("arena_only")  # (the arena's way, with small blocks)

MiB = 1 << 20


def _wait_for(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Until `done()` (a closed connection's slots go back when the worker's thread sees it close)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "not within 5 s"
        time.sleep(0.01)


def _lying_about(block: np.ndarray) -> Callable[[memoryview | bytes], int]:
    """A checksum function that is wrong for `block` (known by its first 64 bytes) only."""
    head = block.tobytes()[:64]

    def lying(data: memoryview | bytes) -> int:
        real = checksum(data)
        return real ^ 1 if bytes(data[:64]) == head else real
    return lying


def _copying_and_lying_about(block: np.ndarray) -> Callable[[memoryview, np.ndarray, list[memoryview]], np.ndarray]:
    """A `copy_into` whose checksum is wrong for `block` only (`_lying_about`)."""
    lying = _lying_about(block)

    def copy_lying(dst: memoryview, offsets: np.ndarray, srcs: list[memoryview]) -> np.ndarray:
        copy_into(dst, offsets, srcs)
        return np.array([lying(dst[off:off + memoryview(s).nbytes]) for off, s in zip(offsets.tolist(), srcs)],
                        dtype="<u8")
    return copy_lying


def _blocks(n: int, size: int) -> list[np.ndarray]:
    return [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(n)]


@pytest.mark.parametrize("parts_per_alloc", [1, 3])
def test_a_put_of_many_parts_lands_whole(worker: Worker, monkeypatch: pytest.MonkeyPatch, parts_per_alloc: int) -> None:
    monkeypatch.setattr(shm_put, "PART_BYTES", 1 * MiB)
    monkeypatch.setattr(shm_put, "PARTS_PER_ALLOC", parts_per_alloc)  # slots asked for a chunk ahead
    blocks = _blocks(40, 300 << 10) + _blocks(3, 3 * MiB)
    keys = [f"k{i}".encode() for i in range(len(blocks))]
    t = ShmTransport(worker.unix_path)
    try:
        t.batch_put(keys, blocks)
        out = [np.zeros_like(b) for b in blocks]
        assert t.batch_get_into(keys, out) == [b.nbytes for b in blocks]
        assert all(np.array_equal(a, b) for a, b in zip(blocks, out))
        assert worker.cache.check() == []
    finally:
        t.close()


def test_a_block_refused_in_one_part_fails_alone(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_put, "PART_BYTES", 1 * MiB)
    blocks = _blocks(12, 512 << 10)
    keys = [f"k{i}".encode() for i in range(12)]
    real_copy_into = shm_put.copy_into
    monkeypatch.setattr(shm_put, "copy_into", _copying_and_lying_about(blocks[5]))  # the client claims a wrong one
    t = ShmTransport(worker.unix_path)
    try:
        with pytest.raises(CorruptBlock) as e:
            t.batch_put(keys, blocks)
        assert e.value.key == keys[5]
        monkeypatch.setattr(shm_put, "copy_into", real_copy_into)
        assert t.batch_exists(keys) == [i != 5 for i in range(12)]  # the connection is in step
        assert worker.metrics.corrupt_blocks._value.get() == 1
        assert worker.cache.check() == []
    finally:
        t.close()
    _wait_for(lambda: worker.cache.stats().dram_bytes == 11 * (512 << 10))  # the refused slot went back


def test_an_empty_batch_and_an_empty_block(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        t.batch_put([], [])
        assert t.batch_get_into([], []) == []
        t.batch_put([b"empty", b"full"], [b"", b"x" * 1000])
        assert t.batch_get_into([b"empty", b"full"], [bytearray(0), bytearray(1000)]) == [0, 1000]
    finally:
        t.close()


def test_a_batch_that_runs_out_of_room_holds_nothing(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """96 MiB arena (24 slabs of 4 MiB), the blocks pinned so none can be evicted for the next: a put of
    4 MiB blocks stops at the first chunk without room (its slots granted in part, and the chunk asked
    ahead), every slot it held goes back, and what was stored before it stays whole."""
    monkeypatch.setattr(shm_put, "PART_BYTES", 1 * MiB)  # a part per block
    monkeypatch.setattr(shm_put, "PARTS_PER_ALLOC", 2)  # chunks [0] [1 2] [3 4] ... of each frame
    t = ShmTransport(worker.unix_path)
    try:
        small = [f"s{i}".encode() for i in range(13)]
        t.batch_put(small, _blocks(13, 1 * MiB - 4096), pin_s=60)  # 4 slots a slab: 4 slabs, 20 left
        blocks = _blocks(30, 4 * MiB - 4096)
        keys = [f"k{i}".encode() for i in range(30)]
        with pytest.raises(CapacityError) as e:  # frames of 6 (max_reserve); the 4th: [18] [19 20] [21 22] [23]
            t.batch_put(keys, blocks, pin_s=60)
        assert e.value.key == keys[19]  # the first block not stored (its slot went back with its chunk's)
        assert t.batch_exists(keys) == [i < 19 for i in range(30)]  # the connection is in step
        got = [np.zeros_like(b) for b in blocks]
        sizes = t.batch_get_into(keys, got)
        assert all(np.array_equal(a, b) for a, b, n in zip(blocks, got, sizes) if n >= 0)
        assert all(not c.reserved for c in worker._conns)  # block 19's slot went back
        assert worker.cache.check() == []
        t.batch_put([b"last"], _blocks(1, 4 * MiB - 4096), pin_s=60)  # ... and is free again
    finally:
        t.close()


def test_a_tcp_put_of_many_frames_fails_only_the_refused_block(worker: Worker,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "_FRAME_BYTES", 1 * MiB)
    monkeypatch.setattr(transport, "_MIN_FRAME_BYTES", 1 * MiB)
    monkeypatch.setattr(transport, "_FRAMES_IN_FLIGHT", 2)  # replies read while frames go out
    blocks = _blocks(24, 256 << 10)
    keys = [f"t{i}".encode() for i in range(24)]
    monkeypatch.setattr(transport, "checksum", _lying_about(blocks[17]))  # the client claims a wrong one
    t = TcpTransport(worker.address, token=worker.token)
    try:
        with pytest.raises(CorruptBlock) as e:
            t.batch_put(keys, blocks)
        assert e.value.key == keys[17]
        assert t.batch_exists(keys) == [i != 17 for i in range(24)]
        got = [np.zeros_like(b) for b in blocks]
        t.batch_get_into(keys, got)
        assert all(np.array_equal(a, b) for i, (a, b) in enumerate(zip(blocks, got)) if i != 17)
    finally:
        t.close()



def test_an_alloc_reply_naming_a_slot_outside_the_arena_fails_the_put_typed(worker: Worker,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The slots come from the worker: one past the end of the arena is its failure (PoolUnavailable, the
    connection dropped), and nothing is copied outside the mapping."""
    t = ShmTransport(worker.unix_path)
    try:
        real = shm_put.recv_column

        def beyond(sock, op, n):  # type: ignore[no-untyped-def]
            got = real(sock, op, n)
            return got + t.info.arena_size if op == P.Op.ALLOC else got

        monkeypatch.setattr(shm_put, "recv_column", beyond)
        with pytest.raises(PoolUnavailable, match="outside its arena"):
            t.batch_put([b"k0", b"k1"], [np.full(4096, 1, np.uint8)] * 2)
        monkeypatch.undo()
        t.batch_put([b"k0"], [np.full(4096, 2, np.uint8)])  # a new connection puts as before
        out = np.zeros(4096, np.uint8)
        assert t.batch_get_into([b"k0", b"k1"], [out, np.zeros(4096, np.uint8)]) == [4096, -1]
        assert (out == 2).all()
    finally:
        t.close()


def test_an_alloc_answers_each_block(worker: Worker) -> None:
    """ALLOC's answer, block by block: a slot for each block in range while the connection's share of the
    arena lasts (`max_reserve`), ITEM_TOO_LARGE for a size out of range, ITEM_FULL past the share; the
    slots it granted are this connection's to commit, whatever else the batch held."""
    t = ShmTransport(worker.unix_path)
    try:
        share, big = worker.max_reserve, worker.cache.max_block
        assert share == 3 * big  # the fixture's: 96 MiB in 4 MiB slabs, a connection's share 1/8
        sizes = np.array([1000, big + 1, -5, big, big, big, 2000], "<i8")
        keys = [f"a{i}".encode() for i in range(len(sizes))]
        arena = t.writable_arena
        with t._session() as sock:
            got = np.frombuffer(t._roundtrip(sock, P.Op.ALLOC, P.pack_batch(keys, sizes)).meta, "<i8").tolist()
            # 1000 and two blocks of `big` fit the share; a third does not, but 2000 more bytes still do
            assert [o >= 0 for o in got] == [True, False, False, True, True, False, True]
            assert got[1:3] == [P.ITEM_TOO_LARGE, P.ITEM_TOO_LARGE] and got[5] == P.ITEM_FULL
            assert len({got[0], got[3], got[4], got[6]}) == 4
            off, data = got[0], bytes(range(250)) * 4
            arena[off:off + 1000] = data
            commit = P.pack_batch([keys[0]], np.array([off], "<i8"), np.array([1000], "<i8"),
                                  np.array([checksum(data)], "<u8"), np.array([1], "<u8"))
            assert np.frombuffer(t._roundtrip(sock, P.Op.COMMIT, commit).meta, "<i1").tolist() == [P.ITEM_OK]
            P.send_frame(sock, P.Op.ABORT, np.array(got[3:5] + got[6:], "<i8").tobytes())  # (no reply)
            # the usual batch, all in range and within the share: a slot each
            again = np.frombuffer(t._roundtrip(sock, P.Op.ALLOC, P.pack_batch(keys[3:5], sizes[3:5])).meta, "<i8")
            assert (again >= 0).all() and len(set(again.tolist())) == 2
        out = bytearray(1000)
        assert t.batch_get_into([keys[0]], [out]) == [1000] and bytes(out) == data
    finally:
        t.close()
    _wait_for(lambda: worker.cache.stats().dram_bytes == worker.cache.arena.slot_size(off))

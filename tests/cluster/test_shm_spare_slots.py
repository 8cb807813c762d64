"""A same-node put of a small frame that follows one of its shape asks, as it ends, for the slots of the
next put of that shape (`kvpool.core.shm_put.SpareSlots`): the next put of that shape ALLOCs nothing,
one of another shape gives them back, a lone put or a large frame keeps none, and slots the worker freed
with a connection it closed are never written."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from stagehelp import make_blocks, requests_of, reserved_bytes, wait_for

from kvpool.core import shm_put
from kvpool.core.errors import PoolUnavailable
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport

pytestmark = pytest.mark.usefixtures("arena_only")  # (the arena's way, with small blocks)

KiB, MiB = 1 << 10, 1 << 20


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def _read_back(t: ShmTransport, keys: list[bytes], blocks: list[np.ndarray]) -> bool:
    out = [np.zeros_like(b) for b in blocks]
    return t.batch_get_into(keys, out) == [b.nbytes for b in blocks] and all(map(np.array_equal, out, blocks))


def _spare_offsets(t: ShmTransport) -> list[int]:
    """The slots `t` holds for its next put (its answer read by an exchange first)."""
    t.hello()
    held = t._spare._held
    assert held is not None
    return held[2].tolist()


def test_the_next_put_of_the_same_shape_allocates_nothing(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        runs = [make_blocks(i, *[16 * KiB] * 64) for i in range(3)]
        t.batch_put(_keys("a", 64), runs[0])
        t.batch_put(_keys("b", 64), runs[1])  # the second of a run: its ALLOCs, then the next put's
        wait_for(lambda: reserved_bytes(worker) == MiB)  # held for the next put of 64 x 16 KiB
        before = requests_of(worker, "alloc")
        t.batch_put(_keys("c", 64), runs[2])
        wait_for(lambda: requests_of(worker, "alloc") - before >= 1)  # (counted after the answer)
        assert requests_of(worker, "alloc") - before == 1  # only the one for the put after it
        assert all(_read_back(t, _keys(tag, 64), b) for tag, b in zip("abc", runs))
        assert reserved_bytes(worker) == MiB and worker.cache.check() == []
    finally:
        t.close()
    wait_for(lambda: reserved_bytes(worker) == 0)  # given back with the connection


def test_a_lone_put_keeps_none(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        for i in range(2):
            t.batch_put(_keys(f"lone{i}-", 8), make_blocks(i, *[16 * KiB] * 8))
            assert reserved_bytes(worker) == 0
            time.sleep(shm_put.RUN_S * 2)  # (the next is not one of a run)
    finally:
        t.close()


def test_a_put_of_another_shape_gives_them_back(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        small, large = make_blocks(3, *[16 * KiB] * 8), make_blocks(4, *[64 * KiB] * 4)
        t.batch_put(_keys("s", 8), small)
        t.batch_put(_keys("s", 8), small)  # a run of two: slots kept for a third
        assert _read_back(t, _keys("s", 8), small)  # a get in between reads the put's last answer first
        wait_for(lambda: reserved_bytes(worker) == 8 * 16 * KiB)
        t.batch_put(_keys("l", 4), large)
        assert reserved_bytes(worker) == 0  # given back (and not a run of its shape yet)
        t.batch_put(_keys("l", 4), large)
        assert _read_back(t, _keys("s", 8), small) and _read_back(t, _keys("l", 4), large)
        wait_for(lambda: reserved_bytes(worker) == 4 * 64 * KiB)  # the new shape's only
        assert worker.cache.check() == []
        assert worker.cache.stats().dram_bytes == 8 * 16 * KiB + 4 * 64 * KiB + reserved_bytes(worker)
    finally:
        t.close()


def test_a_large_frame_keeps_none(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        blocks = make_blocks(5, *[shm_put.SPARE_BYTES // 2 + 4 * KiB] * 2)
        t.batch_put(_keys("big", 2), blocks)
        t.batch_put(_keys("big", 2), blocks)
        assert _read_back(t, _keys("big", 2), blocks)
        assert reserved_bytes(worker) == 0
    finally:
        t.close()


def test_slots_of_a_connection_the_worker_closed_are_never_written(worker: Worker) -> None:
    t, other = ShmTransport(worker.unix_path), ShmTransport(worker.unix_path)
    try:
        t.batch_put(_keys("t", 16), make_blocks(6, *[64 * KiB] * 16))
        t.batch_put(_keys("t", 16), make_blocks(6, *[64 * KiB] * 16))
        spare = _spare_offsets(t)
        for conn in list(worker._conns):  # the worker drops t's connection
            socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
        wait_for(lambda: reserved_bytes(worker) == 0)  # ... and frees t's spare slots for other writers
        theirs = make_blocks(7, *[64 * KiB] * 16)
        other.batch_put(_keys("o", 16), theirs)  # on a new connection: the freed slots are taken again
        taken = {worker.cache._stack.dram.blocks[k].offset for k in _keys("o", 16)}
        assert taken & set(spare)  # (else this test proves nothing)
        with pytest.raises(PoolUnavailable):  # t's next put of the shape: its connection is gone, no copy
            t.batch_put(_keys("t2", 16), make_blocks(8, *[64 * KiB] * 16))
        assert _read_back(other, _keys("o", 16), theirs)
        again = make_blocks(9, *[64 * KiB] * 16)
        t.batch_put(_keys("t3", 16), again)  # and t puts on a new connection
        assert _read_back(t, _keys("t3", 16), again) and _read_back(other, _keys("o", 16), theirs)
    finally:
        t.close()
        other.close()


def test_a_put_of_several_frames_of_one_shape_reads_each_answer_in_turn(tmp_path) -> None:
    """A put larger than one connection may hold reserved goes in frames, in one session: a frame that
    asks for the next one's slots (it follows one of its shape) has that answer read before the next frame
    ALLOCs, never taken for the answer to that ALLOC (a put of two such frames, the second time, failed
    with a reply out of turn)."""
    from kvpool.core.config import CacheConfig, WorkerConfig

    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "small.sock")),  # type: ignore[arg-type]
               CacheConfig(dram_bytes=8 * MiB, dram_slab_size=MiB, prefault=False)).start()  # type: ignore[arg-type]
    t = ShmTransport(w.unix_path)
    try:
        assert t.hello().max_reserve < 2 * MiB  # frames of 31 x 32 KiB (each block charged 256 bytes more), 31, 2
        for i in range(3):
            blocks = make_blocks(i, *[32 * KiB] * 64)
            t.batch_put(_keys(f"f{i}-", 64), blocks)
            assert _read_back(t, _keys(f"f{i}-", 64), blocks)
        assert w.cache.check() == []
    finally:
        t.close()
        w.stop()

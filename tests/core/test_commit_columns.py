"""A same-node COMMIT read in one C call (`_native.commit_columns`, the worker's `_commit_columns`) gives
what the Python path gives: the same columns (versions capped), the same slots claimed, the same
corrupt blocks; and it changes nothing where the request is not a well-formed COMMIT of this
connection's slots, so the Python path says what is wrong. Through a worker, each way: a batch with a
corrupt block stores the rest, a version stamped far ahead is brought down, a slot not reserved (or
named twice) closes the connection as a protocol error and stores nothing."""
from __future__ import annotations

import random
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.core import PoolClient, worker_ops
from kvpool.core import protocol as P
from kvpool.core.blocks import checksum
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import PoolUnavailable
from kvpool.core.keys import MAX_KEY_BYTES
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport
from kvpool.core.versions import ceiling, stamp

from corehelp import SMALL, worker_commit_columns

ARENA = 1 << 20


def _native() -> Any:
    assert worker_ops._native_commit_columns is not None  # CI builds the extension: two paths are compared
    return worker_ops._native_commit_columns


def _batch(rng: random.Random, arena: np.ndarray) -> tuple[bytes, dict[int, int], list[int]]:
    """A COMMIT of random blocks written into `arena` (a few with a wrong checksum, some versions far
    ahead), the connection's reserved slots (those named, and others), and the corrupt ones' indices."""
    n = rng.randrange(0, 40)
    keys = [rng.randbytes(rng.randrange(1, 24)) for _ in range(n)]
    offsets, sizes, csums, versions, corrupt, reserved = [], [], [], [], [], {}
    at = 0
    for i in range(n):
        size = rng.choice([0, 1, 100, 4096, 16384])
        data = rng.randbytes(size)
        arena[at:at + size] = np.frombuffer(data, np.uint8)
        bad = size > 0 and rng.random() < 0.1
        offsets.append(at)
        sizes.append(size)
        csums.append(checksum(data) ^ (1 if bad else 0))
        versions.append(stamp() if rng.random() < 0.8 else (1 << 63) + rng.randrange(1 << 20))
        if bad:
            corrupt.append(i)
        reserved[at] = size
        at += size + 16
    for _ in range(rng.randrange(0, 4)):  # other slots of the connection's, not in this batch
        reserved[ARENA - 1 - rng.randrange(1000)] = 1
    meta = P.pack_batch(keys, np.array(offsets, "<i8"), np.array(sizes, "<i8"), np.array(csums, "<u8"),
                        np.array(versions, "<u8"))
    return meta, reserved, corrupt


@pytest.mark.parametrize("check", [True, False])
def test_the_native_read_gives_what_the_python_path_gives(check: bool) -> None:
    rng = random.Random(11)
    commit = _native()
    for _ in range(300):
        arena = np.zeros(ARENA, np.uint8)
        meta, reserved, corrupt = _batch(rng, arena)
        top = ceiling()
        mine, theirs = dict(reserved), dict(reserved)
        got = commit(meta, P.MAX_BATCH, MAX_KEY_BYTES, top, mine, memoryview(arena), check)
        want = worker_commit_columns(meta, theirs, memoryview(arena), check, top)
        assert got is not None and want is not None
        assert got == want and mine == theirs
        assert got[5] == (corrupt if check else [])
        assert all(v <= top for v in got[4])
        assert not set(got[1]) & set(mine)  # the batch's slots are claimed, the others kept


def _variants(rng: random.Random) -> Iterator[tuple[str, bytes, dict[int, int]]]:
    """COMMITs the native read must leave to the Python path, each with the reserved slots it meets."""
    arena = np.zeros(ARENA, np.uint8)
    meta, reserved, _ = _batch(rng, arena)
    while len(reserved) < 3 or meta[:4] == b"\0\0\0\0":
        meta, reserved, _ = _batch(rng, arena)
    n = struct.unpack_from("<I", meta)[0]
    cols = meta[len(meta) - 32 * n:]
    offsets = np.frombuffer(cols, "<i8", n)
    yield "empty metadata", b"", reserved
    yield "a count past the metadata", struct.pack("<I", n + 1000) + meta[4:], reserved
    yield "a count past max_batch", struct.pack("<I", P.MAX_BATCH + 1) + meta[4:], reserved
    yield "a byte short", meta[:-1], reserved
    yield "a byte over", meta + b"\0", reserved
    yield "a key of no bytes", meta[:4] + b"\0\0" + meta[6:], reserved
    yield "a key too long", meta[:4] + struct.pack("<H", MAX_KEY_BYTES + 1) + meta[6:], reserved
    first = int(offsets[0])
    yield "a slot not reserved", meta, {k: v for k, v in reserved.items() if k != first}
    yield "a slot of another size", meta, {**reserved, first: reserved[first] + 1}
    twice = offsets.copy()
    twice[-1] = twice[0]
    yield "a slot named twice", meta[:len(meta) - 32 * n] + twice.tobytes() + cols[8 * n:], reserved
    outside = offsets.copy()
    outside[0] = ARENA + 1  # (never reserved: the worker reserves slots of its arena)
    yield "a slot outside the arena", meta[:len(meta) - 32 * n] + outside.tobytes() + cols[8 * n:], \
        {**reserved, ARENA + 1: reserved[first]}


def test_a_commit_the_native_read_cannot_take_changes_nothing_and_the_python_path_refuses_it() -> None:
    rng = random.Random(5)
    commit = _native()
    arena = memoryview(np.zeros(ARENA, np.uint8))
    seen = set()
    for _ in range(20):
        for what, meta, reserved in _variants(rng):
            seen.add(what)
            mine = dict(reserved)
            assert commit(meta, P.MAX_BATCH, MAX_KEY_BYTES, ceiling(), mine, arena, True) is None, what
            assert mine == reserved, what
            assert worker_commit_columns(meta, dict(reserved), arena, True, ceiling()) is None, what
    assert len(seen) == 11


@pytest.fixture(params=["native", "python"])
def worker(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Worker]:
    if request.param == "python":
        monkeypatch.setattr(worker_ops, "_native_commit_columns", None)
    else:
        _native()
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), no_auth=True),
               CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    yield w
    w.stop()


def _written(t: ShmTransport, sock: Any, arena: memoryview, keys: list[bytes], blocks: list[bytes]) -> np.ndarray:
    """Slots ALLOCated on `sock` (`t`'s session) for `blocks`, each written into `arena`; their offsets."""
    sizes = np.array([len(b) for b in blocks], "<i8")
    offsets = np.frombuffer(t._roundtrip(sock, P.Op.ALLOC, P.pack_batch(keys, sizes)).meta, dtype="<i8")
    for off, b in zip(offsets.tolist(), blocks):
        arena[off:off + len(b)] = b
    return offsets


def test_a_commit_with_a_corrupt_block_stores_the_others_and_caps_a_version_far_ahead(worker: Worker) -> None:
    keys = [b"a", b"b", b"c", b"d"]
    blocks = [bytes([i]) * (4096 + i) for i in range(4)]
    sizes = np.array([len(b) for b in blocks], "<i8")
    csums = np.array([checksum(b) for b in blocks], "<u8")
    csums[1] ^= 1
    versions = np.array([stamp(), stamp(), (1 << 64) - 1, stamp()], "<u8")
    t = ShmTransport(worker.unix_path)
    try:
        arena = t.writable_arena  # (maps, and connects, outside the session below)
        with t._session() as sock:
            offsets = _written(t, sock, arena, keys, blocks)
            reply = t._roundtrip(sock, P.Op.COMMIT, P.pack_batch(keys, offsets, sizes, csums, versions))
        assert np.frombuffer(reply.meta, dtype="<i1").tolist() == [0, P.ITEM_CORRUPT, 0, 0]
        assert worker.metrics.corrupt_blocks._value.get() == 1
        with PoolClient(mode="local", worker=worker.unix_path) as c:
            assert [c.get(k.decode()) for k in keys] == [blocks[0], None, blocks[2], blocks[3]]
        held = worker.cache._stack.dram.blocks
        assert held[b"c"].version <= ceiling() and held[b"a"].version == int(versions[0])
        assert worker.cache.stats().dram_blocks == 3 and worker.cache._stack.dram._reserved == 0  # its slot freed
        assert not worker.cache.check()
    finally:
        t.close()


@pytest.mark.parametrize("wrong", ["not reserved", "named twice"])
def test_a_commit_of_a_slot_not_reserved_closes_the_connection_and_stores_nothing(worker: Worker, wrong: str) -> None:
    keys = [b"x", b"y"]
    blocks = [b"x" * 1000, b"y" * 1000]
    sizes = np.array([1000, 1000], "<i8")
    csums = np.array([checksum(b) for b in blocks], "<u8")
    t = ShmTransport(worker.unix_path)
    try:
        arena = t.writable_arena
        with pytest.raises(PoolUnavailable), t._session() as sock:
            offsets = _written(t, sock, arena, keys, blocks).copy()
            if wrong == "not reserved":
                offsets[1] += 1 << 16
            else:
                offsets[1] = offsets[0]
            t._roundtrip(sock, P.Op.COMMIT, P.pack_batch(keys, offsets, sizes, csums,
                                                         np.array([stamp(), stamp()], "<u8")))
        assert worker.metrics.protocol_errors._value.get() == 1
        with PoolClient(mode="local", worker=worker.unix_path) as c:
            assert c.batch_exists(["x", "y"]) == [False, False]
        deadline = time.monotonic() + 5
        while worker.cache.stats().dram_bytes and time.monotonic() < deadline:  # the closed connection's
            time.sleep(0.02)  # slots go back as its thread ends
        assert worker.cache.stats().dram_bytes == 0
    finally:
        t.close()


@pytest.mark.parametrize("top", [-1, 1 << 64])
def test_a_ceiling_outside_the_versions_range_is_refused_not_wrapped(top: int) -> None:
    arena = np.zeros(ARENA, np.uint8)
    meta, reserved, _ = _batch(random.Random(2), arena)
    mine = dict(reserved)
    with pytest.raises(OverflowError):
        _native()(meta, P.MAX_BATCH, MAX_KEY_BYTES, top, mine, memoryview(arena), True)
    assert mine == reserved

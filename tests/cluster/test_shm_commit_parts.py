"""A same-node put copies and COMMITs in parts (the worker verifies one part while the next is copied):
every block lands, a part the worker refuses fails only its own blocks, and the connection stays in step."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.core import transport
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import CorruptBlock
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport

MiB = 1 << 20


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock")),
               CacheConfig(dram_bytes=96 * MiB, dram_slab_size=4 * MiB, prefault=False)).start()  # type: ignore[arg-type]
    yield w
    w.stop()


def _blocks(n: int, size: int) -> list[np.ndarray]:
    return [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(n)]


@pytest.mark.parametrize("in_flight", [1, 16])
def test_a_put_of_many_parts_lands_whole(worker: Worker, monkeypatch: pytest.MonkeyPatch, in_flight: int) -> None:
    monkeypatch.setattr(transport, "_COMMIT_BYTES", 1 * MiB)  # (its floor: parts of 1 MiB)
    monkeypatch.setattr(transport, "_COMMITS_IN_FLIGHT", in_flight)  # 1: replies read while parts go out
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
    monkeypatch.setattr(transport, "_COMMIT_BYTES", 1 * MiB)  # (its floor: parts of 1 MiB)
    blocks = _blocks(12, 512 << 10)
    keys = [f"k{i}".encode() for i in range(12)]
    real_checksum = transport.checksum

    def lying(data: memoryview | bytes) -> int:  # the client claims a wrong checksum for block 5
        real = real_checksum(data)
        return real ^ 1 if bytes(data[:64]) == blocks[5].tobytes()[:64] else real

    monkeypatch.setattr(transport, "checksum", lying)
    t = ShmTransport(worker.unix_path)
    try:
        with pytest.raises(CorruptBlock) as e:
            t.batch_put(keys, blocks)
        assert e.value.key == keys[5]
        monkeypatch.setattr(transport, "checksum", real_checksum)
        assert t.batch_exists(keys) == [i != 5 for i in range(12)]  # the connection is in step
        assert worker.metrics.corrupt_blocks._value.get() == 1
        assert worker.cache.stats().dram_bytes == 11 * (512 << 10)  # the refused slot went back
        assert worker.cache.check() == []
    finally:
        t.close()


def test_an_empty_batch_and_an_empty_block(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        t.batch_put([], [])
        assert t.batch_get_into([], []) == []
        t.batch_put([b"empty", b"full"], [b"", b"x" * 1000])
        assert t.batch_get_into([b"empty", b"full"], [bytearray(0), bytearray(1000)]) == [0, 1000]
    finally:
        t.close()

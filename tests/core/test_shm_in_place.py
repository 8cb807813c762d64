"""Same-node blocks read in place: a put learns where its blocks were committed (`put_placed`), a reader
on the node copies them from its own read-only mapping with no round trip to the worker (`read_placed`),
and any place it cannot trust (a reused slot, a forged offset, another arena, a TCP client) reads
nothing: the caller's get serves it."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.core import Place, PoolClient, checksum, put_placed, read_placed
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.server import Worker

SMALL = {"dram_bytes": 32 << 20, "dram_slab_size": 1 << 20, "prefault": False}
SIZE = 256 << 10


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock")), CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    yield w
    w.stop()


@pytest.fixture
def writer(worker: Worker) -> Iterator[PoolClient]:
    with PoolClient(mode="local", worker=worker.unix_path) as c:
        yield c


@pytest.fixture
def reader(worker: Worker) -> Iterator[PoolClient]:
    """Another client on the node, as the decode side would be."""
    with PoolClient(mode="local", worker=worker.unix_path) as c:
        yield c


def _block(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def _served(pool: PoolClient) -> int:
    """Reads the worker served (hits and misses): a read in place makes none."""
    total = pool.stats().total
    return total.hits_dram + total.hits_ssd + total.misses


def _read(reader: PoolClient, places: list[Place | None], blocks: list[bytes]) -> tuple[list[bool], list[bytes]]:
    views = [memoryview(bytearray(len(b))) for b in blocks]
    ok = read_placed(reader, places, views, [checksum(b) for b in blocks])
    return ok, [bytes(v) for v in views]


def test_a_same_node_put_tells_where_its_blocks_lie_and_a_reader_copies_them_without_the_worker(
        worker: Worker, writer: PoolClient, reader: PoolClient) -> None:
    blocks = [_block(1), _block(2)]
    places = put_placed(writer, ["a", "b"], blocks)
    assert all(p is not None and p.worker == worker.worker_id for p in places)
    assert [p.size for p in places if p is not None] == [SIZE, SIZE]
    assert len({p.offset for p in places if p is not None}) == 2
    assert all(p is not None and p.version > 0 and p.arena for p in places)
    before = _served(reader)
    ok, got = _read(reader, places, blocks)
    assert ok == [True, True] and got == blocks
    assert _served(reader) == before  # no LEASE, no GET: the worker served nothing


def test_a_reused_slot_reads_nothing_and_the_get_serves_the_right_bytes(writer: PoolClient, reader: PoolClient) -> None:
    old = _block(3)
    (place,) = put_placed(writer, ["k"], [old])
    writer.remove("k")
    for i in range(3):  # the freed slot goes to a later block (the next put's was asked for before the remove)
        (other,) = put_placed(writer, [f"other{i}"], [_block(4 + i)])
        assert place is not None and other is not None
        if other.offset == place.offset:
            break
    assert other.offset == place.offset
    writer.put("k", old)  # the block again, elsewhere
    ok, _ = _read(reader, [place], [old])
    assert ok == [False]
    assert reader.get("k") == old


@pytest.mark.parametrize("forge", [
    {"offset": 1 << 62},                      # far outside the mapping
    {"offset": (32 << 20) - 1000},            # starts inside, ends outside
    {"offset": 12345},                        # inside, but not the block: its checksum disagrees
    {"arena": "kvpool-someone-else"},         # an arena this client does not map
    {"worker": "another-worker"},
    {"size": SIZE + 1},                       # not the size the reader was told
])
def test_a_forged_place_is_bounded_and_reads_nothing(writer: PoolClient, reader: PoolClient,
                                                     forge: dict[str, object]) -> None:
    block = _block(5)
    (place,) = put_placed(writer, ["f"], [block])
    assert place is not None
    ok, _ = _read(reader, [dataclasses.replace(place, **forge)], [block])  # type: ignore[arg-type]
    assert ok == [False]


def test_over_tcp_nothing_is_placed_and_nothing_is_read_in_place(worker: Worker, writer: PoolClient) -> None:
    block = _block(6)
    (place,) = put_placed(writer, ["t"], [block])
    with PoolClient(mode="local", worker=worker.address) as tcp:
        assert put_placed(tcp, ["t2"], [block]) == [None]
        ok, _ = _read(tcp, [place], [block])
        assert ok == [False]
        assert tcp.get("t") == block


def test_an_embedded_pool_places_nothing() -> None:
    with PoolClient(mode="embedded", **SMALL) as pool:  # type: ignore[arg-type]
        assert put_placed(pool, ["e"], [b"x" * 100]) == [None]
        assert read_placed(pool, [None], [memoryview(bytearray(100))], [checksum(b"x" * 100)]) == [False]

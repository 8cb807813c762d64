"""One set of behavioural checks, run against every PoolBackend through PoolClient: the dict of
MemoryBackend, the embedded TieredCache, and one in-process worker over shared memory and over TCP.
What holds for one holds for all; the layers above PoolClient may test against MemoryBackend."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import BlockTooLarge, BufferSizeError, InvalidArgument, InvalidKey
from kvpool.core.memory_backend import MemoryBackend
from kvpool.core.records import PoolStats
from kvpool.core.server import Worker

MAX_BLOCK = 1 << 20


@pytest.fixture(params=["memory", "embedded", "shm", "tcp"])
def client(request: pytest.FixtureRequest, tmp_path) -> Iterator[PoolClient]:
    if request.param == "memory":
        with PoolClient(backend=MemoryBackend(max_block=MAX_BLOCK)) as c:
            yield c
        return
    cache = CacheConfig(dram_bytes=16 << 20, dram_slab_size=MAX_BLOCK, prefault=False)
    if request.param == "embedded":
        with PoolClient(cache=cache) as c:
            yield c
        return
    worker = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock")), cache).start()
    try:
        with PoolClient(mode="local", worker=worker.unix_path if request.param == "shm" else worker.address) as c:
            yield c
    finally:
        worker.stop()


def test_put_get_exists_remove(client: PoolClient) -> None:
    keys = [f"k{i}" for i in range(8)]
    client.batch_put(keys, [bytes([i]) * (1000 + i) for i in range(8)])
    client.put(b"raw-bytes-key", np.arange(10, dtype=np.uint8))
    assert client.get("k3") == bytes([3]) * 1003 and client.get("absent") is None
    assert client.get(b"raw-bytes-key") == bytes(range(10))
    assert client.exists("k0") is True and client.exists("absent") is False
    assert client.batch_exists(["k1", "absent", "k2"]) == [True, False, True]
    assert client.prefix_match(["k0", "k1", "absent", "k2"]) == 2
    assert client.remove("k0") is True and client.remove("k0") is False
    assert client.batch_remove(["k1", "absent"]) == [True, False]
    assert client.batch_exists(keys[:3]) == [False, False, True]


def test_get_into_sizes_and_misses(client: PoolClient) -> None:
    client.batch_put(["a", "b"], [b"x" * 100, b"y" * 200])
    bufs = [bytearray(256) for _ in range(3)]
    assert client.batch_get_into(["a", "absent", "b"], bufs) == [100, -1, 200]
    assert bytes(bufs[0][:100]) == b"x" * 100 and bytes(bufs[2][:200]) == b"y" * 200
    out = np.zeros(256, dtype=np.uint8)
    assert client.get_into("b", out) == 200 and out[:200].tobytes() == b"y" * 200
    with pytest.raises(BufferSizeError) as small:
        client.get_into("b", bytearray(10))
    assert small.value.size == 200 and small.value.limit == 10


def test_leases(client: PoolClient) -> None:
    client.batch_put(["l0", "l1"], [b"0" * 64, b"1" * 4096])
    with client.batch_lease(["l0", "absent", "l1"]) as views:
        assert [None if v is None else bytes(v) for v in views] == [b"0" * 64, None, b"1" * 4096]
        assert all(v is None or v.readonly for v in views)
    with client.lease("l1") as view:
        assert view is not None and view.nbytes == 4096
    with client.lease("absent") as view:
        assert view is None


def test_pins_and_clear(client: PoolClient) -> None:
    client.batch_put(["ns/a", "ns/b", "other"], [b"a", b"b", b"o"], pin_s=30)
    client.pin("ns/a", 0)
    client.batch_pin(["ns/b", "other"], 0)
    client.clear("ns/")
    assert client.batch_exists(["ns/a", "ns/b", "other"]) == [False, False, True]
    client.clear()
    assert client.exists("other") is False


def test_arguments_are_checked_before_any_backend_sees_them(client: PoolClient) -> None:
    with pytest.raises(InvalidArgument, match="2 keys but 1 buffers") as mismatch:
        client.batch_put(["a", "b"], [b"x"])
    assert (mismatch.value.size, mismatch.value.limit) == (1, 2)
    with pytest.raises(InvalidArgument):
        client.batch_get_into(["a"], [])
    with pytest.raises(InvalidArgument, match="list of keys"):
        client.batch_exists("abc")  # one key, not three one-character keys
    with pytest.raises(InvalidKey):
        client.put("", b"x")
    with pytest.raises(BlockTooLarge) as big:
        client.put("big", bytes(MAX_BLOCK + 1))
    assert big.value.size == MAX_BLOCK + 1 and big.value.limit == client.max_block
    assert client.exists("big") is False


@pytest.mark.parametrize("frames", [1, 3])
def test_a_batch_with_a_block_over_the_max_stores_none_of_it(client: PoolClient, frames: int) -> None:
    """BlockTooLarge is found before any block of the batch is sent, as the embedded cache validates a
    batch whole: the other blocks, in the same frame or in earlier ones (a batch bigger than a worker
    takes in one goes in several), are not stored."""
    keys = [f"b{i}" for i in range(3 * frames)]
    blocks = [bytes([i]) * (MAX_BLOCK if frames > 1 else 100) for i in range(len(keys))]
    blocks[-2] = bytes(MAX_BLOCK + 1)
    with pytest.raises(BlockTooLarge) as big:
        client.batch_put(keys, blocks)
    assert big.value.key == keys[-2].encode() and big.value.size == MAX_BLOCK + 1
    assert client.batch_exists(keys) == [False] * len(keys)


def test_stats_and_members_are_typed_in_every_mode(client: PoolClient) -> None:
    client.batch_put(["s0", "s1"], [b"x" * 10, b"y" * 10])
    client.get("s0")
    stats = client.stats()
    assert isinstance(stats, PoolStats)
    assert stats.total.puts == 2 and stats.total.dram_blocks == 2 and stats.total.hits_dram >= 1
    members = client.members()
    assert set(stats.workers) == set(members) and len(members) <= 1
    for worker_id, info in members.items():
        assert info.worker_id == worker_id and info.max_block == client.max_block
        assert stats.workers[worker_id].cache == stats.total
    assert client.wait_for_members(lambda m: len(m) == len(members), 0.1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "30", None])
def test_a_pin_length_that_is_not_a_finite_number_is_refused(client: PoolClient, bad: object) -> None:
    client.put("short", b"s", pin_s=0.2)
    for call in (lambda: client.put("p", b"x", pin_s=bad), lambda: client.batch_put(["p"], [b"x"], pin_s=bad),  # type: ignore[arg-type]
                 lambda: client.pin("short", bad), lambda: client.batch_pin(["short"], bad)):  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="finite number of seconds"):
            call()
    assert client.exists("p") is False


@pytest.mark.parametrize("bad", [None, "text", 12])
def test_data_that_is_not_a_buffer_is_refused(client: PoolClient, bad: object) -> None:
    with pytest.raises(InvalidArgument, match="bytes-like"):
        client.put("d", bad)
    assert client.exists("d") is False

"""The SSD tier's LMDB store: round trips, corruption, a full map, reopening, and the cache on top of it."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.core import CapacityError, TieredCache
from kvpool.core.blocks import HEADER_SIZE, BlockMeta, checksum
from kvpool.core.errors import StorageError
from kvpool.core.tiers.ssd import SsdStore

from corehelp import KiB, MiB, payload


def item(key: bytes, data: bytes, expires: float = 0.0) -> tuple[bytes, BlockMeta, memoryview]:
    return key, BlockMeta(len(data), checksum(data), expires), memoryview(data)


def read_bytes(tier: SsdStore, key: bytes) -> bytes | None:
    return tier.read(key, lambda meta, view: bytes(view))


def flip_byte(env: object, key: bytes, pos: int) -> None:
    """Corrupt one byte of a stored value with a raw LMDB write (as bit rot would)."""
    with env.begin(write=True) as txn:  # type: ignore[attr-defined]
        value = bytearray(txn.get(key))
        value[pos] ^= 0x40
        txn.put(key, bytes(value))


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[SsdStore]:
    t = SsdStore(tmp_path / "lmdb", map_size=64 * MiB, sync=False)
    yield t
    t.close()


def test_batch_put_read_round_trip(tier: SsdStore) -> None:
    blocks = {f"k{i}".encode(): payload(f"k{i}", n) for i, n in enumerate([0, 1, 100, 4096, 300 * KiB])}
    written = tier.batch_put(item(k, v) for k, v in blocks.items())
    assert written == sum(map(len, blocks.values()))
    for k, v in blocks.items():
        assert read_bytes(tier, k) == v
        assert tier.contains(k)
    assert {k: m.size for k, m in tier.scan()} == {k: len(v) for k, v in blocks.items()}
    assert read_bytes(tier, b"absent") is None and not tier.contains(b"absent")


def test_read_passes_meta_and_a_verified_view(tier: SsdStore) -> None:
    data = payload("m", 5000)
    tier.batch_put([item(b"m", data, expires=1234.5)])
    meta = tier.read(b"m", lambda meta, view: (meta, len(view)))
    assert meta == (BlockMeta(5000, checksum(data), 1234.5), 5000)


def test_put_overwrites(tier: SsdStore) -> None:
    tier.batch_put([item(b"k", b"old" * 1000)])
    tier.batch_put([item(b"k", b"new")])
    assert read_bytes(tier, b"k") == b"new"


# header bytes: magic 0-3, version 4-5, size 8-15, checksum 16-23; then the payload
@pytest.mark.parametrize("pos", [0, 5, 9, 20, HEADER_SIZE, HEADER_SIZE + 777, HEADER_SIZE + 4 * KiB - 1])
def test_corrupt_value_is_a_miss_and_is_deleted(tier: SsdStore, pos: int) -> None:
    data = payload("c", 4 * KiB)
    tier.batch_put([item(b"c", data), item(b"ok", data)])
    flip_byte(tier.env, b"c", pos)
    assert read_bytes(tier, b"c") is None
    assert tier.corrupt == 1
    assert not tier.contains(b"c")
    assert read_bytes(tier, b"ok") == data  # its neighbour is untouched


def test_truncated_value_is_a_miss(tier: SsdStore) -> None:
    tier.batch_put([item(b"t", b"x" * 100)])
    with tier.env.begin(write=True) as txn:
        txn.put(b"t", bytes(txn.get(b"t"))[:HEADER_SIZE + 50])
    assert read_bytes(tier, b"t") is None and tier.corrupt == 1 and not tier.contains(b"t")
    with tier.env.begin(write=True) as txn:
        txn.put(b"h", b"short")
    assert read_bytes(tier, b"h") is None and tier.corrupt == 2


def test_map_full_is_capacity_error_and_writes_nothing_of_the_batch(tmp_path: Path) -> None:
    t = SsdStore(tmp_path / "small", map_size=1 * MiB, sync=False)
    try:
        t.batch_put([item(b"before", b"b" * 1000)])
        batch = [item(f"big{i}".encode(), payload(f"big{i}", 100 * KiB)) for i in range(20)]
        with pytest.raises(CapacityError) as err:
            t.batch_put(batch)
        assert str(1 * MiB) in str(err.value) and err.value.limit == 1 * MiB
        assert not any(t.contains(k) for k, _, _ in batch)
        assert read_bytes(t, b"before") == b"b" * 1000
        t.batch_put([item(b"after", b"a" * 1000)])  # the tier is still usable
        assert read_bytes(t, b"after") == b"a" * 1000
    finally:
        t.close()


def test_an_unusable_path_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "a file").write_bytes(b"")
    with pytest.raises(StorageError, match="cannot open"):
        SsdStore(tmp_path / "a file" / "lmdb", map_size=16 * MiB)


def test_reopen_after_clean_close(tmp_path: Path) -> None:
    path = tmp_path / "lmdb"
    t = SsdStore(path, map_size=16 * MiB, sync=True)
    t.batch_put([item(f"r{i}".encode(), payload(f"r{i}", 1000 * i)) for i in range(10)])
    t.close()
    with pytest.raises(StorageError, match="closed"):
        t.contains(b"r1")
    t = SsdStore(path, map_size=16 * MiB)
    try:
        for i in range(10):
            assert read_bytes(t, f"r{i}".encode()) == payload(f"r{i}", 1000 * i)
    finally:
        t.close()


def test_delete_and_clear(tier: SsdStore) -> None:
    tier.batch_put([item(f"d{i}".encode(), b"x") for i in range(5)])
    tier.delete([b"d0", b"d1", b"nope"])
    assert [tier.contains(f"d{i}".encode()) for i in range(5)] == [False, False, True, True, True]
    tier.clear()
    assert list(tier.scan()) == []


def test_forked_child_reopens_the_environment(tier: SsdStore) -> None:
    tier.batch_put([item(b"f", b"forked")])
    pid = os.fork()
    if pid == 0:  # child: the inherited handle must not be used; the tier reopens by itself
        ok = read_bytes(tier, b"f") == b"forked"
        tier.close()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert read_bytes(tier, b"f") == b"forked"  # the parent's handle is unaffected


# ----- the SSD tier under TieredCache ---------------------------------------------------------


def test_cache_counts_corrupt_ssd_blocks(make_cache: Callable[..., TieredCache], ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)
    cache.put("good", payload("good", 10 * KiB))
    cache.put("bad", payload("bad", 10 * KiB))
    assert cache.flush() == 2
    cache.close()
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)  # DRAM is empty: reads come from SSD
    assert cache.ssd is not None
    flip_byte(cache.ssd.store.env, b"bad", HEADER_SIZE + 1234)
    assert cache.get("bad") is None
    assert cache.get("good") == payload("good", 10 * KiB)
    s = cache.stats()
    assert s.checksum_failures == 1 and s.misses == 1 and s.hits_ssd == 1
    assert not cache.exists("bad")
    assert not cache.ssd.store.contains(b"bad")
    assert cache.get("bad") is None and cache.stats().checksum_failures == 1


def test_cache_reopen_after_clean_close_serves_flushed_blocks(
        make_cache: Callable[..., TieredCache], ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    keys = [f"p{i}" for i in range(20)]
    cache.batch_put(keys, [payload(k, 20 * KiB) for k in keys])
    assert cache.flush() == 20
    assert cache.flush() == 0  # nothing left without an SSD copy
    cache.close()
    cache = make_cache(ssd_path=ssd_dir)
    s = cache.stats()
    assert s.ssd_blocks == 20 and s.ssd_bytes == 20 * 20 * KiB and s.dram_blocks == 0
    assert cache.prefix_match(keys) == 20
    for k in keys:
        assert cache.get(k) == payload(k, 20 * KiB)
    assert cache.stats().hits_ssd == 20


def test_one_store_per_folder_and_a_forked_child_holds_none(tmp_path: Path) -> None:
    """A second store on a folder is refused, naming the holder; a forked child (an engine's helper
    process that never touches the store) does not keep the folder held once its parent closed it."""
    path = tmp_path / "lmdb"
    first = SsdStore(path, map_size=16 * MiB, sync=False)
    with pytest.raises(StorageError, match="in use by another cache of this process"):
        SsdStore(path, map_size=16 * MiB, sync=False)
    read, write = os.pipe()
    up, started = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        os.write(started, b"x")  # (after the fork handlers: the parent's lock is let go of by now)
        os.read(read, 1)
        os._exit(0)
    try:
        assert os.read(up, 1) == b"x"
        first.close()
        again = SsdStore(path, map_size=16 * MiB, sync=False)  # the child still lives
        again.close()
    finally:
        os.write(write, b"x")
        os.waitpid(child, 0)
        for fd in (read, write, up, started):
            os.close(fd)


def test_flush_keeps_each_transaction_within_its_byte_bound(make_cache: Callable[..., TieredCache], ssd_dir: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """LMDB holds a transaction's dirty pages in the writer's heap: a flush of big blocks commits every
    few MiB (here 3 MiB of pages: two 1 MiB blocks and their headers per transaction), not every 1024
    blocks (a stopping worker with 1 MiB blocks grew by 600 MiB)."""
    from kvpool.core import tier_moves

    monkeypatch.setattr(tier_moves, "_FLUSH_BATCH_BYTES", 3 * MiB)
    cache = make_cache(ssd_path=ssd_dir)
    keys = [f"big{i}" for i in range(10)]
    cache.batch_put(keys, [payload(k, MiB) for k in keys])
    batches: list[int] = []
    real = tier_moves.TierMoves.demote

    def demote(self: tier_moves.TierMoves, blocks: list[Any]) -> int:
        batches.append(sum(b.size for b in blocks))
        return real(self, blocks)
    monkeypatch.setattr(tier_moves.TierMoves, "demote", demote)
    assert cache.flush() == 10
    assert batches == [2 * MiB] * 5
    cache.close()
    cache = make_cache(ssd_path=ssd_dir)
    assert all(cache.get(k) == payload(k, MiB) for k in keys)


@pytest.mark.parametrize("size", [1 * KiB, 4 * KiB])
def test_small_blocks_are_trimmed_before_lmdb_is_full(size: int, tmp_path: Path) -> None:
    """A 4 KiB block and its header take two LMDB pages: counted by payload, the tier believed itself
    half full when LMDB refused every write, never trimmed, and dropped every later demotion while the
    oldest blocks stayed. Counted by what they take on disk, the oldest go first and none is dropped."""
    cache = TieredCache(dram_bytes=1 * MiB, dram_slab_size=256 * KiB, prefault=False, ssd_path=str(tmp_path / "s"),
                        ssd_map_size=8 * MiB, ssd_sync=False)
    try:
        keys = [f"k{i}" for i in range(6000)]
        for i in range(0, len(keys), 100):
            cache.batch_put(keys[i:i + 100], [payload(k, size) for k in keys[i:i + 100]])
        cache.flush()
        s = cache.stats()
        assert s.dropped == 0 and s.ssd_evictions > 0
        assert not any(cache.batch_exists(keys[:500])) and all(cache.batch_exists(keys[-500:]))
        assert cache.check() == []
    finally:
        cache.close()


def test_replaced_block_survives_flush_and_reopen(make_cache: Callable[..., TieredCache], ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    cache.put("k", b"version one")
    cache.flush()
    cache.put("k", b"version two")  # the SSD copy of version one is now stale
    cache.flush()
    cache.close()
    cache = make_cache(ssd_path=ssd_dir)
    assert cache.get("k") == b"version two"


def test_removed_block_stays_removed_after_reopen(make_cache: Callable[..., TieredCache], ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    cache.batch_put(["a", "b"], [b"A", b"B"])
    cache.flush()
    assert cache.remove("a") and not cache.remove("a")
    cache.close()
    cache = make_cache(ssd_path=ssd_dir)
    assert cache.get("a") is None and cache.get("b") == b"B"


def test_full_ssd_drops_demoted_blocks_cleanly(make_cache: Callable[..., TieredCache], ssd_dir: str) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir,
                       ssd_map_size=1 * MiB, ssd_sync=False)
    keys = [f"f{i}" for i in range(60)]
    for k in keys:
        cache.put(k, payload(k, 200 * KiB))
    s = cache.stats()
    assert s.dropped > 0 or s.ssd_evictions > 0
    hits = 0
    for k in keys:  # whatever is still there is exact; the rest is a clean miss
        got = cache.get(k)
        if got is not None:
            assert got == payload(k, 200 * KiB)
            hits += 1
    assert 0 < hits < len(keys)


def test_a_promotion_that_races_an_overwrite_never_brings_the_old_bytes_back(
        make_cache: Callable[..., TieredCache], ssd_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """K is only on SSD; a get promotes it, and while its SSD read runs (outside the lock) K is put
    anew, flushed and pushed out of DRAM: the promotion must not commit the old bytes it read."""
    size = 256 * KiB
    old, new = payload("old", size), payload("new", size)
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB, ssd_path=ssd_dir, ssd_sync=False)
    assert cache.ssd is not None

    def push_out(tag: str) -> None:
        for i in range(24):
            cache.put(f"fill/{tag}/{i}", bytes(size))
        cache.flush()

    cache.put("K", old)
    cache.flush()
    push_out("a")
    assert b"K" in cache.ssd and b"K" not in cache._stack.dram.blocks  # on SSD only: a get promotes it
    store, read = cache.ssd.store, SsdStore.read
    in_read, go_on = threading.Event(), threading.Event()

    def paused_read(self: SsdStore, key: bytes, sink: Any) -> Any:
        def pausing(meta: BlockMeta, view: memoryview) -> Any:
            if key == b"K" and threading.current_thread().name == "reader":
                in_read.set()
                go_on.wait(10)
            return sink(meta, view)
        return read(self, key, pausing)

    monkeypatch.setattr(store, "read", paused_read.__get__(store))
    got: list[bytes | None] = []
    reader = threading.Thread(target=lambda: got.append(cache.get("K")), name="reader")
    reader.start()
    assert in_read.wait(10)
    cache.put("K", new)  # acknowledged: from here on a read is `new` or a miss
    push_out("b")  # the new K goes to SSD and out of DRAM
    assert b"K" not in cache._stack.dram.blocks
    go_on.set()
    reader.join(10)
    assert got and got[0] in (old, new, None)  # the concurrent read may see either
    assert cache.get("K") == new
    assert cache.check() == []


def test_dropped_counts_the_blocks_a_full_ssd_tier_lost_and_no_others(make_cache: Callable[..., TieredCache],
                                                                      ssd_dir: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A demotion the SSD tier refuses loses only the blocks that are then evicted: a flush's blocks stay
    in DRAM, and a batch's blocks that are not evicted (only its victims are) stay too."""
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False)
    assert cache.ssd is not None

    def full(items: object) -> None:
        raise CapacityError("the SSD tier is full")
    monkeypatch.setattr(cache.ssd.store, "batch_put", full)
    cache.batch_put(["a", "b"], [payload("a", KiB), payload("b", KiB)])
    assert cache.flush() == 0
    assert cache.stats().dropped == 0 and cache.get("a") == payload("a", KiB)  # refused, still in DRAM
    keys = ["a", "b", *(f"f{i}" for i in range(40))]
    for k in keys[2:]:
        cache.put(k, payload(k, 200 * KiB))
    before = None
    for _ in range(100):  # until the demoter has settled
        s = cache.stats()
        if before is not None and (s.evictions, s.dropped) == (before.evictions, before.dropped):
            break
        before = s
        time.sleep(0.05)
    lost = [k for k, there in zip(keys, cache.batch_exists(keys)) if not there]
    assert lost and s.dropped == s.evictions == len(lost)

"""The cache's batch calls a worker serves a same-node batch with (one lock per batch): reserve_many,
commit_many, acquire_many, release_many, and the arena's alloc_many under them."""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core import TieredCache
from kvpool.core.blocks import checksum
from kvpool.core.errors import BlockTooLarge
from kvpool.core.tiers.dram import DramArena

from corehelp import KiB, MiB, payload


def _write(cache: TieredCache, keys: list[bytes], size: int) -> list[int]:
    """reserve_many, copy, commit_many: what the worker does for a same-node writer."""
    offsets = cache.reserve_many([size] * len(keys))
    assert None not in offsets
    slots = [off for off in offsets if off is not None]
    for k, off in zip(keys, slots):
        cache.arena.buf[off:off + size] = memoryview(payload(k, size))
    cache.commit_many(keys, slots, [size] * len(keys), [checksum(payload(k, size)) for k in keys])
    return slots


def test_alloc_many_hands_out_what_alloc_one_by_one_would() -> None:
    sizes = [300, 5 * KiB, 300, 200 * KiB, 1 * MiB, 300, 70 * KiB] * 3
    one, many = DramArena(8 * MiB, slab_size=1 * MiB, prefault=False), DramArena(8 * MiB, slab_size=1 * MiB,
                                                                                 prefault=False)
    try:
        assert many.alloc_many(sizes) == [one.alloc(n) for n in sizes]
        assert many.used_bytes == one.used_bytes and many.check() == []
        rest = many.alloc_many([1 * MiB] * 8)  # seven slabs are in use: one is left for a whole-slab block
        assert rest[0] is not None and rest[1:] == [None] * 7
        assert many.alloc_many([300])[0] is not None  # a partly used slab of that class still has room
    finally:
        one.close()
        many.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([300, 4 * KiB, 70 * KiB, 300 * KiB]), st.integers(1, 40),
                          st.integers(0, 30)), min_size=1, max_size=12))
def test_a_batch_of_one_size_takes_the_slots_single_allocs_would(steps: list[tuple[int, int, int]]) -> None:
    """A batch of one size class takes its slots a slab's free list at a time: the same slots, in the
    same order, as one alloc after another, across slabs filling up, new slabs, frees and a full arena."""
    one, many = (DramArena(4 * MiB, slab_size=1 * MiB, prefault=False) for _ in range(2))
    held: list[int] = []
    try:
        for size, count, frees in steps:
            got = many.alloc_many([size] * count)
            assert got == [one.alloc(size) for _ in range(count)]
            held += [off for off in got if off is not None]
            for off in held[:frees]:  # the oldest go back, emptying slabs now and then
                many.free(off)
                one.free(off)
            del held[:frees]
            assert many.used_bytes == one.used_bytes and many.check() == []
    finally:
        one.close()
        many.close()


def test_a_batch_committed_whole_reads_back_and_is_counted(make_cache: Callable[..., TieredCache]) -> None:
    cache = make_cache()
    keys = [f"k{i}".encode() for i in range(20)]
    _write(cache, keys, 16 * KiB)
    assert [cache.get(k) for k in keys] == [payload(k, 16 * KiB) for k in keys]
    assert cache.stats().puts == 20
    assert cache.check() == []


def test_acquire_many_leases_hits_and_gives_none_for_misses(make_cache: Callable[..., TieredCache]) -> None:
    cache = make_cache()
    keys = [f"k{i}".encode() for i in range(8)]
    _write(cache, keys, 64 * KiB)
    refs = cache.acquire_many([keys[0], b"absent", keys[7], keys[0]])
    assert refs[1] is None
    held = [r for r in refs if r is not None]
    assert [r.key for r in held] == [keys[0], keys[7], keys[0]]
    assert all(bytes(cache.arena.view(r.offset, r.size)) == payload(r.key, r.size) for r in held)
    used = cache.arena.used_bytes
    _write(cache, [keys[0]], 64 * KiB)  # replaced while leased: the old slot stays until released
    assert cache.arena.used_bytes > used
    cache.release_many(held)
    assert cache.arena.used_bytes == used
    assert cache.check() == []


def test_acquire_many_drops_expired_blocks_and_promotes_from_ssd(make_cache: Callable[..., TieredCache],
                                                                ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    cache.put("short", b"x" * 1000, ttl_s=0.05)
    cache.put("long", b"y" * 1000)
    cache.put("disk", b"z" * 1000)
    cache.flush()
    cache.batch_remove(["disk"])  # gone everywhere
    cache.put("disk", b"w" * 1000)
    cache.flush()
    cache._dram.drop(b"disk")  # only the SSD copy is left: acquire promotes it
    time.sleep(0.1)
    refs = cache.acquire_many([b"short", b"long", b"disk"])
    assert refs[0] is None
    assert refs[1] is not None and refs[2] is not None
    assert bytes(cache.arena.view(refs[2].offset, refs[2].size)) == b"w" * 1000
    cache.release_many([r for r in refs if r is not None])
    assert cache.check() == []


def test_reserve_many_gives_none_where_there_is_no_room(make_cache: Callable[..., TieredCache]) -> None:
    cache = make_cache(dram_bytes=4 * MiB)
    keys = [f"k{i}".encode() for i in range(4)]
    _write(cache, keys, 1 * MiB)
    refs = cache.acquire_many(keys)  # every block leased: nothing can be evicted
    try:
        assert cache.reserve_many([1 * MiB, 1 * MiB]) == [None, None]
    finally:
        cache.release_many([r for r in refs if r is not None])
    got = cache.reserve_many([1 * MiB])  # an unleased block is evicted to make room
    assert got[0] is not None
    cache.abort(got[0])
    with pytest.raises(BlockTooLarge):
        cache.reserve_many([100, 2 * MiB])
    with pytest.raises(BlockTooLarge):
        cache.reserve_many([-1])
    assert cache.check() == []


def test_a_batch_committed_at_once_counts_each_blocks_size_toward_its_tenant(
        make_cache: Callable[..., TieredCache]) -> None:
    from kvpool.core.tenants import Tenant, TenantUsage

    cache = make_cache()
    usage = TenantUsage({"a": Tenant("a", "t" * 16, 1 << 30)})
    cache.add_listener(usage)
    keys = [b"a/x", b"a/y", b"other"]
    sizes = [1000, 3000, 5000]
    offsets = [off for off in cache.reserve_many(sizes) if off is not None]
    usage.committing_many(dict(zip(keys, sizes)))  # what the worker sets around a same-node COMMIT
    try:
        cache.commit_many(keys, offsets, sizes, [0, 0, 0])
    finally:
        usage.committing_many(None)
    assert usage.used["a"] == 4000
    cache.batch_remove([b"a/x"])
    assert usage.used["a"] == 3000


def test_a_batch_that_replaces_blocks_frees_their_slots_or_leaves_them_to_their_leases(
        make_cache: Callable[..., TieredCache]) -> None:
    """commit_many over keys that hold blocks: an old block with a TTL stops being counted as one, a
    leased one keeps its bytes until its lease ends (its slot then goes back), the others' slots go back
    at once; the index, order and allocator stay consistent throughout."""
    cache = make_cache(dram_bytes=8 * MiB, dram_slab_size=1 * MiB)
    keys = [b"ttl", b"leased", b"plain"]
    cache.put(keys[0], payload(b"old-ttl", 64 * KiB), ttl_s=600)
    for k in keys[1:]:
        cache.put(k, payload(b"old-" + k, 64 * KiB))
    leased = cache.acquire(b"leased")
    assert leased is not None
    _write(cache, keys, 64 * KiB)
    assert cache.check() == []
    assert [cache.get(k) for k in keys] == [payload(k, 64 * KiB) for k in keys]
    assert bytes(cache.arena.buf[leased.offset:leased.offset + leased.size]) == payload(b"old-leased", 64 * KiB)
    assert cache.stats().dram_bytes == 4 * 64 * KiB  # three blocks, and the leased old one
    cache.release(leased)
    assert cache.stats().dram_bytes == 3 * 64 * KiB and cache.check() == []
    assert cache._dram.timed == 0

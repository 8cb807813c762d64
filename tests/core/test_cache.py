"""TieredCache behaviour: buffers, errors, eviction and promotion, leases, pins, TTLs, lookups."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvpool.core import BlockTooLarge, BufferSizeError, CapacityError, InvalidKey, PoolClosed, TieredCache, block_keys
from kvpool.core.blocks import BlockMeta, checksum
from kvpool.core.errors import InvalidArgument
from kvpool.core.stats import CacheStats
from kvpool.core.tiers import dram_tier

from corehelp import KiB, MiB, payload

Make = Callable[..., TieredCache]

# Synchronous eviction only (the background demoter never wakes below a 100% high watermark), for
# tests that assert an exact eviction order.
SYNC_EVICTION = dict(high_watermark=1.0, low_watermark=0.99)


def raw(buf: Any) -> bytes:
    """The bytes a buffer should be stored as (its C-order contents)."""
    if isinstance(buf, torch.Tensor):
        return buf.contiguous().view(torch.uint8).numpy().tobytes()
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).tobytes()
    return bytes(memoryview(buf).tobytes())


BUFFERS: dict[str, Callable[[], Any]] = {
    "bytes": lambda: payload("b", 1000),
    "empty bytes": lambda: b"",
    "bytearray": lambda: bytearray(payload("ba", 3000)),
    "memoryview": lambda: memoryview(payload("mv", 5000)),
    "memoryview int32 2d": lambda: memoryview(np.arange(60, dtype=np.int32).reshape(6, 10)),
    "strided memoryview": lambda: memoryview(payload("smv", 4000))[::3],
    "numpy uint8": lambda: np.frombuffer(payload("n", 7000), dtype=np.uint8).copy(),
    "numpy float16 3d": lambda: np.random.default_rng(1).standard_normal((4, 8, 16)).astype(np.float16),
    "numpy transposed": lambda: np.arange(600, dtype=np.int64).reshape(20, 30).T,
    "torch float32": lambda: torch.randn(33, 65, generator=torch.Generator().manual_seed(2)),
    "torch bf16": lambda: torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16),
    "torch int8 transposed": lambda: torch.arange(-60, 60, dtype=torch.int8).reshape(10, 12).T,
    "torch uint8": lambda: torch.frombuffer(bytearray(payload("t", 9000)), dtype=torch.uint8),
}


@pytest.mark.parametrize("name", list(BUFFERS))
def test_put_get_round_trip_of_every_buffer_type(make_cache: Make, name: str) -> None:
    cache = make_cache()
    buf = BUFFERS[name]()
    cache.put(name, buf)
    assert cache.get(name) == raw(buf)
    assert cache.exists(name)


DESTS: dict[str, Callable[[int], Any]] = {
    "bytearray": lambda n: bytearray(n),
    "memoryview": lambda n: memoryview(bytearray(n)),
    "numpy uint8": lambda n: np.zeros(n, dtype=np.uint8),
    "numpy float32 2d": lambda n: np.zeros((n // 4 // 8, 8), dtype=np.float32),
    "torch uint8": lambda n: torch.zeros(n, dtype=torch.uint8),
    "torch bf16": lambda n: torch.zeros(n // 2, dtype=torch.bfloat16),
    "torch float32 2d": lambda n: torch.zeros(n // 4 // 16, 16),
}


@pytest.mark.parametrize("name", list(DESTS))
def test_get_into_every_destination_type(make_cache: Make, name: str) -> None:
    cache = make_cache()
    src = torch.randn(64, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)  # 4096 bytes
    cache.put("k", src)
    dest = DESTS[name](4096)
    assert cache.get_into("k", dest) == 4096
    assert raw(dest) == raw(src)
    if isinstance(dest, torch.Tensor) and dest.dtype == torch.bfloat16:
        assert torch.equal(dest.view(64, 32), src)


def test_get_into_a_larger_buffer_returns_the_size_and_keeps_the_tail(make_cache: Make) -> None:
    cache = make_cache()
    cache.put("k", b"abc")
    dest = bytearray(b"\xff" * 10)
    assert cache.get_into("k", dest) == 3
    assert dest == b"abc" + b"\xff" * 7


def test_get_into_a_smaller_buffer_names_both_sizes(make_cache: Make) -> None:
    cache = make_cache()
    cache.put("k", b"x" * 1000)
    dest = bytearray(999)
    with pytest.raises(BufferSizeError) as err:
        cache.get_into("k", dest)
    assert "1000" in str(err.value) and "999" in str(err.value)
    assert dest == bytearray(999)
    with pytest.raises(BufferSizeError, match="1000.*400"):
        cache.get_into("k", torch.zeros(100, dtype=torch.float32))
    assert cache.get("k") == b"x" * 1000  # the failed read released its lease
    cache.put("k", b"y" * 10)  # and the block is replaceable
    assert cache.get("k") == b"y" * 10


def test_unusable_destinations_are_refused(make_cache: Make) -> None:
    cache = make_cache()
    cache.put("k", b"x" * 16)
    with pytest.raises(BufferSizeError, match="read-only"):
        cache.get_into("k", b"\0" * 16)
    with pytest.raises(BufferSizeError, match="contiguous"):
        cache.get_into("k", np.zeros((8, 8), dtype=np.uint8).T)
    with pytest.raises(BufferSizeError, match="contiguous"):
        cache.get_into("k", torch.zeros(8, 8, dtype=torch.uint8).T)
    with pytest.raises(BufferSizeError, match="contiguous"):
        cache.get_into("k", memoryview(np.zeros(64, dtype=np.int32))[::2])


def test_misses(make_cache: Make) -> None:
    cache = make_cache()
    dest = bytearray(b"\x01" * 8)
    assert cache.get("nope") is None
    assert cache.get_into("nope", dest) == -1 and dest == b"\x01" * 8
    with cache.lease("nope") as view:
        assert view is None
    assert not cache.exists("nope") and not cache.remove("nope")
    assert cache.stats().misses == 3


def test_batch_operations(make_cache: Make) -> None:
    cache = make_cache()
    keys = [f"k{i}" for i in range(10)]
    cache.batch_put(keys, [payload(k, 100 * i) for i, k in enumerate(keys)])
    probe = ["k3", "zz", "k0", "k9"]
    dests = [bytearray(2000) for _ in probe]
    assert cache.batch_get_into(probe, dests) == [300, -1, 0, 900]
    assert dests[0][:300] == payload("k3", 300) and dests[3][:900] == payload("k9", 900)
    assert dests[1] == bytearray(2000)
    assert cache.batch_exists(probe) == [True, False, True, True]
    assert cache.batch_remove(["k3", "zz", "k3"]) == [True, False, False]
    assert cache.batch_exists(["k3", "k4"]) == [False, True]
    s = cache.stats()
    assert s.puts == 10 and s.dram_blocks == 9 and s.hits_dram == 3 and s.misses == 1
    with pytest.raises(InvalidArgument, match="2 keys but 1 buffers"):
        cache.batch_put(["a", "b"], [b"x"])
    with pytest.raises(InvalidArgument, match="1 keys but 2 buffers"):
        cache.batch_get_into(["a"], [bytearray(1), bytearray(1)])


def test_block_too_large_names_size_and_limit(make_cache: Make) -> None:
    cache = make_cache(dram_slab_size=1 * MiB)
    assert cache.max_block == 1 * MiB
    cache.put("max", b"m" * MiB)  # exactly the limit is fine
    with pytest.raises(BlockTooLarge) as err:
        cache.put("big", b"b" * (MiB + 1))
    assert str(MiB + 1) in str(err.value) and str(MiB) in str(err.value)
    assert (err.value.key, err.value.size, err.value.limit) == (b"big", MiB + 1, MiB)
    assert not cache.exists("big")
    assert cache.get("max") == b"m" * MiB


def test_batch_with_one_bad_item_writes_nothing(make_cache: Make) -> None:
    cache = make_cache()
    cache.put("old", b"old")
    with pytest.raises(InvalidKey):
        cache.batch_put(["a", "", "b"], [b"1", b"2", b"3"])
    with pytest.raises(InvalidKey):
        cache.batch_put(["a", "x" * 600], [b"1", b"2"])
    with pytest.raises(BlockTooLarge):
        cache.batch_put(["a", "old", "c"], [b"1", b"new", b"z" * (cache.max_block + 1)])
    assert cache.batch_exists(["a", "b", "c"]) == [False, False, False]
    assert cache.get("old") == b"old"
    s = cache.stats()
    assert s.puts == 1 and s.dram_blocks == 1


def test_closed_cache_raises_pool_closed(make_cache: Make) -> None:
    cache = make_cache()
    cache.put("k", b"v")
    name = cache.arena.name
    cache.close()
    cache.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{name}")
    calls: list[Callable[[], object]] = [
        lambda: cache.put("k", b"v"), lambda: cache.get("k"), lambda: cache.get_into("k", bytearray(1)),
        lambda: cache.exists("k"), lambda: cache.prefix_match(["k"]), lambda: cache.remove("k"),
        lambda: cache.clear(), lambda: cache.pin("k", 1), lambda: cache.lease("k").__enter__(),
        lambda: cache.batch_put(["k"], [b"v"]), lambda: cache.batch_get_into(["k"], [bytearray(1)]),
        lambda: cache.batch_pin(["k"], 1), lambda: cache.batch_lease(["k"]).__enter__(), cache.check,
    ]
    for call in calls:
        with pytest.raises(PoolClosed):
            call()


def test_context_manager_closes(make_cache: Make) -> None:
    with make_cache() as cache:
        cache.put("k", b"v")
    with pytest.raises(PoolClosed):
        cache.get("k")


# ----- eviction, demotion, promotion --------------------------------------------------------------


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_eviction_demotes_to_ssd_and_a_hit_promotes_back(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False)
    keys = [f"e{i}" for i in range(48)]  # 12 MiB through a 4 MiB arena
    for k in keys:
        cache.put(k, payload(k, 256 * KiB))
    s = cache.stats()
    assert s.evictions > 0 and s.demotions >= s.evictions - s.dram_blocks
    assert s.dram_bytes <= s.dram_capacity == 4 * MiB
    assert s.dram_blocks + s.ssd_blocks >= len(keys)
    assert cache.ssd is not None and cache.ssd.store.contains(b"e0")
    before = cache.stats()
    assert cache.get("e0") == payload("e0", 256 * KiB)  # long gone from DRAM
    after = cache.stats()
    assert after.hits_ssd == before.hits_ssd + 1
    assert after.promotions == before.promotions + 1
    assert cache.get("e0") == payload("e0", 256 * KiB)  # now a DRAM hit
    assert cache.stats().hits_dram == after.hits_dram + 1
    for k in keys:  # nothing was lost on the way down and up
        assert cache.get(k) == payload(k, 256 * KiB)
    assert cache.stats().misses == 0


def test_background_demoter_keeps_dram_under_the_high_watermark(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(dram_bytes=8 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False,
                       high_watermark=0.5, low_watermark=0.25)
    for i in range(24):  # 6 MiB: above the high watermark, below capacity
        cache.put(f"w{i}", payload(f"w{i}", 256 * KiB))
    wait_for(lambda: cache.stats().dram_bytes <= 0.5 * 8 * MiB)
    s = cache.stats()
    assert s.demotions > 0 and s.evictions > 0
    for i in range(24):
        assert cache.get(f"w{i}") == payload(f"w{i}", 256 * KiB)


def test_without_ssd_eviction_drops(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB)
    keys = [f"d{i}" for i in range(40)]
    for k in keys:
        cache.put(k, payload(k, 200 * KiB))
    s = cache.stats()
    assert s.evictions > 0 and s.demotions == 0 and s.ssd_blocks == 0
    assert s.dram_blocks + s.evictions == len(keys)
    assert cache.get("d0") is None
    assert cache.get(keys[-1]) == payload(keys[-1], 200 * KiB)
    present = [k for k in keys if cache.exists(k)]
    assert len(present) == cache.stats().dram_blocks
    assert present == keys[-len(present):]  # the oldest went first


@pytest.mark.parametrize("policy, survivor", [("lru", "k0"), ("fifo", "k1")])
def test_eviction_order_follows_the_policy(make_cache: Make, policy: str, survivor: str) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, policy=policy, **SYNC_EVICTION)
    for i in range(4):  # one 1 MiB slot per slab: the arena is full
        cache.put(f"k{i}", payload(f"k{i}", MiB))
    assert cache.get("k0") is not None  # k0 is now the most recently used under LRU
    cache.put("k4", payload("k4", MiB))
    present = cache.batch_exists(["k0", "k1", "k2", "k3", "k4"])
    assert present.count(False) == 1
    assert cache.exists(survivor)
    evicted = "k1" if policy == "lru" else "k0"
    assert not cache.exists(evicted)


def test_recently_read_blocks_survive_streaming_puts(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=8 * MiB, dram_slab_size=1 * MiB)
    hot = [f"hot{i}" for i in range(4)]
    for k in hot:
        cache.put(k, payload(k, 128 * KiB))
    for i in range(200):  # 25 MiB of cold blocks stream through an 8 MiB arena
        cache.put(f"cold{i}", payload(f"cold{i}", 128 * KiB))
        for k in hot:
            assert cache.get(k) == payload(k, 128 * KiB)
    assert cache.stats().evictions > 100


def test_eviction_frees_a_slab_for_another_size_class(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, **SYNC_EVICTION)
    for i in range(64):  # 64 KiB blocks fill every slab
        cache.put(f"s{i}", payload(f"s{i}", 64 * KiB))
    cache.put("big", payload("big", 900 * KiB))  # needs a whole empty slab
    assert cache.get("big") == payload("big", 900 * KiB)
    assert cache.stats().evictions == 16  # exactly one slab's worth, the least recently used
    assert not any(cache.batch_exists([f"s{i}" for i in range(16)]))
    assert all(cache.batch_exists([f"s{i}" for i in range(16, 64)]))


def test_a_size_class_with_only_recent_blocks_takes_the_oldest_slab_of_another(
        make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room is looked for among the least recently used blocks only (`dram_tier.SCAN`, cut to 16 here):
    a big block whose own class holds only a recent block takes the oldest slab of small blocks, as a
    whole-cache LRU would, rather than walk every block to evict that recent one (with millions of
    blocks the walk held the cache's lock for most of a second, once per slab). Where the oldest
    blocks give no room (pinned), every block is looked at, as before."""
    monkeypatch.setattr(dram_tier, "SCAN", 16)
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, **SYNC_EVICTION)
    for i in range(16):  # slab 0: the oldest blocks
        cache.put(f"old{i}", payload(f"old{i}", 64 * KiB))
    cache.put("big0", payload("big0", 900 * KiB))  # slab 1
    for i in range(32):  # slabs 2 and 3: the arena is full
        cache.put(f"new{i}", payload(f"new{i}", 64 * KiB))
    cache.put("big1", payload("big1", 900 * KiB))
    assert cache.get("big0") == payload("big0", 900 * KiB) and cache.get("big1") == payload("big1", 900 * KiB)
    assert not any(cache.batch_exists([f"old{i}" for i in range(16)]))
    assert all(cache.batch_exists([f"new{i}" for i in range(32)]))
    assert cache.stats().evictions == 16 and cache.check() == []
    cache.batch_pin([f"new{i}" for i in range(32)], 60)  # now the 16 oldest are pinned: all are looked at
    cache.put("big2", payload("big2", 900 * KiB))
    assert cache.batch_exists(["big0", "big1", "big2"]) == [False, True, True]  # the oldest of its class
    assert cache.check() == []


def test_pinned_blocks_at_the_head_of_the_order_do_not_send_the_search_for_room_over_every_block(
        make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window is of evictable blocks: pins on the oldest blocks (pins do not refresh recency) leave
    it the next oldest slab, not a walk over every block that ends at the class's own recent block."""
    monkeypatch.setattr(dram_tier, "SCAN", 16)
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, **SYNC_EVICTION)
    for i in range(16):  # slab 0: the oldest blocks, pinned
        cache.put(f"old{i}", payload(f"old{i}", 64 * KiB), pin_s=60)
    cache.put("big0", payload("big0", 900 * KiB))  # slab 1
    for i in range(32):  # slabs 2 and 3
        cache.put(f"new{i}", payload(f"new{i}", 64 * KiB))
    assert cache.get("big0") == payload("big0", 900 * KiB)  # now the most recently used
    cache.put("big1", payload("big1", 900 * KiB))
    assert cache.batch_exists(["big0", "big1"]) == [True, True]
    assert cache.batch_exists([f"old{i}" for i in range(16)]) == [True] * 16
    assert not any(cache.batch_exists([f"new{i}" for i in range(16)]))  # slab 2, the oldest evictable
    assert all(cache.batch_exists([f"new{i}" for i in range(16, 32)])) and cache.check() == []


# ----- leases and pins ----------------------------------------------------------------------------


def test_leased_block_is_neither_evicted_nor_freed_under_pressure(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB)
    data = payload("leased", 256 * KiB)
    cache.put("leased", data)
    with cache.lease("leased") as view:
        assert view is not None and view.readonly
        for i in range(100):  # 25x the arena
            cache.put(f"p{i}", payload(f"p{i}", 256 * KiB))
            assert cache.exists("leased")
        assert view == data
        assert cache.get("leased") == data
    assert cache.stats().evictions > 80


def test_replacing_a_leased_block_keeps_the_leased_bytes(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB)
    old, new = payload("old", 300 * KiB), payload("new", 300 * KiB)
    cache.put("k", old)
    with cache.lease("k") as view:
        assert view is not None
        cache.put("k", new)
        assert cache.get("k") == new
        for i in range(60):  # pressure must not reuse the old slot while it is leased
            cache.put(f"p{i}", payload(f"p{i}", 300 * KiB))
        assert view == old
        cache.put("k", new)
    assert cache.get("k") == new


def test_removing_a_leased_block_frees_it_when_the_lease_ends(make_cache: Make) -> None:
    cache = make_cache()
    cache.put("k", b"z" * 5000)
    with cache.lease("k") as view:
        assert cache.remove("k")
        assert cache.get("k") is None and not cache.exists("k")
        assert view == b"z" * 5000
        assert cache.stats().dram_bytes > 0 and cache.stats().dram_leases == 1  # the slot is still held
        assert cache.check() == []
    assert cache.stats().dram_bytes == 0 and cache.stats().dram_leases == 0


def test_batch_lease_holds_every_block_until_it_ends(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB)
    cache.batch_put(["a", "b"], [payload("a", 256 * KiB), payload("b", 256 * KiB)])
    with cache.batch_lease(["a", "missing", "b"]) as views:
        assert [None if v is None else bytes(v) for v in views] == [payload("a", 256 * KiB), None,
                                                                     payload("b", 256 * KiB)]
        assert all(v is None or v.readonly for v in views)
        for i in range(40):  # 10x the arena: the leased blocks stay
            cache.put(f"p{i}", payload(f"p{i}", 256 * KiB))
        assert bytes(views[0] or b"") == payload("a", 256 * KiB) and cache.stats().dram_leases == 2
    assert cache.stats().dram_leases == 0


def test_clear_while_leased(make_cache: Make) -> None:
    cache = make_cache()
    cache.put("k", b"q" * 100)
    with cache.lease("k") as view:
        cache.clear()
        assert view == b"q" * 100
    s = cache.stats()
    assert s.dram_bytes == 0 and s.dram_blocks == 0


def test_pin_prevents_eviction(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB)
    cache.put("pinned", payload("pinned", 200 * KiB), pin_s=60)
    cache.put("later", payload("later", 200 * KiB))
    cache.pin("later", 60)
    cache.pin("absent", 60)  # no block yet: the pin waits for one
    s = cache.stats()
    assert (s.pins, s.pending_pins, s.pins_refused) == (3, 1, 0)
    for i in range(80):
        cache.put(f"p{i}", payload(f"p{i}", 200 * KiB))
    assert cache.get("pinned") == payload("pinned", 200 * KiB)
    assert cache.get("later") == payload("later", 200 * KiB)
    cache.pin("later", 0)
    for i in range(80, 160):
        cache.put(f"p{i}", payload(f"p{i}", 200 * KiB))
    assert not cache.exists("later") and cache.exists("pinned")


def test_capacity_error_when_everything_is_pinned(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB)
    n = 0
    with pytest.raises(CapacityError) as err:
        while n < 100:
            cache.put(f"p{n}", payload(f"p{n}", 512 * KiB), pin_s=60)
            n += 1
    assert n == 8  # two 512 KiB slots per 1 MiB slab
    assert str(4 * MiB) in str(err.value) and (err.value.size, err.value.limit) == (512 * KiB, 4 * MiB)
    assert not cache.exists(f"p{n}")  # the failed put stored nothing
    with pytest.raises(CapacityError):
        cache.put("small", b"s" * 100)
    for i in range(n):
        assert cache.get(f"p{i}") == payload(f"p{i}", 512 * KiB)
    assert cache.remove("p0")
    cache.put("fits", payload("fits", 512 * KiB))
    cache.pin("p1", 0)
    cache.put("evicts p1", payload("x", 512 * KiB))
    assert not cache.exists("p1")


def test_an_ssd_hit_is_a_miss_not_an_error_when_dram_is_all_pinned(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, **SYNC_EVICTION)
    cache.put("cold", payload("cold", 512 * KiB))
    cache.flush()
    for i in range(8):  # evicts "cold" (it stays on SSD) and leaves no evictable slot
        cache.put(f"p{i}", payload(f"p{i}", 512 * KiB), pin_s=60)
    assert cache.exists("cold")
    assert cache.get("cold") is None  # promotion has no room: a miss
    cache.pin("p0", 0)
    assert cache.get("cold") == payload("cold", 512 * KiB)


def test_a_put_during_promotion_is_not_replaced_by_the_older_ssd_copy(make_cache: Make, ssd_dir: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(ssd_path=ssd_dir, **SYNC_EVICTION)
    cache.put("k", payload("old", 1000))
    cache.flush()
    cache.close()
    cache = make_cache(ssd_path=ssd_dir, **SYNC_EVICTION)  # a restart: only the SSD copy is left
    assert cache.ssd is not None
    read = cache.ssd.store.read

    def read_then_put(key: bytes, into: Any) -> Any:  # a writer replaces k while a reader promotes it
        meta = read(key, into)
        cache.put("k", payload("new", 1000))
        return meta

    monkeypatch.setattr(cache.ssd.store, "read", read_then_put)
    assert cache.get("k") == payload("new", 1000)
    monkeypatch.undo()
    assert cache.get("k") == payload("new", 1000)


def test_demoter_does_not_spin_when_nothing_is_evictable(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB)
    for i in range(8):  # 100% full, above the high watermark, all pinned
        cache.put(f"p{i}", payload(f"p{i}", 512 * KiB), pin_s=60)
    start = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - start < 0.3, "the background demoter is busy-waiting"
    for i in range(8):
        cache.pin(f"p{i}", 0)
    cache.put("next", b"n")  # the next commit wakes it, and it gets back under the watermark
    wait_for(lambda: cache.stats().dram_bytes <= 0.95 * 4 * MiB)


def test_a_pinned_block_does_not_block_eviction_elsewhere(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, **SYNC_EVICTION)
    for i in range(16):  # 256 KiB blocks: four per slab, every slab full
        cache.put(f"s{i}", payload(f"s{i}", 256 * KiB))
    cache.pin("s0", 60)  # the least recently used slab now holds a pinned block
    cache.put("big", payload("big", 700 * KiB))  # another class: needs a whole slab
    assert cache.get("big") == payload("big", 700 * KiB)
    assert cache.get("s0") == payload("s0", 256 * KiB)


# ----- TTL, lookups, removal --------------------------------------------------------------------


def test_ttl_expiry_is_a_miss(make_cache: Make) -> None:
    cache = make_cache()
    cache.put("short", b"s", ttl_s=0.2)
    cache.put("long", b"l", ttl_s=60)
    cache.put("forever", b"f")
    assert cache.get("short") == b"s"
    time.sleep(0.3)
    assert cache.get("short") is None
    assert cache.batch_exists(["short", "long", "forever"]) == [False, True, True]
    assert cache.prefix_match(["long", "short", "forever"]) == 1
    assert cache.get_into("short", bytearray(1)) == -1
    assert cache.get("long") == b"l"
    assert cache.stats().dram_blocks == 2


def test_ttl_expiry_is_a_miss_on_ssd_too(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)
    cache.put("in dram", b"d", ttl_s=0.2)
    cache.put("on ssd", b"s", ttl_s=0.2)
    cache.put("kept", b"k", ttl_s=60)
    cache.flush()
    cache.close()
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)
    assert cache.get("in dram") == b"d"  # promoted: now in DRAM with an SSD copy
    time.sleep(0.3)
    assert cache.batch_exists(["in dram", "on ssd", "kept"]) == [False, False, True]
    assert cache.prefix_match(["kept", "on ssd"]) == 1
    assert cache.get("in dram") is None and cache.get("on ssd") is None
    assert cache.get("kept") == b"k"
    assert cache.stats().ssd_blocks == 1


def test_prefix_match_and_batch_exists_on_a_key_chain(make_cache: Make) -> None:
    cache = make_cache()
    tokens = list(range(64))
    keys = block_keys(tokens, 8, namespace="m")
    cache.batch_put(keys[:5], [payload(k, 1000) for k in keys[:5]])
    assert cache.prefix_match(keys) == 5
    assert cache.prefix_match(keys[:3]) == 3
    assert cache.prefix_match([]) == 0
    cache.remove(keys[2])
    assert cache.prefix_match(keys) == 2
    assert cache.batch_exists(keys) == [True, True, False, True, True, False, False, False]
    other = block_keys(tokens[:16] + [999] * 48, 8, namespace="m")  # shares two full blocks
    assert cache.prefix_match(other) == 2
    assert cache.prefix_match(block_keys(tokens, 8, namespace="other model")) == 0


def test_remove_and_clear(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)
    keys = [f"r{i}" for i in range(10)]
    cache.batch_put(keys, [payload(k, 10 * KiB) for k in keys])
    cache.flush()
    assert cache.remove("r0") and not cache.remove("r0")
    assert cache.get("r0") is None
    assert cache.stats().ssd_blocks == 9
    cache.clear()
    s = cache.stats()
    assert (s.dram_blocks, s.dram_bytes, s.ssd_blocks, s.ssd_bytes) == (0, 0, 0, 0)
    assert not any(cache.batch_exists(keys))
    assert cache.ssd is not None and list(cache.ssd.store.scan()) == []
    cache.put("r1", b"again")
    assert cache.get("r1") == b"again"


def test_clear_of_a_prefix_leaves_other_namespaces(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)
    mine, theirs = [f"m1/{i}" for i in range(6)], [f"m2/{i}" for i in range(6)] + ["m1", "x/m1/0"]
    cache.batch_put(mine + theirs, [payload(k, 10 * KiB) for k in mine + theirs])
    cache.flush()
    cache.remove("m1/0")  # DRAM and SSD hold the others: both tiers are searched
    cache.clear("m1/")
    assert not any(cache.batch_exists(mine)) and all(cache.batch_exists(theirs))
    assert all(cache.get(k) == payload(k, 10 * KiB) for k in theirs)
    assert cache.ssd is not None and sorted(k for k, _ in cache.ssd.store.scan()) == sorted(k.encode() for k in theirs)


def test_a_prefix_clear_picks_its_keys_without_the_lock(make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clear of a prefix goes through every key the cache holds: it does that without the cache's lock (a
    tenant's repeated clears stalled every other request), and a put made meanwhile under the prefix, newer
    than the clear, stays."""
    import threading

    from kvpool.core import cache as cache_module

    cache = make_cache()
    cache.batch_put([f"t/{i}" for i in range(50)] + ["u/0"], [payload(str(i), KiB) for i in range(51)])
    real = cache_module.with_prefix
    during: list[bool] = []

    def picking(key_lists: list[list[bytes]], prefix: bytes) -> list[bytes]:
        other = threading.Thread(target=lambda: cache.put("t/0", payload("new", KiB)))  # (a key being cleared)
        other.start()
        other.join(timeout=5)
        during.append(not other.is_alive())  # the put went through: the lock was free
        return real(key_lists, prefix)

    monkeypatch.setattr(cache_module, "with_prefix", picking)
    cache.clear("t/")
    assert during == [True]
    assert not any(cache.batch_exists([f"t/{i}" for i in range(1, 50)]))
    assert cache.get("t/0") == payload("new", KiB) and cache.exists("u/0")


def test_replace_updates_every_tier(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False)
    cache.put("k", payload("v1", 100 * KiB))
    cache.flush()  # v1 is on SSD
    cache.put("k", payload("v2", 256 * KiB))
    for i in range(40):  # push v2 out of DRAM (same size class as the filler)
        cache.put(f"p{i}", payload(f"p{i}", 256 * KiB))
    assert cache.stats().hits_ssd == 0
    assert cache.get("k") == payload("v2", 256 * KiB)
    assert cache.stats().hits_ssd == 1  # it came back from SSD, and it is v2
    for i in range(40):
        cache.put(f"q{i}", payload(f"q{i}", 256 * KiB))
    cache.close()
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir)
    assert cache.get("k") == payload("v2", 256 * KiB)


def test_unflushed_replacement_is_lost_on_close_but_never_reverts(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)
    cache.put("k", b"v1")
    cache.flush()
    cache.put("k", b"v2")  # only in DRAM; close() does not flush
    cache.close()
    cache = make_cache(ssd_path=ssd_dir)
    assert cache.get("k") is None  # lost, as documented, but the stale v1 is not served


def test_verify_dram_reads_turns_corrupt_dram_into_a_miss(make_cache: Make) -> None:
    cache = make_cache(verify_dram_reads=True)
    for k in ("a", "b", "c"):
        cache.put(k, payload(k, 4096))
    for k in ("a", "b", "c"):
        rot(cache, k, 100)
    assert len(cache.check()) == 3  # check() reads every block
    assert cache.get_into("a", bytearray(4096)) == -1
    assert cache.get("b") is None
    with cache.lease("c") as view:
        assert view is None
    s = cache.stats()
    assert s.checksum_failures == 3 and s.dram_blocks == 0
    assert cache.check() == []


def rot(cache: TieredCache, key: str, at: int) -> None:
    """Flip a byte of `key`'s block in the arena (bit rot), through the slot protocol."""
    ref = cache.acquire(key)
    assert ref is not None
    try:
        cache.arena.buf[ref.offset + at] ^= 0xFF
    finally:
        cache.release(ref)


def test_stats_are_consistent(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False)
    for i in range(30):
        cache.put(f"s{i}", payload(f"s{i}", 100 * KiB * (1 + i % 3)))
    cache.flush()
    s = cache.stats()
    assert cache.check() == []  # the indexes agree with the arena and with LMDB
    assert s.puts == 30 and s.dram_blocks + s.evictions == 30
    assert cache.ssd is not None
    assert s.ssd_blocks == len(list(cache.ssd.store.scan()))
    assert s.ssd_bytes == sum(meta.size for _, meta in cache.ssd.store.scan())
    assert s.dram_bytes <= s.dram_capacity
    assert CacheStats.from_dict({**s.as_dict(), "from_a_newer_worker": 1}) == s


def test_check_reports_what_disagrees(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)
    cache.batch_put(["a", "b", "c"], [payload(k, 10 * KiB) for k in "abc"])
    cache.flush()
    assert cache.check() == []
    rot(cache, "a", 5)
    assert cache.ssd is not None
    cache.ssd.store.delete([b"b"])  # LMDB lost an indexed block
    cache.ssd.store.batch_put([(b"orphan", BlockMeta(1, checksum(b"o")), memoryview(b"o"))])
    errors = cache.check()
    assert len(errors) == 4, errors  # a's bytes; a's SSD copy differs from them; b; the orphan
    assert any("'a'" in e and "checksum" in e for e in errors)
    assert any("'b'" in e and "LMDB does not hold it" in e for e in errors)
    assert any("orphan" in e for e in errors)


def test_pinned_blocks_spread_over_every_slab_do_not_refuse_puts(make_cache: Make) -> None:
    """One pinned 4 KiB block per slab (a tiny share of DRAM) used to make every larger put fail."""
    cache = make_cache(dram_bytes=8 * MiB, dram_slab_size=1 * MiB)
    per_slab = MiB // (4 * KiB)
    keys = [f"s{i}" for i in range(6 * per_slab)]  # six slabs of 4 KiB blocks, the first of each pinned
    for i, k in enumerate(keys):
        cache.put(k, payload(k, 4 * KiB), pin_s=60 if i % per_slab == 0 else 0)
    pinned = keys[::per_slab]
    for i in range(6):  # pinned 1 MiB blocks take whole slabs: two are free, then every slab holds a pin
        cache.put(f"big{i}", payload(f"big{i}", MiB), pin_s=60)
    assert all(cache.get(f"big{i}") == payload(f"big{i}", MiB) for i in range(6))
    assert all(cache.get(k) == payload(k, 4 * KiB) for k in pinned), "a moved pinned block changed"
    assert cache.stats().relocations >= 4

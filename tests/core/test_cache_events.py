"""A CacheListener hears every block that enters, moves within or leaves a TieredCache: replaying its
events gives exactly what the cache holds, per tier, under any mix of puts, removes, evictions,
demotions, promotions, TTL expiry and clear."""
from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from kvpool.core import TieredCache
from kvpool.core.cache_events import REASONS, CacheListener

from corehelp import KiB, MiB, payload

Make = Callable[..., TieredCache]


class Recorder(CacheListener):
    """Every call as a tuple, and the per-tier model they describe."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.tiers: dict[bytes, set[str]] = {}

    def stored(self, key: bytes, tier: str) -> None:
        self.calls.append(("stored", key.decode(), tier))
        self.tiers[key] = {tier}  # new bytes: older copies elsewhere went with the old block

    def copied(self, key: bytes, tier: str) -> None:
        self.calls.append(("copied", key.decode(), tier))
        assert key in self.tiers, f"copy of {key!r}, which the cache never announced"
        self.tiers[key].add(tier)

    def dropped(self, key: bytes, tier: str, reason: str) -> None:
        self.calls.append(("dropped", key.decode(), tier, reason))
        assert reason in REASONS and tier in self.tiers[key] and len(self.tiers[key]) > 1
        self.tiers[key].discard(tier)

    def removed(self, key: bytes, tier: str, reason: str) -> None:
        self.calls.append(("removed", key.decode(), tier, reason))
        assert reason in REASONS and self.tiers.pop(key) == {tier}

    def cleared(self) -> None:
        self.calls.append(("cleared",))
        self.tiers.clear()

    def kinds(self, key: str) -> list[str]:
        return [c[0] for c in self.calls if len(c) > 1 and c[1] == key]


def _held(cache: TieredCache) -> dict[bytes, set[str]]:
    """What the cache holds per tier, as a fresh listener's replay tells it (read under the cache's
    lock: the demoter runs meanwhile)."""
    rec = Recorder()
    cache.add_listener(rec, replay=True)
    cache.remove_listener(rec)
    return rec.tiers


def _listen(cache: TieredCache) -> Recorder:
    rec = Recorder()
    cache.add_listener(rec)
    return rec


def test_put_replace_remove_and_clear(make_cache: Make) -> None:
    cache = make_cache()
    rec = _listen(cache)
    cache.put("a", b"1")
    cache.put("a", b"2")  # a replacement is a store, never a removal
    cache.put("b", b"3")
    assert cache.remove("a") and not cache.remove("a")
    cache.clear()
    assert rec.calls == [("stored", "a", "dram"), ("stored", "a", "dram"), ("stored", "b", "dram"),
                         ("removed", "a", "dram", "remove"), ("cleared",)]
    cache.remove_listener(rec)
    cache.put("c", b"4")
    assert rec.calls[-1] == ("cleared",)


def test_eviction_without_ssd_removes(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB)
    rec = _listen(cache)
    keys = [f"d{i}" for i in range(40)]
    for k in keys:
        cache.put(k, payload(k, 200 * KiB))
    evicted = [c[1] for c in rec.calls if c[0] == "removed"]
    assert evicted and all(c[3] == "evict" for c in rec.calls if c[0] == "removed")
    assert len(evicted) == cache.stats().evictions
    assert sorted(evicted) == sorted(k for k in keys if not cache.exists(k))
    assert rec.tiers == _held(cache)


def test_demotion_is_a_copy_then_a_drop_and_promotion_a_copy(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False)
    rec = _listen(cache)
    for i in range(48):  # 12 MiB through a 4 MiB arena
        cache.put(f"e{i}", payload(f"e{i}", 256 * KiB))
    assert rec.kinds("e0") == ["stored", "copied", "dropped"]  # down to SSD, still in the pool
    assert not [c for c in rec.calls if c[0] == "removed"]
    assert cache.get("e0") == payload("e0", 256 * KiB)
    assert ("copied", "e0", "dram") in rec.calls  # promoted: a DRAM copy beside the SSD one
    assert rec.tiers == _held(cache)
    assert cache.remove("e0")
    assert rec.kinds("e0")[-2:] == ["dropped", "removed"]  # its DRAM copy, then its last (SSD) copy
    assert rec.tiers == _held(cache)


def test_ssd_eviction_removes_what_only_ssd_held(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False,
                       ssd_map_size=8 * MiB)
    rec = _listen(cache)
    for i in range(80):  # 20 MiB through 4 MiB of DRAM and an SSD tier that keeps about 5 MiB
        cache.put(f"s{i}", payload(f"s{i}", 256 * KiB))
    gone = [c for c in rec.calls if c[0] == "removed"]
    assert {c[3] for c in gone} == {"evict"} and ("ssd", "evict") in {(c[2], c[3]) for c in gone}
    assert rec.tiers == _held(cache)


def test_expiry_removes(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)
    rec = _listen(cache)
    cache.put("t", b"x" * 100, ttl_s=0.05)
    cache.put("u", b"y" * 100, ttl_s=0.05)
    cache.flush()  # "u" also on SSD: both copies expire
    time.sleep(0.1)
    assert not cache.exists("t") and cache.get("u") is None
    assert rec.kinds("t")[0] == "stored" and rec.kinds("t")[-1] == "removed"
    assert [c[3] for c in rec.calls if c[0] in ("dropped", "removed")] == ["expire"] * 4
    assert rec.tiers == {}


def test_corrupt_dram_read_removes(make_cache: Make) -> None:
    cache = make_cache(verify_dram_reads=True)
    rec = _listen(cache)
    cache.put("c", b"z" * 4096)
    ref = cache.acquire("c")
    assert ref is not None
    cache.arena.buf[ref.offset] ^= 0xFF
    cache.release(ref)
    assert cache.get("c") is None
    assert rec.calls[-1] == ("removed", "c", "dram", "corrupt")


@pytest.mark.parametrize("seed", [1, 2])
def test_events_replay_to_what_the_cache_holds(make_cache: Make, ssd_dir: str, seed: int) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False,
                       ssd_map_size=12 * MiB, high_watermark=0.6, low_watermark=0.4)
    rec = _listen(cache)
    rng = random.Random(seed)
    keys = [f"r{i}" for i in range(60)]
    for step in range(600):
        k = rng.choice(keys)
        op = rng.random()
        if op < 0.5:
            cache.put(k, payload(k, rng.choice([64, 128, 256]) * KiB), ttl_s=0.2 if rng.random() < 0.05 else None)
        elif op < 0.8:
            cache.get(k)
        elif op < 0.95:
            cache.remove(k)
        elif op < 0.96:
            cache.clear()
        else:
            cache.flush()
        if step % 50 == 0:
            assert rec.tiers == _held(cache), f"step {step}"
            assert cache.check() == [], f"step {step}"
    cache.batch_exists(keys)  # expired blocks found and dropped
    assert rec.tiers == _held(cache)


def test_a_late_listener_hears_what_is_held_first(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False)
    for i in range(40):  # 10 MiB: some only on SSD, some in DRAM only, some in both
        cache.put(f"h{i}", payload(f"h{i}", 256 * KiB))
    cache.flush()
    cache.put("fresh", b"only in dram")
    rec = Recorder()
    cache.add_listener(rec, replay=True)
    assert rec.tiers == _held(cache) and {"dram", "ssd"} in rec.tiers.values()
    cache.remove("h0")
    assert rec.tiers == _held(cache)

"""The cache's timed pins: they expire, renew, wait briefly for blocks not yet put, are bounded, and
are on keys (a block put under a pinned key is pinned)."""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvpool.core import TieredCache, pins

from corehelp import KiB, MiB, payload

Make = Callable[..., TieredCache]


def squeeze(cache: TieredCache, tag: str) -> None:
    """Put more than the 4 MiB arena holds: every unpinned older block is evicted (there is no SSD)."""
    for i in range(24):
        cache.put(f"filler/{tag}/{i}", payload(f"{tag}{i}", 256 * KiB))


def test_a_pin_expires_and_a_renewal_counts_from_the_renewal(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB)
    cache.put("later", payload("later", 256 * KiB), pin_s=0.3)
    cache.pin("later", 0.6)  # renewed: the first deadline no longer counts
    time.sleep(0.4)
    squeeze(cache, "a")
    assert cache.exists("later")
    time.sleep(0.3)
    squeeze(cache, "b")  # expired pins are evictable again before room is looked for
    assert not cache.exists("later")
    assert cache.stats().pins == 0 and cache.check() == []


def test_a_pin_on_an_absent_key_waits_briefly_then_runs_its_length_once_the_block_comes(
        make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pins, "PENDING_PIN_S", 0.2)
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB)
    cache.batch_pin(["never", "later"], 60)
    s = cache.stats()
    assert (s.pins, s.pending_pins) == (2, 2)
    cache.put("later", payload("later", 256 * KiB))  # its block comes: the pin now runs 60 s
    assert (cache.stats().pins, cache.stats().pending_pins) == (2, 1)
    time.sleep(0.3)
    squeeze(cache, "a")
    assert cache.exists("later")
    s = cache.stats()
    assert (s.pins, s.pending_pins, s.pins_refused) == (1, 0, 0)  # "never" waited long enough
    assert cache.check() == []


def test_a_pin_is_on_the_key_and_unpinning_makes_the_block_evictable(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB)
    cache.put("k", payload("v1", 256 * KiB), pin_s=60)
    cache.put("k", payload("v2", 256 * KiB))  # a replacement under a pinned key is pinned too
    squeeze(cache, "a")
    assert cache.get("k") == payload("v2", 256 * KiB)
    cache.pin("k", 0)
    squeeze(cache, "b")
    assert not cache.exists("k") and cache.stats().pins == 0


def test_pins_waiting_for_their_blocks_are_bounded(make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pins, "MAX_PENDING_PINS", 3)
    cache = make_cache()
    cache.batch_pin([f"ghost{i}" for i in range(5)], 3600)
    cache.batch_pin(["ghost0"], 3600)  # a renewal is not a new pending pin
    s = cache.stats()
    assert (s.pins, s.pending_pins, s.pins_refused) == (3, 3, 2)
    cache.put("ghost4", b"x", pin_s=10)  # a put that carries its pin needs no pending one
    assert cache.stats().pins == 4 and cache.check() == []


def test_pin_lengths_are_cut_to_the_maximum(make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pins, "MAX_PIN_S", 0.2)
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB)
    cache.put("k", payload("k", 256 * KiB), pin_s=3600)
    time.sleep(0.3)
    squeeze(cache, "a")
    assert not cache.exists("k")


"""The cache's timed pins: they expire, renew, wait briefly for blocks not yet put, are bounded, and
are on keys (a block put under a pinned key is pinned)."""
from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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



def test_a_key_stays_pinned_until_the_last_of_its_holders_lets_go(make_cache: Make) -> None:
    """Two producers of one block (a prefix two prefill instances share) each pin it; the first to end
    its pin leaves the other's in place."""
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB)
    cache.put("shared", payload("shared", 256 * KiB))
    cache.batch_pin(["shared"], 60, holder=1)
    cache.batch_pin(["shared"], 60, holder=2)
    cache.batch_pin(["shared"], 0, holder=1)
    squeeze(cache, "a")
    assert cache.get("shared") == payload("shared", 256 * KiB)
    assert cache.check() == []
    cache.batch_pin(["shared"], 0, holder=2)
    squeeze(cache, "b")
    assert not cache.exists("shared")
    assert cache.stats().pins == 0 and cache.check() == []


def test_one_holder_s_short_pin_does_not_cut_another_s_long_one(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB)
    cache.put("k", payload("k", 256 * KiB))
    cache.batch_pin(["k"], 60, holder=1)
    cache.batch_pin(["k"], 0.1, holder=2)
    time.sleep(0.2)
    squeeze(cache, "a")
    assert cache.exists("k")
    cache.batch_pin(["k"], 0.1, holder=1)  # a holder's own renewal does count from the renewal
    time.sleep(0.2)
    squeeze(cache, "b")
    assert not cache.exists("k")
    assert cache.stats().pins == 0 and cache.check() == []


def test_pins_waiting_for_a_block_each_run_their_holder_s_length_once_it_comes(
        make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pins, "PENDING_PIN_S", 0.2)
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB)
    cache.batch_pin(["later"], 60, holder=1)
    cache.batch_pin(["later"], 60, holder=2)
    cache.batch_pin(["later"], 0, holder=1)
    assert (cache.stats().pins, cache.stats().pending_pins) == (1, 1)
    cache.put("later", payload("later", 256 * KiB))  # holder 2's pin now runs its 60 s
    time.sleep(0.3)
    squeeze(cache, "a")
    assert cache.exists("later")
    assert (cache.stats().pins, cache.stats().pending_pins) == (1, 0) and cache.check() == []
    cache.batch_pin(["later"], 0, holder=1)  # no pin of its own any more: nothing changes
    squeeze(cache, "b")
    assert cache.exists("later")
    cache.batch_pin(["later"], 0, holder=2)
    squeeze(cache, "c")
    assert not cache.exists("later") and cache.check() == []


def test_one_key_s_pin_holders_are_bounded_and_the_rest_share_a_pin_that_never_ends_early(
        make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients that come and go (each connection may name a holder) cannot grow one key's pins: past
    `MAX_HOLDERS`, a new holder's pin joins the key's overflow pin, which runs until the last deadline
    asked of it and which no unpin ends early; one whose own pin ran out makes room again."""
    monkeypatch.setattr(pins, "MAX_HOLDERS", 2)
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB)
    cache.put("k", payload("k", 256 * KiB))
    cache.batch_pin(["k"], 0.1, holder=1)
    cache.batch_pin(["k"], 0.1, holder=2)
    cache.batch_pin(["k"], 0.4, holder=3)  # to the overflow pin
    cache.batch_pin(["k"], 0.2, holder=4)  # to the overflow pin, which keeps the later deadline
    cache.batch_pin(["k"], 0, holder=3)  # ends nothing: its pin is shared
    assert cache.stats().pins_refused == 0 and cache.check() == []
    time.sleep(0.25)
    squeeze(cache, "a")
    assert cache.exists("k"), "the overflow pin ended before the last deadline asked of it"
    cache.batch_pin(["k"], 60, holder=5)  # holders 1 and 2 ran out: a pin of its own
    time.sleep(0.2)
    squeeze(cache, "b")
    assert cache.exists("k") and cache.check() == []
    cache.batch_pin(["k"], 0, holder=5)
    squeeze(cache, "c")
    assert not cache.exists("k") and cache.stats().pins == 0 and cache.check() == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"a", b"b"]), st.integers(1, 4), st.sampled_from([0.0, 60.0, 120.0])),
                max_size=40))
def test_a_block_is_pinned_exactly_while_some_holder_s_pin_runs(ops: list[tuple[bytes, int, float]]) -> None:
    """Any order of pins and unpins by several holders: a block is pinned if and only if at least one
    holder's last word on it was a pin, and the bookkeeping agrees with itself."""
    blocks = {k: SimpleNamespace(pinned=False) for k in (b"a", b"b")}
    p = pins.Pins(blocks)
    last: dict[tuple[bytes, int], float] = {}
    for key, holder, seconds in ops:
        p.pin([key], seconds, holder)
        last[key, holder] = seconds
        for k, block in blocks.items():
            assert block.pinned == any(s > 0 for (kk, _), s in last.items() if kk == k)
        assert p.check() == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"a", b"b"]), st.integers(1, 5), st.sampled_from([0.0, 60.0, 120.0])),
                max_size=40))
def test_past_the_holder_bound_a_block_stays_pinned_at_least_as_long_as_asked(
        ops: list[tuple[bytes, int, float]]) -> None:
    """With room for two holders' own pins per key: a pin that finds both taken joins the key's overflow
    pin, which nothing ends early; a block is pinned exactly while an own pin or the overflow pin runs."""
    blocks = {k: SimpleNamespace(pinned=False) for k in (b"a", b"b")}
    p = pins.Pins(blocks)
    own: dict[bytes, set[int]] = {b"a": set(), b"b": set()}
    overflow: set[bytes] = set()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pins, "MAX_HOLDERS", 2)
        for key, holder, seconds in ops:
            p.pin([key], seconds, holder)
            if seconds <= 0:
                own[key].discard(holder)
            elif holder in own[key] or len(own[key]) < 2:
                own[key].add(holder)
            else:
                overflow.add(key)
            for k, block in blocks.items():
                assert block.pinned == (bool(own[k]) or k in overflow)
            assert p.check() == []


def test_a_pin_whose_block_is_removed_waits_for_a_block_again_and_no_longer(
        make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins on keys whose blocks are gone cost no more than pins on keys never put: they wait
    `PENDING_PIN_S` for a block, then end; a block that comes meanwhile gets what its pins had left, and
    a replacement keeps them whole."""
    monkeypatch.setattr(pins, "PENDING_PIN_S", 0.2)
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB)
    for k in ("gone", "back"):
        cache.put(k, payload(k, 256 * KiB))
        cache.batch_pin([k], 60, holder=1)
        cache.batch_pin([k], 60, holder=2)
        cache.remove(k)
    cache.put("kept", payload("v1", 256 * KiB), pin_s=60)
    cache.put("kept", payload("v2", 256 * KiB))  # a replacement: the pin stays whole
    assert (cache.stats().pins, cache.stats().pending_pins) == (3, 2) and cache.check() == []
    cache.put("back", payload("back", 256 * KiB))  # within the wait: pinned again, for what was left
    time.sleep(0.3)
    squeeze(cache, "a")
    assert cache.exists("back") and cache.exists("kept")
    s = cache.stats()
    assert (s.pins, s.pending_pins, s.pins_refused) == (2, 0, 0) and cache.check() == []  # "gone": ended
    cache.batch_pin(["back"], 0, holder=1)
    cache.batch_pin(["back"], 0, holder=2)
    squeeze(cache, "b")
    assert not cache.exists("back") and cache.exists("kept") and cache.check() == []

"""Several threads share one cache: no wrong bytes, no deadlock, no stray exception."""
from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from kvpool.core import TieredCache

from corehelp import KiB, MiB, payload


def versioned(key: str, version: int, size: int) -> bytes:
    """A block that names its own key and version, so any reader can check it."""
    head = f"{key}:{version}:".encode().ljust(32, b".")
    return head + payload(f"{key}/{version}", size)


def check(key: str, got: bytes | None) -> None:
    if got is None:
        return
    name, version, _ = got[:32].split(b":", 2)
    assert name.decode() == key
    assert got == versioned(key, int(version), len(got) - 32)


@pytest.mark.parametrize("with_ssd", [True, False])
def test_threads_never_see_wrong_bytes(make_cache: Callable[..., TieredCache], ssd_dir: str,
                                       with_ssd: bool) -> None:
    ssd = dict(ssd_path=ssd_dir, ssd_sync=False) if with_ssd else {}
    # 12 slabs for five size classes: eviction all the time, yet the few blocks readers lease at
    # once cannot cover every slab (a writer needing a fresh slab would rightly get CapacityError).
    # Blocks that the demoter or a flush hold while writing them must be waited for, not fail it.
    cache = make_cache(dram_bytes=12 * MiB, dram_slab_size=1 * MiB, **ssd)
    keys = [f"k{i}" for i in range(96)]
    errors: list[tuple[int, BaseException]] = []

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            for n in range(400):
                key = rnd.choice(keys)
                op = rnd.random()
                if op < 0.4:
                    size = rnd.choice([100, 20 * KiB, 200 * KiB, 500 * KiB])
                    cache.put(key, versioned(key, seed * 10_000 + n, size))
                elif op < 0.7:
                    check(key, cache.get(key))
                elif op < 0.8:
                    buf = bytearray(500 * KiB + 32)
                    size = cache.get_into(key, buf)
                    check(key, None if size < 0 else bytes(buf[:size]))
                elif op < 0.9:
                    with cache.lease(key) as view:
                        before = None if view is None else bytes(view)
                        check(key, before)
                        other = rnd.choice(keys)  # maybe the leased key itself
                        cache.put(other, versioned(other, seed * 10_000 + n, 64 * KiB))
                        if view is not None:
                            assert bytes(view) == before
                elif op < 0.95:
                    cache.remove(key)
                else:
                    cache.prefix_match(keys[:4])
                    if with_ssd and rnd.random() < 0.2:
                        cache.flush()
        except BaseException as e:  # reported below, with the thread's seed
            errors.append((seed, e))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert not errors, f"thread {errors[0][0]}: {errors[0][1]!r}"
    s = cache.stats()
    assert s.dram_bytes <= s.dram_capacity and s.checksum_failures == 0
    assert s.evictions > 0
    assert cache.check() == []
    for k in keys:
        check(k, cache.get(k))


def test_flush_waits_for_the_demoters_write_in_flight(make_cache: Callable[..., TieredCache], ssd_dir: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A block is in one SSD write at a time: a flush that starts while the demoter writes waits for
    it (else both write a block, and an eviction queued between them deletes the copy the later one
    indexes: a block indexed on SSD that LMDB does not hold)."""
    from kvpool.core.tiers.ssd import SsdStore

    batch_put = SsdStore.batch_put
    in_flight: set[bytes] = set()
    overlaps: list[bytes] = []
    entered, release = threading.Event(), threading.Event()
    guard = threading.Lock()

    def watched(store: SsdStore, items: list) -> int:  # type: ignore[type-arg]
        items = list(items)
        keys = {k for k, _, _ in items}
        with guard:
            overlaps.extend(keys & in_flight)
            in_flight.update(keys)
        try:
            if not entered.is_set():
                entered.set()
                release.wait(10)  # the first write (the demoter's) stays in flight until released
            return batch_put(store, items)
        finally:
            with guard:
                in_flight.difference_update(keys)

    monkeypatch.setattr(SsdStore, "batch_put", watched)
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=1 * MiB, ssd_path=ssd_dir, ssd_sync=False,
                       high_watermark=0.5, low_watermark=0.25)
    for i in range(24):
        cache.put(f"f{i}", payload(f"f{i}", 100 * KiB))
    assert entered.wait(10), "the demoter never wrote"
    flushed: list[int] = []
    flusher = threading.Thread(target=lambda: flushed.append(cache.flush()))
    flusher.start()
    try:
        flusher.join(0.3)
        assert flusher.is_alive(), "flush went ahead of the write in flight"
    finally:
        release.set()
    flusher.join(10)
    assert not flusher.is_alive() and flushed and not overlaps
    assert cache.check() == []
    for i in range(24):
        got = cache.get(f"f{i}")
        assert got is None or got == payload(f"f{i}", 100 * KiB)

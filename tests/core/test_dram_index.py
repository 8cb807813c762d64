"""The DRAM tier's bulk index work in C (`_native.new_blocks`, `_native.index_many`: a same-node put's
commit) leaves the cache as the Python passes it replaced do: the same blocks, versions, eviction
order, TTL count, reservations, unlinked leased blocks and arena use, step by step over random batches
of new keys, replacements, stale versions, leased and TTL'd blocks, each cache consistent (`check`)."""
from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvpool.core.blocks import checksum
from kvpool.core.cache import TieredCache
from kvpool.core.tiers import dram_tier
from kvpool.core.tiers.dram_tier import DramBlock, PyDramBlock, new_blocks
from kvpool.core.versions import stamp

from corehelp import SMALL, KiB, payload


@contextmanager
def python_passes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Python passes in place of the native ones, for what runs within."""
    with monkeypatch.context() as m:
        m.setattr(dram_tier, "_native_index_many", None)
        m.setattr(dram_tier, "_native_new_blocks", None)
        yield


def test_native_passes_are_built_here() -> None:
    """CI builds the extension: the comparison below compares two paths, not one with itself."""
    assert dram_tier._native_index_many is not None and dram_tier._native_new_blocks is not None


def _state(cache: TieredCache) -> dict[str, object]:
    """What the DRAM tier holds, offsets aside (each cache's allocator hands out its own)."""
    dram = cache._stack.dram
    return {"blocks": {k: (b.size, b.checksum, 0 if b.expires else b.version, bool(b.expires), b.leases, b.checked)
                       for k, b in dram.blocks.items()},  # (a TTL'd block's time and version: its own cache's clock)
            "order": list(dram.order), "timed": dram.timed, "reserved": dram._reserved,
            "unlinked": sorted((b.key, 0 if b.expires else b.version) for b in dram._unlinked),
            "used": cache.arena.used_bytes,
            "slabs": sorted(len(t) for t in dram.by_slab.values())}


def _commit(cache: TieredCache, keys: list[bytes], sizes: list[int], versions: list[int]) -> list[bool]:
    offsets = cache.reserve_many(sizes)
    assert None not in offsets
    sums = []
    for key, off, size in zip(keys, offsets, sizes):
        data = payload(key + b"%d" % versions[keys.index(key)], size)
        cache.arena.view(off, size)[:] = data
        sums.append(checksum(data))
    return cache.commit_many(keys, offsets, sizes, sums, versions)


@pytest.mark.parametrize("seed", range(6))
def test_native_commits_leave_the_cache_as_the_python_passes_do(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    native, python = TieredCache(**SMALL), TieredCache(**SMALL)
    leases: dict[str, list[object]] = {"native": [], "python": []}
    seen = dict.fromkeys(("superseded", "ttl replaced", "leased replaced"), False)
    try:
        for step in range(60):
            n = rng.randint(1, 24)
            keys = rng.sample([b"key-%d" % i for i in range(40)], n)
            sizes = [rng.choice((1, 100, 4 * KiB, 16 * KiB, 33 * KiB)) for _ in keys]
            versions = []
            for _ in keys:  # mostly newer than anything held; now and then older (not stored)
                versions.append(stamp() - (1 << 30 if rng.random() < 0.2 else 0))
            op = rng.random()
            if op < 0.15:  # some blocks leased while replaced: their slots wait for the release
                for name, cache in (("native", native), ("python", python)):
                    leases[name] += [r for r in cache.acquire_many(keys[:3]) if r is not None]
            elif op < 0.25:  # leases end
                for name, cache in (("native", native), ("python", python)):
                    cache.release_many(leases[name])  # type: ignore[arg-type]
                    leases[name].clear()
            elif op < 0.35:  # a TTL'd block, put one by one; a bulk commit may replace it later
                for cache in (native, python):
                    cache.put(keys[0], payload(keys[0], 100), ttl_s=3600)
            timed = native._stack.dram.timed
            got = _commit(native, keys, sizes, versions)
            with python_passes(monkeypatch):
                want = _commit(python, keys, sizes, versions)
            assert got == want, f"step {step}"
            assert _state(native) == _state(python), f"step {step}"
            assert native.check() == [] and python.check() == []
            seen["superseded"] |= not all(got)
            seen["ttl replaced"] |= native._stack.dram.timed < timed
            seen["leased replaced"] |= bool(native._stack.dram._unlinked)
        assert all(seen.values()), seen  # each case ran at least once
    finally:
        native.close()
        python.close()


def test_native_blocks_are_the_python_passes_blocks() -> None:
    keys, offs, sizes, sums = [b"a", b"bb"], [4096, 8192], [10, 20], [2**64 - 1, 7]
    for versions in ([2**63 + 1, 5], None):
        for checked in (True, False):
            got = new_blocks(keys, offs, sizes, sums, versions, checked)
            want = [PyDramBlock(k, o, s, c, 0.0, 0, False, True, False, v, checked)
                    for k, o, s, c, v in zip(keys, offs, sizes, sums, versions or [0, 0])]
            fields = ("key", "offset", "size", "checksum", "expires", "leases", "pinned", "live", "on_ssd",
                      "version", "checked")
            assert [type(b) for b in got] == [DramBlock, DramBlock]
            assert [[getattr(b, f) for f in fields] for b in got] == [[getattr(b, f) for f in fields] for b in want]
            assert [type(b.offset) for b in got] == [int, int]
    numpy_cols = new_blocks(keys, np.array(offs), np.array(sizes), np.array(sums, dtype=np.uint64), None, True)
    assert [(b.offset, b.checksum) for b in numpy_cols] == [(4096, 2**64 - 1), (8192, 7)]
    assert [type(b.checksum) for b in numpy_cols] == [int, int]


def test_native_new_blocks_refuse_what_the_type_refuses() -> None:
    make = dram_tier._native_new_blocks
    assert make is not None
    with pytest.raises(TypeError):
        make(["a"], [0], [1], [2], None, True)  # a key that is not bytes
    with pytest.raises(TypeError):
        make([b"a"], [None], [1], [2], None, True)
    with pytest.raises(ValueError):
        make([b"a", b"b"], [0], [1, 1], [2, 2], None, True)  # columns of different lengths
    with pytest.raises(ValueError):
        make([b"a"], [0], [1], [2], [1, 2], True)
    assert make([], [], [], [], None, True) == []


def test_index_many_changes_nothing_where_a_block_is_not_its_type() -> None:
    """A dataclass block, new or indexed (tests build those), leaves the work to the Python passes."""
    index = dram_tier._native_index_many
    assert index is not None
    held = PyDramBlock(b"a", 4096, 1, 0, 0.0, version=1)
    blocks: dict[bytes, object] = {b"a": held}
    by_slab: dict[int, dict[int, object]] = {0: {4096: held}}
    order: dict[bytes, None] = {b"a": None}
    fresh = new_blocks([b"b", b"a"], [8192, 12288], [1, 1], [0, 0], [5, 5], True)
    assert index(blocks, by_slab, order, fresh, 0, 1 << 20) is None
    assert index({}, {}, {}, [fresh[0], PyDramBlock(b"c", 1, 1, 0, 0.0)], 0, 1 << 20) is None
    assert blocks == {b"a": held} and by_slab == {0: {4096: held}} and order == {b"a": None} and held.live
    with pytest.raises(ValueError):
        index({}, {}, {}, fresh, 0, 0)
    with pytest.raises(TypeError):
        index({}, {}, [], fresh, 0, 1 << 20)  # the order is a dict


def test_index_many_raises_for_an_indexed_block_missing_from_its_slab() -> None:
    """An index whose slab table lost a block is corrupt: a KeyError, as the Python pass raises, not a
    crash; the new block is not entered."""
    index = dram_tier._native_index_many
    assert index is not None
    held = new_blocks([b"a"], [4096], [1], [0], [1], True)[0]
    newer = new_blocks([b"a"], [8192], [1], [0], [2], True)
    blocks = {b"a": held}
    with pytest.raises(KeyError):
        index(blocks, {}, {b"a": None}, newer, 0, 1 << 20)
    assert blocks == {b"a": held}

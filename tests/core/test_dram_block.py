"""The DRAM tier's index entry (`dram_tier.DramBlock`): the C type the extension builds and the Python
dataclass that stands in for it keep one contract, and the C type keeps a full index out of the cyclic
garbage collector's walk (a worker of millions of blocks would otherwise stop for a second at a time)."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from kvpool.core.cache import TieredCache
from kvpool.core.tiers import dram_tier
from kvpool.core.tiers.dram_tier import DramBlock, PyDramBlock

TYPES = {"python": PyDramBlock, "native": DramBlock}
FIELDS = ("key", "offset", "size", "checksum", "expires", "leases", "pinned", "live", "on_ssd", "version", "checked")


def test_the_index_entry_is_the_native_type_here() -> None:
    """CI builds the extension: the DRAM index is made of the untracked type there."""
    assert DramBlock is not PyDramBlock
    assert DramBlock.__module__ == "kvpool.core._native"


@pytest.mark.parametrize("kind", TYPES)
def test_fields_defaults_and_expiry_are_the_dataclass_s(kind: str) -> None:
    cls = TYPES[kind]
    b = cls(b"k", 4096, 100, 2**64 - 1, 0.0)
    assert [getattr(b, f) for f in FIELDS] == [b"k", 4096, 100, 2**64 - 1, 0.0, 0, False, True, False, 0, True]
    full = cls(b"j", 1, 2, 3, 50.5, 2, True, False, True, 2**63 + 7, False)
    assert [getattr(full, f) for f in FIELDS] == [b"j", 1, 2, 3, 50.5, 2, True, False, True, 2**63 + 7, False]
    named = cls(key=b"n", offset=7, size=8, checksum=9, expires=0.0, version=11, on_ssd=True)
    assert (named.offset, named.version, named.on_ssd, named.checked) == (7, 11, True, True)
    assert not b.expired(1e12)  # no TTL: never
    assert not full.expired(50.0) and full.expired(50.5) and full.expired(51.0)
    b.leases += 1
    b.pinned, b.live, b.offset, b.on_ssd, b.checked = True, False, 8192, True, False
    assert (b.leases, b.pinned, b.live, b.offset, b.on_ssd, b.checked) == (1, True, False, 8192, True, False)
    assert b != cls(b"k", 4096, 100, 2**64 - 1, 0.0)  # identity: blocks of one key are told apart
    assert len({b, b, full}) == 2


def test_the_native_entry_holds_exact_types_and_refuses_what_could_hold_a_cycle() -> None:
    """A key that is not exactly bytes, or a field assigned an object of another kind, could carry a
    reference back (a cycle the collector could not see): made, numbers are stored as exact ints and
    floats whatever they came as (numpy's included); assigned later, they must be ints or bools."""
    class Key(bytes):
        pass

    for key in ("k", Key(b"k"), None):
        with pytest.raises(TypeError):
            DramBlock(key, 0, 1, 2, 0.0)
    for bad in ([], "x", None):
        with pytest.raises(TypeError):
            DramBlock(b"k", bad, 1, 2, 0.0)
    b = DramBlock(b"k", np.int64(4096), np.uint64(16), np.uint64(2**64 - 1), np.float32(2.5), version=np.uint64(9),
                  pinned=np.bool_(True), checked=0)
    fields = [b.offset, b.size, b.checksum, b.expires, b.version, b.pinned, b.checked, b.leases]
    assert fields == [4096, 16, 2**64 - 1, 2.5, 9, True, False, 0]
    assert [type(v) for v in fields] == [int, int, int, float, int, bool, bool, int]
    with pytest.raises((AttributeError, TypeError)):  # read-only; and not an int either
        b.key = b"other"
    with pytest.raises(AttributeError):  # read-only
        b.checksum = 1
    for bad in ([b], "x", 1.5, None, np.int64(3)):  # what changes later takes ints and bools only
        with pytest.raises(TypeError):
            b.offset = bad
    with pytest.raises(AttributeError):
        del b.leases
    b.offset, b.leases, b.pinned = 8192, 2, False
    assert (b.offset, b.leases, b.pinned) == (8192, 2, False)
    assert "b'k'" in repr(b)


def test_a_full_index_adds_nothing_for_the_collector_to_walk() -> None:
    """50 000 committed blocks leave the objects the cyclic GC tracks where they were (the dataclass
    adds one each), and so a full collection stays short however many blocks DRAM holds."""
    n = 50_000
    keys = [b"gc/%d" % i for i in range(n)]
    with TieredCache(dram_bytes=n * 4096 + (16 << 20), dram_slab_size=4 << 20) as cache:
        gc.collect()
        before = len(gc.get_objects())
        for i in range(0, n, 1000):
            batch = keys[i:i + 1000]
            offsets = cache.reserve_many([64] * len(batch))
            assert None not in offsets
            versions = list(range(i + 1, i + 1 + len(batch)))
            cache.commit_many(batch, offsets, [64] * len(batch), [0] * len(batch), versions, checked=False)
        cache.put(b"one", b"x" * 64)
        gc.collect()
        grown = len(gc.get_objects()) - before
        assert len(cache._dram.blocks) == n + 1
        assert all(not gc.is_tracked(b) for b in list(cache._dram.blocks.values())[:100])
    assert grown < 1000, f"{grown} more objects tracked by the GC after {n} blocks"


def test_new_blocks_builds_the_batch_as_committed() -> None:
    got = dram_tier.new_blocks([b"a", b"b"], [0, 64], [10, 20], [5, 6], [7, 8], False)
    assert [(b.key, b.offset, b.size, b.checksum, b.version, b.checked, b.expires, b.live) for b in got] == [
        (b"a", 0, 10, 5, 7, False, 0.0, True), (b"b", 64, 20, 6, 8, False, 0.0, True)]
    assert [b.version for b in dram_tier.new_blocks([b"c"], [0], [1], [2], None, True)] == [0]
    meta = dram_tier.block_meta(got[1])
    assert (meta.size, meta.checksum, meta.expires, meta.version) == (20, 6, 0.0, 8)


@pytest.mark.parametrize("kind", TYPES)
def test_block_columns_are_a_lease_replys_columns_of_either_type(kind: str) -> None:
    """Offsets and sizes as int64, checksums and versions as uint64, column after column (the native
    entry's in one pass; the dataclass's, or a mix, through numpy)."""
    cls = TYPES[kind]
    blocks = [cls(b"a", 4096, 100, 2**64 - 1, 0.0, version=2**63 + 1), cls(b"b", 0, 7, 5, 1.0, version=3),
              PyDramBlock(b"c", 8192, 1, 0, 0.0)]
    raw = dram_tier.block_columns(blocks)
    assert len(raw) == 32 * 3
    assert np.frombuffer(raw, "<i8", 3).tolist() == [4096, 0, 8192]
    assert np.frombuffer(raw, "<i8", 3, 24).tolist() == [100, 7, 1]
    assert np.frombuffer(raw, "<u8", 3, 48).tolist() == [2**64 - 1, 5, 0]
    assert np.frombuffer(raw, "<u8", 3, 72).tolist() == [2**63 + 1, 3, 0]
    assert dram_tier.block_columns([]) == b""

"""Blocks committed unchecked (`TieredCache.commit_many(checked=False)`: a staged same-node put's
COMMIT_UNCHECKED) are hashed at their first read (a get, a lease, a write to SSD): one whose bytes
disagree with its checksum is a miss there, dropped and counted, never wrong bytes; a sound one is hashed
once, then read as any other."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvpool.core import TieredCache, tier_moves
from kvpool.core.blocks import checksum

from corehelp import KiB, payload


def _commit_unchecked(cache: TieredCache, key: bytes, data: bytes, claimed: int | None = None) -> None:
    """Write `data` into a fresh slot and commit it on the writer's word (`claimed`: its checksum)."""
    (off,) = cache.reserve_many([len(data)])
    assert off is not None
    cache.arena.view(off, len(data))[:] = data
    assert cache.commit_many([key], [off], [len(data)], [checksum(data) if claimed is None else claimed],
                             checked=False) == [True]


def test_a_sound_block_is_hashed_at_its_first_read_only(make_cache: Callable[..., TieredCache],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache()
    data = payload("sound", 64 * KiB)
    _commit_unchecked(cache, b"sound", data)
    hashed: list[int] = []
    real = tier_moves.hash_at

    def counting(buf: Any, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        hashed.extend(sizes.tolist())
        return real(buf, offsets, sizes)
    monkeypatch.setattr(tier_moves, "hash_at", counting)
    assert cache.get(b"sound") == data
    assert cache.get(b"sound") == data
    with cache.lease(b"sound") as view:
        assert view is not None and bytes(view) == data
    assert hashed == [64 * KiB]
    assert cache.stats().checksum_failures == 0 and cache.check() == []


@pytest.mark.parametrize("read", ["get", "get_into", "lease"])
def test_a_block_whose_bytes_disagree_is_a_miss_at_its_first_read(make_cache: Callable[..., TieredCache],
                                                                  read: str) -> None:
    cache = make_cache()
    data = payload("bad", 64 * KiB)
    _commit_unchecked(cache, b"bad", data, claimed=checksum(data) ^ 1)
    _commit_unchecked(cache, b"good", payload("good", 64 * KiB))
    if read == "get":
        assert cache.get(b"bad") is None
    elif read == "get_into":
        assert cache.get_into(b"bad", bytearray(64 * KiB)) == -1
    else:
        with cache.lease(b"bad") as view:
            assert view is None
    assert not cache.exists(b"bad")  # dropped, not left to fail again
    assert cache.get(b"good") == payload("good", 64 * KiB)
    assert cache.stats().checksum_failures == 1 and cache.check() == []


def test_a_block_whose_bytes_disagree_is_not_written_to_ssd(make_cache: Callable[..., TieredCache],
                                                           ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir, ssd_sync=False)
    bad, good = payload("bad", 64 * KiB), payload("good", 64 * KiB)
    _commit_unchecked(cache, b"bad", bad, claimed=checksum(bad) ^ 1)
    _commit_unchecked(cache, b"good", good)
    assert cache.flush() == 1  # the good one
    assert not cache.exists(b"bad") and cache.stats().checksum_failures == 1
    cache.close()
    reopened = make_cache(ssd_path=ssd_dir, ssd_sync=False)  # DRAM is empty: reads come from SSD
    assert reopened.get(b"good") == good and reopened.get(b"bad") is None

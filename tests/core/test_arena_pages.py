"""A client readies its mapping of a worker's arena a region at a time: one call maps the region's pages,
so the copies that follow take no page faults (each 4 KiB page would fault at its first touch)."""
from __future__ import annotations

import resource
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core.arena_pages import REGION_BYTES, ArenaPages
from kvpool.core.tiers.dram import DramArena


@pytest.fixture
def arena() -> Iterator[DramArena]:
    a = DramArena(48 * REGION_BYTES, slab_size=16 * REGION_BYTES, prefault=True)
    yield a
    a.close()


def _unmap(view: memoryview) -> None:
    mapping = view.obj
    view.release()
    mapping.close()  # type: ignore[attr-defined]


def _faults_writing(view: memoryview, start: int, n: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.frombuffer(view, dtype=np.uint8, count=n, offset=start)[::4096] = 7  # a byte per page
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_readied_region_takes_no_faults_and_another_does(arena: DramArena) -> None:
    view = DramArena.attach(arena.name, arena.length, writable=True)
    try:
        pages = ArenaPages(view, writable=True)
        pages.ready(np.array([4096, -1], dtype="<i8"), np.array([1 << 20, 0], dtype="<i8"))  # region 0; a miss
        assert _faults_writing(view, 0, REGION_BYTES) < 64
        never = _faults_writing(view, 2 * REGION_BYTES, REGION_BYTES)  # a region never readied
        assert never >= REGION_BYTES // 4096 // 2
        assert bytes(arena.view(0, 1)) == b"\x07"  # the same memory as the worker's
    finally:
        _unmap(view)


def test_a_block_across_regions_readies_each(arena: DramArena) -> None:
    view = DramArena.attach(arena.name, arena.length, writable=False)
    try:
        pages = ArenaPages(view, writable=False)
        pages.ready(np.array([REGION_BYTES - 4096], dtype="<i8"), np.array([REGION_BYTES + 8192], dtype="<i8"))
        assert np.flatnonzero(pages._ready).tolist() == [0, 1, 2]
        pages.ready(np.array([], dtype="<i8"), np.array([], dtype="<i8"))
        assert np.flatnonzero(pages._ready).tolist() == [0, 1, 2]
    finally:
        _unmap(view)


def test_a_view_that_is_not_a_mapping_is_left_alone() -> None:
    pages = ArenaPages(memoryview(bytearray(4096)), writable=True)
    pages.ready(np.array([0], dtype="<i8"), np.array([4096], dtype="<i8"))  # nothing to ready, no error
    assert not pages._ready.any()

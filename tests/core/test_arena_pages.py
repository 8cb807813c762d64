"""A client readies its mapping of a worker's arena a region at a time: one call maps the region's pages,
so the copies that follow take no page faults (each 4 KiB page would fault at its first touch); a
client's transport readies the rest from a thread of its own, which its close ends."""
from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.core import arena_pages
from kvpool.core.arena_pages import REGION_BYTES, ArenaPages
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import ProtocolError
from kvpool.core.server import Worker
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


def test_a_background_reader_readies_every_region_and_the_copies_take_no_faults(arena: DramArena) -> None:
    view = DramArena.attach(arena.name, arena.length, writable=True)
    try:
        pages = ArenaPages(view, writable=True, background=True)
        assert pages._thread is not None  # (the extension lets madvise go without the GIL: built here)
        pages._thread.join(timeout=30)
        assert not pages._thread.is_alive()
        assert pages._ready.all()
        assert _faults_writing(view, 0, arena.length) < 64  # 48 MiB: 12288 pages, none faulted
        pages.close()
    finally:
        _unmap(view)


def test_close_stops_the_background_reader_before_the_mapping_goes(arena: DramArena,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    view = DramArena.attach(arena.name, arena.length, writable=False)
    started = threading.Event()
    release = threading.Event()
    populate = ArenaPages._populate

    def slow(self: ArenaPages, region: int) -> None:
        started.set()
        release.wait(5)
        populate(self, region)
    monkeypatch.setattr(ArenaPages, "_populate", slow)
    try:
        pages = ArenaPages(view, writable=False, background=True)
        assert started.wait(5)
        closing = threading.Thread(target=pages.close)
        closing.start()
        closing.join(0.2)
        assert closing.is_alive()  # close waits for the region under way ...
        release.set()
        closing.join(5)
        assert pages._thread is not None and not pages._thread.is_alive()
        assert pages._ready.sum() == 1  # ... and no region after it is readied
    finally:
        _unmap(view)  # (would raise BufferError were the thread still in a call on the mapping)


@pytest.mark.usefixtures("arena_only")  # (its put and get map the arena read-write and read-only)
def test_a_clients_close_ends_its_background_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    populate = ArenaPages._populate

    def slow(self: ArenaPages, region: int) -> None:
        time.sleep(0.05)  # 32 regions: the readers are still at work when the client closes
        populate(self, region)
    monkeypatch.setattr(ArenaPages, "_populate", slow)
    cache = CacheConfig(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=True)
    worker = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock")), cache).start()
    try:
        client = PoolClient(mode="local", worker=worker.unix_path)
        client.put("k", b"v" * 4096)  # maps the arena read-write ...
        assert client.get("k") == b"v" * 4096  # ... and read-only
        readers = [t for t in threading.enumerate() if t.name == "kvpool-arena-pages"]
        assert len(readers) == 2
        client.close()
        assert not any(t.is_alive() for t in readers)
    finally:
        worker.stop()


def test_the_background_reader_allocates_nothing_of_an_arena_not_prefaulted() -> None:
    """A worker that does not prefault its arena keeps the memory it never used: the background reader
    readies only regions whose memory exists."""
    sparse = DramArena(48 * REGION_BYTES, slab_size=16 * REGION_BYTES, prefault=False)
    try:
        sparse.buf[5 * REGION_BYTES:7 * REGION_BYTES] = 1  # the worker wrote two regions
        allocated = os.stat(f"/dev/shm/{sparse.name}").st_blocks * 512
        view = DramArena.attach(sparse.name, sparse.length, writable=True)
        try:
            pages = ArenaPages(view, writable=True, background=True)
            assert pages._thread is not None
            pages._thread.join(timeout=30)
            assert os.stat(f"/dev/shm/{sparse.name}").st_blocks * 512 == allocated
            assert np.flatnonzero(pages._ready).tolist() == [5, 6]
            pages.close()
        finally:
            _unmap(view)
    finally:
        sparse.close()


@pytest.mark.parametrize("impl", ["native", "python"])
def test_a_slot_outside_the_mapping_is_the_workers_protocol_error(arena: DramArena, impl: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slot a worker names (ALLOC and LEASE replies) passes `ready` before a byte moves: one that
    ends past the mapping, or has a negative size, is refused; misses (offset and size < 0) are not.
    The same with the extension's one pass (`slot_span`) and without."""
    if impl == "python":
        monkeypatch.setattr(arena_pages, "_native", None)
    view = DramArena.attach(arena.name, arena.length, writable=True)
    pages = ArenaPages(view, writable=True)
    try:
        size = view.nbytes
        pages.ready(np.array([0, -2, size - 4096], "<i8"), np.array([4096, -2, 4096], "<i8"))  # a miss between
        pages.ready(np.array([-1, size], "<i8"), np.array([1 << 62, 0], "<i8"))  # a miss of any size; an empty
        # slot at the arena's very end
        for offsets, sizes in [([size - 4096], [4097]), ([size], [1]), ([1 << 62], [1 << 20]), ([0, 4096], [8, -1]),
                               ([1 << 62], [1 << 62]), ([(1 << 63) - 1], [1])]:  # (sums that wrap in int64)
            with pytest.raises(ProtocolError, match="outside its arena"):
                pages.ready(np.array(offsets, "<i8"), np.array(sizes, "<i8"))
    finally:
        pages.close()
        _unmap(view)

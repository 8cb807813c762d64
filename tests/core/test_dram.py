"""The DRAM tier's shared-memory arena and its size-class slab allocator."""
from __future__ import annotations

import fcntl
import mmap
import os
import stat
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.errors import ConfigError
from kvpool.core.tiers.dram import PHASE, DramArena, arena_names, size_classes, sweep_dead_arenas

from corehelp import KiB, MiB

PAGE = mmap.PAGESIZE


@pytest.fixture
def arena() -> Iterator[DramArena]:
    a = DramArena(8 * MiB, slab_size=1 * MiB, prefault=False)
    yield a
    a.close()


def test_arena_is_created_0600_even_with_a_permissive_umask() -> None:
    old = os.umask(0)
    try:
        a = DramArena(2 * MiB, slab_size=1 * MiB, prefault=False)
    finally:
        os.umask(old)
    try:
        st_ = os.stat(f"/dev/shm/{a.name}")
        assert stat.S_IMODE(st_.st_mode) == 0o600
        assert st_.st_uid == os.getuid()
        assert st_.st_size == a.length == 2 * MiB + PHASE
    finally:
        a.close()


def test_arena_is_unlinked_on_close_and_close_is_idempotent() -> None:
    a = DramArena(2 * MiB, slab_size=1 * MiB, prefault=True)
    path = f"/dev/shm/{a.name}"
    assert os.path.exists(path)
    a.close()
    assert not os.path.exists(path)
    a.close()


def test_arena_names_are_unique_and_explicit_names_are_exclusive() -> None:
    a = DramArena(1 * MiB, slab_size=1 * MiB, prefault=False)
    b = DramArena(1 * MiB, slab_size=1 * MiB, prefault=False)
    try:
        assert a.name != b.name
        with pytest.raises(ConfigError, match="taken in /dev/shm by a live worker"):
            DramArena(1 * MiB, slab_size=1 * MiB, name=a.name, prefault=False)
        assert os.path.exists(f"/dev/shm/{a.name}")  # the failed attempt did not unlink a's arena
    finally:
        a.close()
        b.close()


def test_size_and_slab_are_validated() -> None:
    with pytest.raises(ConfigError, match="page-aligned") as err:
        DramArena(1 * MiB, slab_size=PAGE + 1, prefault=False)
    assert (err.value.size, err.value.limit) == (PAGE + 1, MiB)
    with pytest.raises(ConfigError):
        DramArena(PAGE, slab_size=2 * PAGE, prefault=False)


def test_size_is_rounded_down_to_whole_slabs() -> None:
    a = DramArena(3 * MiB + 100 * KiB, slab_size=1 * MiB, prefault=False)
    try:
        assert a.size == 3 * MiB
    finally:
        a.close()


def test_alloc_free_recycles_slots(arena: DramArena) -> None:
    first = arena.alloc(1000)
    assert first is not None
    assert arena.slot_size(first) >= 1000
    arena.free(first)
    assert arena.used_bytes == 0
    assert arena.alloc(1000) == first  # the freed slot is reused, not a fresh one
    others = {arena.alloc(1000) for _ in range(50)}
    assert None not in others and first not in others and len(others) == 50


def test_slots_do_not_overlap_and_hold_their_bytes() -> None:
    arena = DramArena(16 * MiB, slab_size=1 * MiB, prefault=False)
    try:
        _fill_and_check(arena)
    finally:
        arena.close()


def _fill_and_check(arena: DramArena) -> None:
    sizes = [1, 255, 256, 257, 1000, 4096, 5000, 100 * KiB, 300 * KiB, 1 * MiB]
    slots = []
    for i, n in enumerate(sizes * 3):
        off = arena.alloc(n)
        assert off is not None
        arena.view(off, n)[:] = bytes([i]) * n
        slots.append((off, n, i))
    spans = sorted((off, off + arena.slot_size(off)) for off, _, _ in slots)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[0][0] >= PHASE and spans[-1][1] <= arena.length
    for off, n, i in slots:
        assert arena.view(off, n) == bytes([i]) * n
    assert arena.check() == [] and arena.allocated() == {off for off, _, _ in slots}


def test_page_sized_slots_start_mid_page() -> None:
    """Slots of page-multiple classes start `PHASE` bytes into a page: far from where buffers start
    (a page boundary, malloc's 16 bytes in, torch's 64), which a copy between them would 4K-alias."""
    arena = DramArena(8 * MiB, slab_size=1 * MiB, prefault=False)
    try:
        offs = [arena.alloc(n) for n in (4 * KiB, 16 * KiB, 64 * KiB, 64 * KiB, 256 * KiB, 1 * MiB)]
        assert {(o or 0) % PAGE for o in offs} == {PHASE}
        for o in offs:
            arena.free(o or 0)
        assert arena.check() == [] and arena.used_bytes == 0
    finally:
        arena.close()


def test_every_slot_knows_its_size_up_to_the_end_of_its_slab() -> None:
    """The last small slots of a slab lie past the next slab's page-aligned start (slabs begin `PHASE`
    in): their size is their own slab's class, whatever class the next slab holds."""
    arena = DramArena(2 * MiB, slab_size=1 * MiB, prefault=False)
    try:
        csize = arena.classes[arena.class_of(KiB)]
        small = [arena.alloc(KiB) for _ in range(MiB // csize)]  # fills slab 0
        large = arena.alloc(64 * KiB)  # slab 1, another class
        assert None not in small and large is not None and max(o or 0 for o in small) >= MiB
        assert {arena.slot_size(o or 0) for o in small} == {csize}
        assert arena.slot_size(large) == 64 * KiB
    finally:
        arena.close()


def test_check_reports_broken_allocator_bookkeeping(arena: DramArena) -> None:
    offs = [arena.alloc(4 * KiB) for _ in range(3)]
    assert None not in offs and arena.check() == []
    arena.used_bytes += 64
    assert any("used_bytes" in e for e in arena.check())
    arena.used_bytes -= 64
    arena.free(offs[0] or 0)
    arena.free(offs[0] or 0)  # a double free: the slot is listed free twice
    assert any("slab" in e for e in arena.check())


def test_used_bytes_counts_slot_sizes(arena: DramArena) -> None:
    offs = [arena.alloc(n) for n in (100, 3000, 70 * KiB)]
    assert arena.used_bytes == sum(arena.slot_size(o) for o in offs if o is not None)
    for o in offs:
        assert o is not None
        arena.free(o)
    assert arena.used_bytes == 0


def test_empty_slabs_return_to_the_free_pool(arena: DramArena) -> None:
    slabs = arena.size // arena.slab_size
    small = [arena.alloc(4 * KiB) for _ in range(slabs * (arena.slab_size // (4 * KiB)))]
    assert None not in small
    assert arena.alloc(4 * KiB) is None
    assert arena.alloc(arena.slab_size) is None  # every slab belongs to the 4 KiB class
    for off in small:
        assert off is not None
        arena.free(off)
    assert arena.used_bytes == 0
    # every slab is free again, so a different class can take all of them
    big = [arena.alloc(arena.slab_size) for _ in range(slabs)]
    assert None not in big and len(set(big)) == slabs


def test_partially_used_slab_becomes_allocatable_again(arena: DramArena) -> None:
    per_slab = arena.slab_size // (256 * KiB)
    offs = [arena.alloc(256 * KiB) for _ in range(per_slab)]
    slab = {arena.slab_of(o) for o in offs if o is not None}
    assert len(slab) == 1
    assert arena.alloc(256 * KiB) is not None  # opens a second slab
    assert offs[1] is not None
    arena.free(offs[1])
    again = [arena.alloc(256 * KiB) for _ in range(per_slab)]
    assert offs[1] in again  # the freed slot is handed out again before any new slab is opened
    assert len({arena.slab_of(o) for o in again if o is not None}) == 2


def test_alloc_returns_none_when_full() -> None:
    a = DramArena(4 * MiB, slab_size=1 * MiB, prefault=False)
    try:
        offs = [a.alloc(600 * KiB) for _ in range(4)]  # one per slab (class 640 KiB)
        assert None not in offs
        assert a.alloc(600 * KiB) is None
        assert a.alloc(100) is None
        assert not a.can_alloc(100)
        assert offs[0] is not None
        a.free(offs[0])
        assert a.can_alloc(100)
        assert a.alloc(100) is not None
    finally:
        a.close()


def test_zero_byte_blocks_get_a_slot(arena: DramArena) -> None:
    a, b = arena.alloc(0), arena.alloc(0)
    assert a is not None and b is not None and a != b


@settings(max_examples=200, deadline=None)
@given(pages=st.integers(1, 4096), frac=st.floats(0, 1))
def test_size_classes_cover_every_block_with_under_25_percent_waste(pages: int, frac: float) -> None:
    slab = pages * PAGE
    classes = size_classes(slab)
    assert classes == sorted(set(classes)) and classes[-1] == slab
    assert all(c % 64 == 0 for c in classes)
    n = max(1, min(slab, round(frac * slab)))
    slot = classes[next(i for i, c in enumerate(classes) if c >= n)]
    if n >= 256:
        assert (slot - n) / slot < 0.25


@pytest.mark.parametrize("slab", [1 * MiB, 9 * PAGE, 36 * MiB // 16])
def test_largest_block_fits_any_page_aligned_slab(slab: int) -> None:
    a = DramArena(2 * slab, slab_size=slab, prefault=False)
    try:
        for n in (slab, slab - 1, slab // 2 + 1, 1):
            off = a.alloc(n)
            assert off is not None and a.slot_size(off) >= n
            a.free(off)
    finally:
        a.close()


def _killed_child(code: str) -> int:
    """Run `code` in a child python until it prints 'ready', kill -9 it, return its pid."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return proc.pid


def test_private_arena_never_appears_in_dev_shm_even_when_its_process_is_killed() -> None:
    a = DramArena(2 * MiB, slab_size=1 * MiB, prefault=False, shared=False)
    try:
        assert not os.path.exists(f"/dev/shm/{a.name}")
        off = a.alloc(100)
        assert off is not None
        a.buf[off:off + 3] = [1, 2, 3]
        assert bytes(a.view(off, 3)) == b"\x01\x02\x03"
    finally:
        a.close()
    pid = _killed_child("from kvpool.core import PoolClient; c = PoolClient(dram_bytes=32 << 20, "
                        "dram_slab_size=1 << 20); c.put('k', b'v'); print('ready', flush=True); input()")
    assert arena_names(pid) == set()


def test_a_shared_arena_left_by_a_killed_owner_is_swept_and_a_live_ones_is_not() -> None:
    pid = _killed_child("from kvpool.core.tiers.dram import DramArena; "
                        "a = DramArena(1 << 20, slab_size=1 << 20, prefault=False); "
                        "print('ready', flush=True); input()")
    left = arena_names(pid)
    assert len(left) == 1
    mine = DramArena(1 * MiB, slab_size=1 * MiB, prefault=False)
    try:
        swept = sweep_dead_arenas()
        assert set(swept) >= left and mine.name not in swept
        assert arena_names(pid) == set() and os.path.exists(f"/dev/shm/{mine.name}")
    finally:
        mine.close()


def _left_behind(name: str, size: int = 4096) -> None:
    """A shared-memory object as a killed owner leaves it: named, sized, locked by nobody."""
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def test_liveness_is_the_owners_lock_not_the_pid_in_the_name() -> None:
    """In a container a worker is pid 1 of its own pid namespace, sharing the node's /dev/shm: the pid in
    an arena's name may be anyone's here, or nobody's, whether its owner lives or not."""
    dead_but_pid_alive = f"kvpool-{os.getpid()}-deadbeef"  # named after a live pid (this process)
    _left_behind(dead_but_pid_alive)
    live = DramArena(1 * MiB, slab_size=1 * MiB, prefault=False)  # its pid alive, and it holds its lock
    other_namespace = f"kvpool-{2 ** 22 + 7}-0c0ffee0"  # a pid no process has here, its owner alive elsewhere
    _left_behind(other_namespace)
    fd = os.open(f"/dev/shm/{other_namespace}", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as its owner in the other namespace holds it
    try:
        swept = sweep_dead_arenas()
        assert dead_but_pid_alive in swept and not os.path.exists(f"/dev/shm/{dead_but_pid_alive}")
        assert live.name not in swept and other_namespace not in swept
        assert os.path.exists(f"/dev/shm/{live.name}") and os.path.exists(f"/dev/shm/{other_namespace}")
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{other_namespace}")
        live.close()


def test_an_empty_unlocked_arena_this_recent_is_left_to_its_creator() -> None:
    """A creator locks its arena before it sizes it: one found empty and new may be a moment from locked."""
    name = f"kvpool-{2 ** 22 + 9}-00000000"
    _left_behind(name, size=0)
    try:
        assert name not in sweep_dead_arenas()
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_a_configured_name_its_killed_owner_left_is_taken_over() -> None:
    name = f"kvpool-test-configured-{os.getpid()}"
    _left_behind(name)
    try:
        a = DramArena(1 * MiB, slab_size=1 * MiB, name=name, prefault=False)
        assert os.stat(f"/dev/shm/{name}").st_size == a.length
        a.close()
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("seed", range(4))
def test_freeing_a_batch_at_once_leaves_what_freeing_it_slot_by_slot_does(seed: int) -> None:
    """`free_many` frees a batch of one slab's slots at once (a replaced batch's, the usual one) and any
    other batch slot by slot: over random batches of mixed sizes, some within one slab, some across
    slabs, some emptying a slab or filling a full one's free list again, the allocator ends as the slot
    by slot frees leave it, free lists in the same order (the next allocations hand out the same slots)."""
    import random

    rng = random.Random(seed)
    at_once, each = (DramArena(8 * MiB, slab_size=1 * MiB, shared=False, prefault=False) for _ in range(2))
    slot_by_slot = at_once._free_each
    fell_back = [0]

    def counted(offsets: list[int]) -> None:
        fell_back[0] += 1
        slot_by_slot(offsets)

    at_once._free_each = counted  # type: ignore[method-assign]
    try:
        held: list[int] = []
        for _ in range(200):
            sizes = [rng.choice((1, 4 * KiB, 64 * KiB))] * rng.randint(1, 40)
            got = at_once.alloc_many(sizes)
            assert each.alloc_many(sizes) == got
            held += [off for off in got if off is not None]
            rng.shuffle(held) if rng.random() < 0.3 else None
            cut = rng.randint(0, len(held))
            batch, held = held[:cut], held[cut:]
            if rng.random() < 0.5:
                batch.sort()  # (a slab's run, as a batch allocated together comes back)
            at_once.free_many(batch)
            each._free_each(batch)
            assert at_once.check() == [] and each.check() == []
            assert (at_once._slabs, at_once._partial, at_once._free_slabs, at_once.used_bytes) == \
                (each._slabs, each._partial, each._free_slabs, each.used_bytes)
        assert 20 < fell_back[0] < 195  # both ways ran, each several times
    finally:
        at_once.close()
        each.close()


def test_a_batch_freeing_a_slot_twice_raises_as_slot_by_slot_frees_do(arena: DramArena) -> None:
    offsets = arena.alloc_many([4 * KiB] * 10)
    arena.free_many(offsets[:9])
    with pytest.raises(KeyError):
        arena.free_many([offsets[9], *offsets[:9]])  # (the slab emptied at its 10th: gone by the 11th)

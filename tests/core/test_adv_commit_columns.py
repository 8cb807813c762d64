"""Adversarial checks of `_native.commit_columns` (a same-node COMMIT's metadata, as a client sent it,
read and its slots claimed) and `_native.readable_views` (a batch's flat byte views), each against a
Python model of its contract and the Python path it stands in for: hostile metadata, reserved dicts and
buffers must never crash the process, give a wrong answer, leak, or change `reserved` where None comes
back."""
from __future__ import annotations

import array
import mmap
import random
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.core import _native as native  # (CI builds it: no skip)
from kvpool.core import buffers
from kvpool.core import protocol as P
from kvpool.core.blocks import checksum
from kvpool.core.keys import MAX_KEY_BYTES

from corehelp import worker_commit_columns

ROOM, TOP, U64 = 1 << 16, 1 << 62, (1 << 64) - 1  # the arena's bytes, the version ceiling


def _meta(keys: list[bytes], offs: list[int], sizes: list[int], sums: list[int], vers: list[int]) -> bytes:
    types = ("<i8", "<i8", "<u8", "<u8")
    return P.pack_batch(keys, *(np.array(c, t) for c, t in zip((offs, sizes, sums, vers), types)))


def _model(meta: bytes, max_batch: int, max_key: int, top: int, reserved: dict[Any, Any], arena: Any,
           check: bool) -> Any:
    """native/batch_commit.c's contract in Python: None, `reserved` untouched, for anything else."""
    meta = bytes(meta)
    n = struct.unpack_from("<I", meta)[0] if len(meta) >= 4 else -1
    if not 0 <= n <= max_batch or 4 + 2 * n > len(meta):
        return None
    lens = struct.unpack_from(f"<{n}H", meta, 4)
    at = 4 + 2 * n + sum(lens)
    if not all(1 <= ln <= max_key for ln in lens) or len(meta) - at != 32 * n:
        return None
    cols = struct.unpack_from(f"<{2 * n}q{2 * n}Q", meta, at)
    offs, sizes, sums, vers = (list(cols[i * n:(i + 1) * n]) for i in range(4))
    view = memoryview(arena).cast("B")
    if not all(0 <= o <= view.nbytes and 0 <= s <= view.nbytes - o for o, s in zip(offs, sizes)):
        return None
    if len(set(offs)) < n or not all(o in reserved and reserved[o] == s for o, s in zip(offs, sizes)):
        return None
    for o in offs:
        del reserved[o]
    ends = [4 + 2 * n + sum(lens[:i]) for i in range(n + 1)]
    corrupt = [i for i in range(n) if checksum(view[offs[i]:offs[i] + sizes[i]]) != sums[i]] if check else []
    return [meta[a:b] for a, b in zip(ends, ends[1:])], offs, sizes, sums, [min(v, top) for v in vers], corrupt


def _valid(rng: random.Random, arena: np.ndarray) -> tuple[bytes, dict[int, int]]:
    """A well-formed COMMIT of slots of `arena` (in no order, one maybe of no bytes at its very end, some
    checksums wrong, versions at and past the ceiling) and the reserved slots (those, and a few others)."""
    n = rng.choice([0, 1, 2, 7, 33])
    starts = rng.sample(range(0, ROOM - 1024, 1024), n)
    if n and rng.random() < 0.3:
        starts[-1] = ROOM
    sizes = [0 if s == ROOM else rng.choice([0, 1, 17, 1023, 1024]) for s in starts]
    sums = [checksum(arena[s:s + z]) ^ (rng.random() < 0.2) for s, z in zip(starts, sizes)]
    vers = [rng.choice([0, 1, TOP - 1, TOP, TOP + 1, U64, rng.randrange(1 << 64)]) for _ in range(n)]
    keys = [rng.randbytes(rng.choice([1, 2, MAX_KEY_BYTES])) for _ in range(n)]
    reserved = dict(zip(starts, sizes)) | {rng.randrange(1, ROOM): rng.randrange(1, 99) for _ in range(2)}
    return _meta(keys, starts, sizes, sums, vers), reserved


def _mutant(rng: random.Random, meta: bytes) -> bytes:
    """`meta` broken as a hostile or buggy client might break it."""
    m, how = bytearray(meta), rng.randrange(9)
    n = struct.unpack_from("<I", m)[0]
    col = len(m) - 32 * n
    if how == 0:
        return rng.randbytes(rng.randrange(64))
    if how == 1:
        return bytes(m[:rng.randrange(len(m) + 1)])
    if how == 2:
        return bytes(m) + rng.randbytes(rng.choice([1, 2, 31, 32, 33]))
    if how == 3:
        struct.pack_into("<I", m, 0, rng.choice([n + 1, max(n - 1, 0), P.MAX_BATCH + 1, 1 << 31, U64 >> 32]))
    elif how == 4 and n:
        struct.pack_into("<H", m, 4 + 2 * rng.randrange(n), rng.choice([0, MAX_KEY_BYTES + 1, 65535]))
    elif how == 5 and n:  # an offset or a size outside the arena, or overflowing int64 together
        struct.pack_into("<q", m, col + 8 * rng.randrange(2 * n), rng.choice([-1, -(1 << 63), ROOM + 1, (1 << 63) - 1]))
    elif how == 6 and n > 1:  # a slot named twice
        m[col + 8 * (n - 1):col + 8 * n] = m[col:col + 8]
    else:
        m[rng.randrange(len(m))] ^= 1 << rng.randrange(8)
    return bytes(m)


def test_adv_commit_columns_matches_its_model_and_the_python_path_on_hostile_metadata() -> None:
    rng = random.Random(20240601)
    arena = np.frombuffer(random.Random(1).randbytes(ROOM), np.uint8)
    for i in range(3000):
        meta, reserved = _valid(rng, arena)
        if i % 3:  # broken metadata; a slot of the batch not reserved, or of another size
            meta = _mutant(rng, meta)
            if rng.random() < 0.4:
                reserved[rng.choice(list(reserved))] += rng.choice([-1, 1, 1 << 40])
            if rng.random() < 0.3:
                del reserved[rng.choice(list(reserved))]
        check = bool(i & 4)
        mine, model, worker = dict(reserved), dict(reserved), dict(reserved)
        got = native.commit_columns(meta, P.MAX_BATCH, MAX_KEY_BYTES, TOP, mine, memoryview(arena), check)
        assert got == _model(meta, P.MAX_BATCH, MAX_KEY_BYTES, TOP, model, arena, check), (i, meta.hex())
        assert mine == model, (i, meta.hex())
        theirs = worker_commit_columns(meta, worker, memoryview(arena), check, TOP)
        if got is not None:
            assert got == theirs and mine == worker and [type(c) for c in got] == [list] * 6
        else:  # only slots outside the arena, never hashed, pass the Python path
            assert theirs is None or not check


@pytest.mark.parametrize("arena", [b"", b"\x07" * 100, bytearray(b"\x01" * 100), "np-slice", "mmap"],
                         ids=["empty", "bytes", "bytearray", "np-slice", "mmap"])
def test_adv_commit_columns_on_odd_arenas_and_slots_at_their_edges(arena: Any) -> None:
    if arena == "np-slice":
        arena = memoryview(np.arange(300, dtype=np.uint8))[50:150]
    elif arena == "mmap":
        arena = mmap.mmap(-1, 100)
        arena[:] = b"\x05" * 100
    size, data = len(memoryview(arena)), bytes(memoryview(arena))
    for off, sz in [(0, 0), (0, size), (size, 0), (size // 2, size - size // 2), (size, 1), (0, size + 1),
                    (-1, 1), (0, -1), (1, (1 << 63) - 1), ((1 << 63) - 1, 1), (-(1 << 63), size)]:
        for check in (True, False):
            meta = _meta([b"k"], [off], [sz], [checksum(data[max(off, 0):off + sz]) ^ check], [U64])
            mine, model = {off: sz}, {off: sz}
            got = native.commit_columns(meta, 4, 4, 9, mine, arena, check)
            assert got == _model(meta, 4, 4, 9, model, arena, check) and mine == model, (off, sz, check)
            assert (got is None) == (not 0 <= off <= off + sz <= size)
            assert got is None or (got[4] == [9] and got[5] == [0] * check)
    with pytest.raises(BufferError):  # a strided arena has no contiguous bytes to hash
        native.commit_columns(_meta([], [], [], [], []), 4, 4, 9, {}, memoryview(bytes(8))[::2], True)


def test_adv_commit_columns_limits_of_counts_and_key_lengths() -> None:
    arena = bytes(64)
    for max_key, ln, ok in [(5, 5, True), (5, 6, False), (65535, 65535, True), (0, 1, False), (-1, 1, False)]:
        meta = _meta([b"x" * ln], [0], [1], [0], [0])
        assert (native.commit_columns(meta, 1, max_key, 0, {0: 1}, arena, False) is not None) == ok
    empty = _meta([], [], [], [], [])
    assert native.commit_columns(empty, 0, 1, 0, {}, arena, True) == ([], [], [], [], [], [])
    assert native.commit_columns(empty, -1, 1, 0, {}, arena, True) is None
    one = _meta([b"k"], [0], [1], [0], [0])
    assert native.commit_columns(one, 0, 9, 0, {0: 1}, arena, False) is None
    for count in [2, U64 >> 32, 1 << 31, P.MAX_BATCH + 1]:
        for max_batch in [P.MAX_BATCH, sys.maxsize]:
            bad, r = struct.pack("<I", count) + one[4:], {0: 1}
            assert native.commit_columns(bad, max_batch, 9, 0, r, arena, True) is None and r == {0: 1}


def test_adv_commit_columns_claims_sizes_held_equal_in_value_as_python_does() -> None:
    """A size held as 16.0 or True equals the int sent, in the worker's `claimed != lens` as in C."""
    arena, meta = bytes(64), _meta([b"a", b"b"], [0, 16], [16, 1], [0, 0], [0, 0])
    for held in [{0: 16.0, 16: True, 40: 2.5}, {0: np.int64(16), 16: 1.0}]:
        mine, theirs = dict(held), dict(held)
        got = native.commit_columns(meta, 9, 9, 5, mine, arena, False)
        assert got is not None and got == worker_commit_columns(meta, theirs, arena, False, 5)
        assert mine == theirs and set(mine) == set(held) - {0, 16}
    for held in [{0: 16.5, 16: 1}, {0: float("nan"), 16: 1}, {0: "16", 16: 1}, {0: None, 16: 1}, {0: 16, 16: False}]:
        mine = dict(held)
        assert native.commit_columns(meta, 9, 9, 5, mine, arena, False) is None
        assert worker_commit_columns(meta, dict(held), arena, False, 5) is None
        assert mine == held and all(mine[k] is held[k] for k in held)  # (the order may change)


def test_adv_commit_columns_gives_back_the_very_values_it_claimed_on_none() -> None:
    """The third slot is not reserved: the first two, claimed then given back, must be as they were (the
    Python path puts back the objects it popped: 16.0 stays a float, True a bool)."""
    for held in [{0: 16.0, 16: True}, {0: True, 16: 1.0}]:
        meta = _meta([b"a", b"b", b"c"], [0, 16, 32], [int(held[0]), 1, 1], [0] * 3, [0] * 3)
        mine, theirs = dict(held), dict(held)
        assert native.commit_columns(meta, 9, 9, 5, mine, bytes(64), False) is None
        assert worker_commit_columns(meta, theirs, bytes(64), False, 5) is None
        assert [(type(v), v) for v in theirs.values()] == [(type(v), v) for v in held.values()]
        assert {k: (type(v), v) for k, v in mine.items()} == {k: (type(v), v) for k, v in held.items()}, mine


def _hostile(eq: Any) -> Any:
    """A size held whose comparison runs `eq`."""
    return type("Hostile", (), {"__eq__": eq, "__hash__": None})()


def test_adv_commit_columns_hostile_values_raise_cleanly_and_give_slots_back() -> None:
    meta = _meta([b"a", b"b", b"c"], [0, 8, 16], [1, 2, 3], [0, 0, 0], [0, 0, 0])
    bomb = _hostile(lambda self, other: 1 // 0)
    mine = {0: 1, 8: bomb, 16: 3}
    with pytest.raises(ZeroDivisionError):
        native.commit_columns(meta, 9, 9, 5, mine, bytes(64), True)
    assert mine == {0: 1, 8: bomb, 16: 3} and mine[8] is bomb
    mine = {0: 1, 16: 3}
    mine[8] = _hostile(lambda self, other: mine.clear() or True)
    with pytest.raises(KeyError):  # (the dict emptied under it: the slot it had claimed goes back)
        native.commit_columns(meta, 9, 9, 5, mine, bytes(64), True)
    assert mine == {0: 1}


def test_adv_commit_columns_releases_buffers_and_leaks_nothing() -> None:
    rng = random.Random(3)
    arena = np.frombuffer(rng.randbytes(ROOM), np.uint8).copy()
    cases = [(_mutant(rng, m) if i % 2 else m, r) for i, (m, r) in enumerate(_valid(rng, arena) for _ in range(40))]
    bomb, shared = _hostile(lambda self, other: 1 // 0), 10 ** 12
    cases.append((_meta([b"a", b"b"], [0, 8], [5, 1], [0, 0], [0, 0]), {0: 5, 8: shared}))  # 0 claimed, given back
    hostile = (_meta([b"a"], [0], [1], [0], [0]), {0: bomb})
    watched = (arena, bomb, shared, hostile[0], cases[-1][0])
    refs = [sys.getrefcount(x) for x in watched]

    def once() -> None:
        for meta, reserved in cases:
            native.commit_columns(meta, P.MAX_BATCH, MAX_KEY_BYTES, TOP, dict(reserved), arena, True)
        with pytest.raises(ZeroDivisionError):
            native.commit_columns(hostile[0], 9, 9, 5, dict(hostile[1]), arena, True)

    for _ in range(50):
        once()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(500):  # ~21000 calls, a third of them refused
            once()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 << 10, grown
    assert [sys.getrefcount(x) for x in watched] == refs
    meta = bytearray(cases[0][0])
    native.commit_columns(meta, P.MAX_BATCH, MAX_KEY_BYTES, TOP, {}, arena, True)
    with pytest.raises(BufferError):
        native.commit_columns(meta, P.MAX_BATCH, MAX_KEY_BYTES, TOP, {}, memoryview(bytes(8))[::2], True)
    meta.append(0)  # (no buffer of it left exported, even where the arguments were refused)


def _survives(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "survived", (done.returncode, done.stderr[-2000:])


def test_adv_commit_columns_survives_metadata_rewritten_while_it_hashes() -> None:
    """A mutable `meta` (any bytes-like is taken) rewritten by another thread while the GIL is let go: the
    slots hashed must be those checked against the arena, not offsets read again from `meta`."""
    _survives("""
        import threading
        import numpy as np
        from kvpool.core import _native, protocol as P
        n, size = 4096, 16384
        arena, offs = np.zeros(n * size, np.uint8), np.arange(n, dtype="<i8") * size
        meta = bytearray(P.pack_batch([b"k"] * n, offs, np.full(n, size, "<i8"), *[np.zeros(n, "<u8")] * 2))
        at, stop = len(meta) - 32 * n + 8 * (n - 1), []
        good, bad = bytes(meta[at:at + 8]), (1 << 44).to_bytes(8, "little")  # the last offset, far away
        def flip():
            while not stop:
                meta[at:at + 8] = bad
                meta[at:at + 8] = good
        t = threading.Thread(target=flip)
        t.start()
        for _ in range(100):
            _native.commit_columns(meta, P.MAX_BATCH, 511, 1 << 63, dict.fromkeys(offs.tolist(), size), arena, True)
        stop.append(1)
        t.join()
        print("survived")
    """)


FLAT = [lambda: b"abc", lambda: b"", lambda: bytearray(b"xyz" * 5), lambda: memoryview(b"0123456789")[2:7],
        lambda: np.arange(20, dtype=np.uint8), lambda: np.arange(40, dtype=np.uint8)[5:25],
        lambda: np.zeros((4, 5), np.uint8)[2], lambda: array.array("B", b"arr"), lambda: mmap.mmap(-1, 10)]
OTHER = [lambda: np.arange(20, dtype=np.uint8)[::2], lambda: np.arange(20, dtype=np.uint8)[::-1],
         lambda: np.zeros((4, 5), np.uint8), lambda: np.zeros(6, np.float32), lambda: np.zeros(6, np.int8),
         lambda: np.zeros((), np.uint8), lambda: np.zeros((4, 5), np.uint8)[:, 1], lambda: np.array([object()]),
         lambda: memoryview(b"abcdef").cast("B", (2, 3)), lambda: memoryview(b"abcd").cast("c"),
         lambda: memoryview(b"abcdefgh").cast("I"), lambda: array.array("i", [1, 2]), lambda: 5, lambda: "text",
         lambda: None, lambda: [1, 2]]


def _flat(x: Any) -> bool:
    try:
        mv = memoryview(x)
    except (TypeError, ValueError):
        return False
    with mv:
        return mv.ndim == 1 and mv.format == "B" and mv.strides == (1,)


def test_adv_readable_views_agrees_with_readable_on_random_batches() -> None:
    rng = random.Random(7)
    assert native.readable_views([]) == [] and native.readable_views(()) == []
    for i in range(2000):
        batch = [rng.choice(FLAT)() for _ in range(rng.randrange(1, 6))]
        if i % 2:
            batch.insert(rng.randrange(len(batch) + 1), rng.choice(OTHER)())
        got = native.readable_views(tuple(batch) if i % 3 else batch)
        assert (got is not None) == all(map(_flat, batch)), [type(b) for b in batch]
        assert got is None or (len(got) == len(batch) and all(type(v) is memoryview for v in got))
        for view, item in zip(got or [], batch):
            want = buffers.readable(item)
            assert (view.format, view.ndim, view.readonly) == ("B", 1, want.readonly)
            assert view.tobytes() == want.tobytes()
            if view.nbytes and not view.readonly:  # a view of the item's memory, not a copy
                first = memoryview(item).cast("B")[0]
                view[0] ^= 0xFF
                assert memoryview(item).cast("B")[0] == first ^ 0xFF
    for bad in [5, None]:
        with pytest.raises(TypeError):
            native.readable_views(bad)
    got = native.readable_views(iter([b"ab", bytearray(b"c")]))  # (any iterable: readable_all passes lists)
    assert got is not None and [v.tobytes() for v in got] == [b"ab", b"c"]


def test_adv_readable_views_releases_its_views_and_leaks_no_references() -> None:
    grow = bytearray(b"g" * 8)
    items = [b"x" * 100, grow, np.arange(8, dtype=np.uint8)]
    bad = items + [np.zeros(4, np.float64)]
    refs = [sys.getrefcount(x) for x in bad]
    for _ in range(20000):
        assert native.readable_views(items) is not None and native.readable_views(bad) is None
    assert [sys.getrefcount(x) for x in bad] == refs
    grow.extend(b"more")  # no view of it left exported, by a batch taken or one refused
    views = native.readable_views(items)
    with pytest.raises(BufferError):
        grow.extend(b"more")
    del views
    grow.extend(b"more")


def test_adv_readable_views_survives_its_list_emptied_while_it_views() -> None:
    """A list emptied by code run while its views are made (a garbage collector's finalizer here, run by
    an allocation; a `__buffer__` method from Python 3.12) must not be read past its end."""
    _survives("""
        import gc
        from kvpool.core import _native
        victim = [bytes(10) for _ in range(2000)]
        class Finalizer:
            def __del__(self):
                victim.clear()
        f = Finalizer()
        f.me = f
        del f
        gc.set_threshold(1, 1, 1)
        got = _native.readable_views(victim)
        gc.set_threshold(700, 10, 10)
        assert got is None or all(v.tobytes() == bytes(10) for v in got)
        print("survived")
    """)

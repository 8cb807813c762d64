"""Adversarial checks of the DRAM tier's native bulk index work and its neighbours (commits efbed9b..f65ddab).

- `_native.index_many` (DramTier.insert_many's one-pass C) against the Python passes it stands in for: entry
  for entry (offsets, slab tables, live flags, unlinked blocks, TTL count, reservations, slots freed) over
  random indexes with negative offsets and odd slab sizes; the order in which it frees slots (the arena's
  free lists, so the slots handed out next); offsets at the 64-bit edges; a batch emptied under it.
- `_native.new_blocks` when an `__index__` hook empties a column it is reading.
- `_native.split_keys` against the Python fallback on malformed metadata (every outcome the same), and on
  bytearray/memoryview metadata (exact bytes keys).
- `ChangeLog` (records kept together) against the flat log it replaced (`git show 0c7cdb8:core/versions.py`),
  re-implemented here: length, sequence numbers, coverage, `puts_since` and `since` from any sequence number,
  any page size, mismatched key/version counts, iterators, a clock stepping back, `max_entries` 0.
- `DramArena.free_many` freeing a one-slab batch at once against `_free_each` on double, misaligned and
  cross-slab frees and a slab never allocated.

The checks that crash the interpreter run in a child process.
"""
from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvpool.core import protocol as P
from kvpool.core.errors import ProtocolError
from kvpool.core.stats import CacheCounters
from kvpool.core.tiers import dram_tier
from kvpool.core.tiers.dram import PHASE, DramArena
from kvpool.core.tiers.dram_tier import DramTier, new_blocks
from kvpool.core.versions import CLEAR, PUT, REMOVE, ChangeLog

from corehelp import KiB, MiB

ROOT = Path(__file__).resolve().parents[2]



def test_adv_the_native_passes_are_built_here() -> None:
    """CI builds the extension: the checks below compare the native passes with the Python ones."""
    assert dram_tier._native_index_many is not None and P._split_keys is not P._py_split_keys


@contextmanager
def _python_passes(python: bool) -> Iterator[None]:
    """DramTier.insert_many's Python passes in place of `_native.index_many` while `python`."""
    saved = dram_tier._native_index_many
    if python:
        dram_tier._native_index_many = None
    try:
        yield
    finally:
        dram_tier._native_index_many = saved


def _run_child(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


# ----- index_many against the Python passes ------------------------------------------------------------


class _RecordingArena:
    """What DramTier.insert_many asks of an arena: its slab size and the slots it frees, in order."""

    def __init__(self, slab_size: int) -> None:
        self.slab_size = slab_size
        self.freed: list[int] = []

    def free(self, offset: int) -> None:
        self.freed.append(offset)

    def free_many(self, offsets: list[int]) -> None:
        self.freed.extend(offsets)


def _tier(held: list[tuple[bytes, int, int, float, int]], slab_size: int) -> tuple[DramTier, list[Any]]:
    """A tier indexing (key, offset, version, expires, leases) each, over a recording arena."""
    tier = DramTier(_RecordingArena(slab_size), "lru", CacheCounters())  # type: ignore[arg-type]
    tier._reserved = 1000
    olds = []
    for key, offset, version, expires, leases in held:
        b = dram_tier.DramBlock(key, offset, 1, 0, expires, leases=leases, version=version)
        olds.append(b)
        tier.blocks[key] = b
        tier.by_slab.setdefault((offset - PHASE) // slab_size, {})[offset] = b
        tier.order.add(key)
        tier.timed += bool(expires)
        tier.leases += leases
    return tier, olds


@pytest.mark.parametrize("seed", range(3))
def test_adv_index_many_matches_the_python_passes_entry_for_entry(seed: int) -> None:
    """The existing comparison (test_dram_index) leaves offsets and slab tables' contents aside; here every
    entry is compared: each key's offset, version and liveness, each slab table's offsets and keys (negative
    offsets and slab sizes that do not divide them: floor division, as Python's), the order, the TTL count,
    the reservations, the unlinked leased blocks, the replaced blocks' flags and the slots freed."""
    rng = random.Random(seed)
    keys = [b"k%d" % i for i in range(12)]
    for trial in range(1500):
        slab_size = rng.choice((1, 3, 256, 4096, 1 << 20))
        offsets = rng.sample(range(-50_000, 50_000), 24)
        held = [(k, offsets.pop(), rng.randint(1, 5), rng.choice((0.0, 0.0, 5.0)), rng.choice((0, 0, 1, 2)))
                for k in rng.sample(keys, rng.randint(0, 8))]
        fresh = [(k, offsets.pop(), rng.randint(1, 6)) for k in rng.sample(keys, rng.randint(0, 10))]
        seen = []
        for python in (False, True):
            tier, olds = _tier(held, slab_size)
            batch = new_blocks([k for k, _, _ in fresh], [o for _, o, _ in fresh], [1] * len(fresh),
                               [0] * len(fresh), [v for _, _, v in fresh], True)
            with _python_passes(python):
                stored = tier.insert_many(batch)
            arena = tier.arena
            assert isinstance(arena, _RecordingArena)
            seen.append({
                "stored": stored,
                "blocks": {k: (b.offset, b.version, b.live) for k, b in tier.blocks.items()},
                "by_slab": {s: {o: b.key for o, b in t.items()} for s, t in tier.by_slab.items()},
                "order": list(tier.order), "timed": tier.timed, "reserved": tier._reserved,
                "unlinked": sorted(b.key for b in tier._unlinked),
                "replaced": [(b.live, b.offset, b.leases) for b in olds],
                "freed": sorted(arena.freed),  # (the order: test_adv_index_many_frees_slots_...)
            })
        assert seen[0] == seen[1], (trial, slab_size, held, fresh)


def test_adv_index_many_frees_slots_in_the_order_the_python_passes_do() -> None:
    """The Python passes free a batch's stale blocks' slots first (`unreserve`, in the batch's order), then
    the slots of the blocks they replace (`_unlink`); the native pass freed them interleaved (a review's
    find, fixed): the arena's free lists differed, and so did the slots the next allocations hand out
    (test_dram_index compares the two "offsets aside")."""
    layouts = []
    for python in (False, True):
        arena = DramArena(8 * MiB, slab_size=1 * MiB, shared=False, prefault=False)
        try:
            tier = DramTier(arena, "lru", CacheCounters())
            keys = [b"a", b"b", b"c"]
            first = tier.alloc_many([100] * 3)
            with _python_passes(python):
                tier.insert_many(new_blocks(keys, first, [100] * 3, [0] * 3, [5, 5, 5], True))
                second = tier.alloc_many([100] * 3)
                # a and c newer (their old slots freed), b stale (its new slot freed)
                stored = tier.insert_many(new_blocks(keys, second, [100] * 3, [0] * 3, [6, 4, 6], True))
            assert stored == [True, False, True]
            layouts.append({"free lists": {n: list(s.free) for n, s in arena._slabs.items()},
                            "next slots": [arena.alloc(100) for _ in range(3)]})
        finally:
            arena.close()
    native, python = layouts
    assert native == python


@pytest.mark.parametrize("offset", [2**63, 2**64 + PHASE, -(2**63)], ids=["2^63", "2^64", "-2^63"])
def test_adv_index_many_places_64_bit_edge_offsets_as_python_does_or_changes_nothing(offset: int) -> None:
    """(Unreachable from the arena, whose offsets are small; a review's find, fixed.) `slab_of` computes
    (offset - phase) // slab_size in long long: an offset past 2^63 raised OverflowError after the batch
    was half applied, and -2^63 - phase overflowed (undefined behaviour). Every offset is now checked
    before anything changes, and one out of range leaves the batch to the Python passes."""
    index = dram_tier._native_index_many
    assert index is not None
    slab_size = 1 << 20
    held = new_blocks([b"a"], [PHASE], [1], [0], [1], True)[0]
    newer = new_blocks([b"a"], [offset], [1], [0], [2], True)
    blocks: dict[bytes, Any] = {b"a": held}
    by_slab: dict[int, dict[int, Any]] = {0: {PHASE: held}}
    order: dict[bytes, None] = {b"a": None}
    try:
        done = index(blocks, by_slab, order, newer, PHASE, slab_size)
    except (OverflowError, ValueError):  # refused
        done = None
    if done is None:  # refused, or left to the Python passes: then nothing may have changed
        assert (blocks, by_slab, order, held.live) == ({b"a": held}, {0: {PHASE: held}}, {b"a": None}, True)
        return
    assert done[:2] == ([True], [PHASE])
    assert blocks == {b"a": newer[0]} and order == {b"a": None} and not held.live
    assert by_slab == {(offset - PHASE) // slab_size: {offset: newer[0]}}


def test_adv_index_many_survives_a_version_compare_that_empties_the_batch() -> None:
    """`index_many` read the batch list by index up to the length it had on entry, trusting that no Python
    code runs meanwhile (a review's find, fixed). A DramBlock's writable fields take ints only through
    `block_setattro`, but the member descriptors bypass it (`DramBlock.version.__set__(b, x)` stores
    anything), so a version whose `__le__` was Python code could empty the batch mid-loop: a read past the
    list's end (a segfault). Now it works on a copy, and a block whose fields are not exact ints is left
    to the Python passes."""
    done = _run_child("""
        from kvpool.core import _native
        from kvpool.core._native import DramBlock
        held = _native.new_blocks([b"a"], [4096], [1], [0], [1], True)[0]
        keys = [b"a"] + [b"k%d" % i for i in range(999)]
        batch = _native.new_blocks(keys, [8192 + 256 * i for i in range(1000)], [1] * 1000, [0] * 1000,
                                   [2] * 1000, True)

        class Emptying(int):
            def __le__(self, other):
                batch.clear()
                return False
            __ge__ = __le__

        DramBlock.version.__set__(held, Emptying(5))
        try:
            _native.index_many({b"a": held}, {0: {4096: held}}, {b"a": None}, batch, 2048, 1 << 20)
        except Exception as e:
            print("raised", type(e).__name__)
        print("survived")
    """)
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr[-2000:])


# ----- new_blocks --------------------------------------------------------------------------------------


def test_adv_new_blocks_survives_an_index_hook_that_empties_a_column() -> None:
    """`new_blocks` took each column with PySequence_Fast, which hands back a list argument itself (a
    review's find, fixed): converting an item (PyNumber_Index) runs its `__index__`, Python code that may
    shrink a column, and the loop then read past the column's end (a segfault). It copies them now."""
    done = _run_child("""
        from kvpool.core import _native
        keys = [b"k%d" % i for i in range(1000)]

        class Shrinking:
            def __index__(self):
                keys.clear()
                return 4096

        try:
            made = _native.new_blocks(keys, [Shrinking()] + [4096] * 999, [1] * 1000, [0] * 1000, None, True)
            print("made", len(made))
        except Exception as e:
            print("raised", type(e).__name__)
        print("survived")
    """)
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr[-2000:])


# ----- split_keys ---------------------------------------------------------------------------------------


def _outcome(split: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    try:
        keys, end = split(*args)
    except (ValueError, ProtocolError):  # (the extension's ValueError; the fallback's, or numpy's)
        return ("truncated",)
    return ("bad length", end) if keys is None else ("keys", [bytes(k) for k in keys], end)


def test_adv_split_keys_native_and_python_agree_on_malformed_meta() -> None:
    """Both ways of cutting a batch's keys give the same outcome (the keys and the end, the first length out
    of range, or ValueError) on random metadata: every truncation, zero-length keys, lengths past `max_key`,
    `pos` at or past the end, counts past the metadata.

    The Python fallback, `_py_split_keys`, gave keys of different lengths that the metadata cuts short
    back short, with an end past the metadata, where the extension raises (unpack_batch refused the batch
    all the same, by its end check; a review's find, fixed: the fallback raises ProtocolError)."""
    native = P._split_keys
    # lengths 1 and 2, then b"ab" of the three key bytes: both raise (the fallback cut [b"a", b"b"])
    assert _outcome(native, b"\x01\x00\x02\x00ab", 2, 0, 511) == ("truncated",)
    rng = random.Random(7)
    for trial in range(20_000):
        size = rng.randint(0, 48)
        meta = bytes(rng.choice((0, 1, 2, 3, 255)) if rng.random() < 0.7 else rng.randrange(256)
                     for _ in range(size))
        n = rng.choice((0, 1, 2, 3, rng.randint(0, 30)))
        pos = rng.choice((0, 1, 4, size, size + 1, rng.randint(0, size + 2)))
        max_key = rng.choice((0, 1, 2, 3, 511, 65535, -1))
        got, want = _outcome(native, meta, n, pos, max_key), _outcome(P._py_split_keys, meta, n, pos, max_key)
        assert got == want, (trial, meta, n, pos, max_key)


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_adv_native_split_keys_of_other_buffers_are_exact_bytes(kind: type) -> None:
    """The extension takes any contiguous buffer and cuts exact bytes keys (the Python fallback's slices of
    a bytearray or memoryview are of that type, for keys of different lengths: it is handed bytes only)."""
    for keys in ([b"a", b"bc", b"\x00ef"], [b"xy", b"z\x00"]):
        meta = P.pack_batch(keys)
        got, end = P._split_keys(kind(meta), len(keys), 4, 511)
        assert got == keys and end == len(meta) and all(type(k) is bytes for k in got)


# ----- ChangeLog against the flat log it replaced ------------------------------------------------------


class _FlatLog:
    """The change log before 8498804: a flat list of (key, version, kind, at_ms), cut change by change."""

    def __init__(self, covered_since_ms: int, max_entries: int) -> None:
        self.max_entries, self.covered_since_ms = max_entries, covered_since_ms
        self.entries: list[tuple[bytes, int, int, int]] = []
        self.first_seq = self.last_ms = 0

    def add(self, keys: list[bytes], versions: list[int], kind: int) -> None:
        at = self.last_ms = max(int(time.time() * 1000), self.last_ms)
        self.entries += [(k, v, kind, at) for k, v in zip(keys, versions)]
        excess = len(self.entries) - self.max_entries
        if excess > 0:
            gone = self.entries[excess - 1]
            del self.entries[:excess]
            self.first_seq += excess
            self.covered_since_ms = max(self.covered_since_ms, gone[3] + 1)

    def puts_since(self, seq: int) -> set[bytes] | None:
        n = self.first_seq + len(self.entries) - seq
        if seq < self.first_seq or n < 0:
            return None
        return {k for k, _, kind, _ in self.entries[len(self.entries) - n:] if kind == PUT}

    def since(self, since_ms: int, from_seq: int, limit: int) -> tuple[list[tuple[bytes, int, int, int]], int]:
        entries = self.entries
        start = max(from_seq - self.first_seq, 0)
        if start == 0:
            start = next((i for i, e in enumerate(entries) if e[3] >= since_ms), len(entries))
        out = entries[start:start + limit]
        end = start + len(out)
        return out, (self.first_seq + end if end < len(entries) else -1)


@pytest.mark.parametrize("max_entries", [0, 1, 2, 7, 40])
def test_adv_change_log_matches_the_flat_log_it_replaced(max_entries: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond the existing comparison (pages of 4 from the sequence numbers returned): any `from_seq`
    (negative, before the log, mid-batch, at and past its end), page sizes 0, 1, 3 and 2^15, `max_entries`
    0, records of mismatched key and version counts (the pairs there are), keys and versions as iterators,
    tuples or a dict and its values, and a wall clock that steps back (times only grow)."""
    rng = random.Random(max_entries)
    clock = [1_000_000]
    monkeypatch.setattr(time, "time", lambda: clock[0] / 1000)
    covered = rng.choice((0, 500))
    log, flat = ChangeLog(covered_since_ms=covered, max_entries=max_entries), _FlatLog(covered, max_entries)
    version = 1
    for step in range(150):
        clock[0] += rng.choice((0, 0, 1, 3, -4))
        n = rng.randint(0, 12)
        keys = [b"k%d" % rng.randint(0, 25) for _ in range(n)]
        versions = list(range(version, version + max(n + rng.choice((0, 0, 0, -1, 2)), 0)))
        version += n + 2
        kind = rng.choice((PUT, PUT, REMOVE, CLEAR))
        if kind == CLEAR:
            log.record_clear(b"p%d" % step, version)
            flat.add([b"p%d" % step], [version], CLEAR)
        else:
            shape = rng.choice(("list", "tuple", "iter", "dict"))
            if shape == "dict":
                given: tuple[Any, Any] = (dict(zip(keys, versions)), dict(zip(keys, versions)).values())
                keys, versions = list(given[0]), list(given[1])
            elif shape == "tuple":
                given = (tuple(keys), tuple(versions))
            elif shape == "iter":
                given = (iter(keys), iter(versions))
            else:
                given = (keys, versions)
            log.record(given[0], given[1], kind == REMOVE)
            flat.add(keys, versions, kind)
        next_seq = flat.first_seq + len(flat.entries)
        assert (len(log), log.next_seq, log.covered_since_ms) == \
            (len(flat.entries), next_seq, flat.covered_since_ms), step
        for seq in range(-1, next_seq + 2):
            assert log.puts_since(seq) == flat.puts_since(seq), (step, seq)
        for since_ms in (0, clock[0] - 3, clock[0], clock[0] + 1):
            for from_seq in {-5, 0, flat.first_seq - 1, flat.first_seq, flat.first_seq + 1, next_seq - 1,
                             next_seq, next_seq + 3, rng.randint(0, next_seq + 1)}:
                for limit in (0, 1, 3, 1 << 15):
                    page, nxt = log.since(since_ms, from_seq, limit)
                    assert ([(c.key, c.version, c.kind, c.at_ms) for c in page], nxt) == \
                        flat.since(since_ms, from_seq, limit), (step, since_ms, from_seq, limit)


# ----- free_many against _free_each --------------------------------------------------------------------


def _arena_state(arena: DramArena) -> tuple[Any, ...]:
    return ({n: (s.cls, list(s.free), s.used) for n, s in arena._slabs.items()},
            [list(p) for p in arena._partial], list(arena._free_slabs), arena.used_bytes)


@pytest.mark.parametrize("case", ["double free", "misaligned", "two slabs", "generator", "empties the slab"])
def test_adv_free_many_at_once_leaves_what_slot_by_slot_frees_do_on_odd_batches(case: str) -> None:
    """A batch freed at once (>= 8 slots of one slab) ends as the slot by slot frees leave the arena even
    where the batch is wrong (a slot twice, offsets between slots), and a batch over two slabs or given
    as an iterator is freed slot by slot (or at once) to the same end."""
    pair = [DramArena(8 * MiB, slab_size=1 * MiB, shared=False, prefault=False) for _ in range(2)]
    try:
        held = [a.alloc_many([4 * KiB] * 300) for a in pair][0]  # 256 slots a slab: slabs 0 and 1
        assert None not in held
        slab0 = [off for off in held if off is not None and (off - PHASE) // MiB == 0]
        batch: list[int] = {
            "double free": slab0[:7] + slab0[:1],
            "misaligned": [off + 64 for off in slab0[10:20]],
            "two slabs": slab0[:9] + [off for off in held if off is not None and off not in slab0][:1],
            "generator": slab0[:12],
            "empties the slab": slab0,
        }[case]
        at_once, each = pair
        at_once.free_many(iter(batch) if case == "generator" else batch)
        each._free_each(batch)
        assert _arena_state(at_once) == _arena_state(each)
        if case in ("generator", "two slabs", "empties the slab"):
            assert at_once.check() == []
    finally:
        for a in pair:
            a.close()


def test_adv_free_many_of_a_slab_never_allocated_raises_as_slot_by_slot_frees_do() -> None:
    pair = [DramArena(8 * MiB, slab_size=1 * MiB, shared=False, prefault=False) for _ in range(2)]
    try:
        for a in pair:
            a.alloc_many([4 * KiB] * 10)
        stray = [PHASE + 5 * MiB + i * 4 * KiB for i in range(9)]  # slab 5: no class, no slots handed out
        with pytest.raises(KeyError):
            pair[0].free_many(stray)
        with pytest.raises(KeyError):
            pair[1]._free_each(stray)
        assert _arena_state(pair[0]) == _arena_state(pair[1])
    finally:
        for a in pair:
            a.close()

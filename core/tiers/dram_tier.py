"""The DRAM tier: committed blocks in the shared-memory arena by key, their eviction order, leases
and pins, and the choice of which blocks leave when a slot is needed.

It holds no lock of its own: the cache calls every method with its lock held. Where evicted blocks
go (demotion to SSD) is the cache's business; this tier chooses them and unlinks them. A block
unlinked while leased keeps its slot until its last lease ends, so a reader's view stays valid.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice, repeat
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..blocks import BlockMeta, checksum
from ..pins import Pins
from ..policies import EVICTION_POLICY
from ..stats import CacheCounters
from .dram import PHASE, DramArena

__all__ = ["BlockRef", "DramBlock", "DramTier", "PyDramBlock", "block_columns", "block_meta", "new_blocks"]


class BlockRef(Protocol):
    """A leased DRAM block as `TieredCache.acquire` hands it out: where its bytes lie in the arena
    (`offset`, `size` in bytes), their XXH3-64 `checksum` and the block's `version`
    (`kvpool.core.versions`). Valid until `TieredCache.release(ref)`."""

    @property
    def key(self) -> bytes: ...
    @property
    def offset(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def checksum(self) -> int: ...
    @property
    def version(self) -> int: ...


@dataclass(eq=False, slots=True)
class DramBlock:
    """A committed block in the DRAM arena (the tier's index entry; a `BlockRef` to lease holders).

    Where the C extension was built this is `kvpool.core._native.DramBlock`, the same fields in a type
    the cyclic garbage collector does not track: a worker holds one per block, millions of them, and a
    full collection that walks every one holds the GIL for 0.22-0.29 s per million (docs/BENCHMARKS.md, run
    AL). This dataclass, the same without the extension, is what the type checker sees."""

    key: bytes
    offset: int
    size: int
    checksum: int
    expires: float  # unix seconds; 0 = never
    leases: int = 0
    pinned: bool = False
    live: bool = True  # False once replaced, removed or evicted; the slot is freed at zero leases
    on_ssd: bool = False  # an identical copy is committed in the SSD tier
    version: int = 0  # kvpool.core.versions; 0: none
    checked: bool = True  # False: committed on its writer's checksum, its bytes not hashed yet (see TierMoves.checked)

    def expired(self, now: float) -> bool:
        return bool(self.expires) and self.expires <= now


PyDramBlock = DramBlock
"""The dataclass, whichever type `DramBlock` is here (the tests hold both to one contract)."""

_native_columns: Callable[[Sequence[BlockRef]], bytes] | None = None
_native_new_blocks: Callable[..., list[DramBlock]] | None = None
_native_index_many: Callable[..., tuple[list[bool], list[int], list[DramBlock], int] | None] | None = None
if not TYPE_CHECKING:
    try:
        from .._native import DramBlock  # the same fields, untracked by the GC (see above)
        from .._native import block_columns as _native_columns
        from .._native import index_many as _native_index_many
        from .._native import new_blocks as _native_new_blocks
    except ImportError:  # no C compiler when it was installed
        pass


def block_columns(blocks: Sequence[BlockRef]) -> bytes:
    """The blocks' offsets and sizes (int64), checksums and versions (uint64), little-endian, column
    after column: a LEASE reply's columns of its hits, made in one native pass where the blocks are the
    extension's `DramBlock`s (else a numpy pass per column)."""
    if _native_columns is not None:
        try:
            return _native_columns(blocks)
        except TypeError:  # other blocks (the dataclass, in tests)
            pass
    n = len(blocks)
    return b"".join(np.fromiter((getattr(b, field) for b in blocks), dtype=dtype, count=n).tobytes()
                    for field, dtype in (("offset", "<i8"), ("size", "<i8"), ("checksum", "<u8"), ("version", "<u8")))


def new_blocks(keys: Iterable[bytes], offsets: Iterable[int], sizes: Iterable[int], checksums: Iterable[int],
               versions: Iterable[int] | None, checked: bool) -> list[DramBlock]:
    """A block per key, as committed together (no TTL; version 0 where `versions` is None), built
    in one pass (in C where the extension was built: a same-node put's commit makes one per block)."""
    if _native_new_blocks is not None:
        return _native_new_blocks(keys, offsets, sizes, checksums, versions, checked)
    return list(map(DramBlock, keys, offsets, sizes, checksums, repeat(0.0), repeat(0), repeat(False),
                    repeat(True), repeat(False), repeat(0) if versions is None else versions, repeat(checked)))


def block_meta(b: DramBlock) -> BlockMeta:
    """What a block's SSD header records of it."""
    return BlockMeta(b.size, b.checksum, b.expires, b.version)


SCAN = 4096
"""How many of the least recently used evictable blocks a search for room looks at before it looks at
all of them (`DramTier.victims_for`): with millions of blocks, a walk over every one held the cache's
lock for 0.4-0.8 s, once per slab taken from another size class."""

Evict = Callable[[list[DramBlock], list[DramBlock]], None]
"""The cache's eviction: demote a batch (second list, which includes the first) to SSD, then drop the
first list's blocks from DRAM."""


class DramTier:
    """Blocks in `arena` by key, in the order `policy` (a key of `EVICTION_POLICY`) evicts them."""

    def __init__(self, arena: DramArena, policy: str, counters: CacheCounters) -> None:
        self.arena = arena
        self.blocks: dict[bytes, DramBlock] = {}
        self.by_slab: dict[int, dict[int, DramBlock]] = {}
        """The indexed blocks of each slab, by offset: a slab's blocks without a walk over every block
        (`victims_for`, `free_a_slab_by_moving`)."""
        self.order = EVICTION_POLICY[policy]()
        self.pins = Pins(self.blocks)
        self._counters = counters
        self.leases = 0
        """Leases held now, over all blocks (a reader that never releases shows here)."""
        self.timed = 0
        """Indexed blocks that have a TTL (none: lookups need not check expiry)."""
        self._reserved = 0  # slots allocated for blocks not yet committed (a put's, a promotion's)
        self._unlinked: set[DramBlock] = set()  # dropped while leased: their slots are freed at release

    def __len__(self) -> int:
        return len(self.blocks)

    # ----- slots and the index ------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int | None:
        """A slot for a block of `nbytes` about to be written (`insert` or `unreserve` it), or None
        when the arena has no free slot of that class."""
        offset = self.arena.alloc(nbytes)
        if offset is not None:
            self._reserved += 1
        return offset

    def alloc_many(self, sizes: Sequence[int]) -> list[int | None]:
        """`alloc` of each size, in one call."""
        offsets = self.arena.alloc_many(sizes)
        self._reserved += len(offsets) - offsets.count(None)
        return offsets

    def unreserve(self, offset: int) -> None:
        """Free a slot from `alloc` that will not be committed."""
        self.arena.free(offset)
        self._reserved -= 1

    def insert(self, block: DramBlock) -> None:
        """Index a block written into a slot from `alloc` (drop any older block of its key first). A
        live pin on its key pins it."""
        self._reserved -= 1
        self.blocks[block.key] = block
        self._place_many((block,))
        self.order.add(block.key)
        if block.expires:
            self.timed += 1
        if self.pins.claim(block.key):
            block.pinned = True

    def insert_many(self, blocks: list[DramBlock]) -> list[bool]:
        """`insert` of each block (their keys distinct and unpinned), in bulk: a block older than or as
        old as the one its key holds is not inserted (its slot is freed; False), a newer one replaces it.
        The index work is one pass in C where the extension was built (`_native.index_many`; a same-node
        put's commit: ~1.7 us a block in Python), else the passes below."""
        if _native_index_many is not None:
            done = _native_index_many(self.blocks, self.by_slab, self.order.table, blocks, PHASE,
                                      self.arena.slab_size)
            if done is not None:  # (None: a block of the dataclass, or not as made: the Python passes)
                stored, free, unlinked, timed = done
                self.arena.free_many(free)
                self._unlinked.update(unlinked)
                self._reserved -= len(blocks)
                self.timed += timed
                return stored
        get = self.blocks.get
        held = list(map(get, [b.key for b in blocks]))
        stored = [True] * len(blocks)
        if held.count(None) < len(held):  # replacements: the version decides, key by key
            replaced: list[DramBlock] = []
            for i, (b, old) in enumerate(zip(blocks, held)):
                if old is None:
                    continue
                if b.version <= old.version:
                    self.unreserve(b.offset)
                    stored[i] = False
                else:
                    replaced.append(old)
            self._unlink(replaced)
            blocks = [b for b, ok in zip(blocks, stored) if ok]
        keys = [b.key for b in blocks]
        self.blocks.update(zip(keys, blocks))
        self._place_many(blocks)
        self.order.extend(keys)
        self._reserved -= len(blocks)
        self.timed += sum(1 for b in blocks if b.expires)
        return stored

    def _place_many(self, blocks: Iterable[DramBlock]) -> None:
        """Each block in its slab's table (a loop with its names bound once: a same-node put's hottest)."""
        by_slab, slab_size = self.by_slab, self.arena.slab_size
        for b in blocks:
            offset = b.offset
            placed = by_slab.get(slab_no := (offset - PHASE) // slab_size)
            if placed is None:
                by_slab[slab_no] = {offset: b}
            else:
                placed[offset] = b

    def _unplace_many(self, blocks: Iterable[DramBlock]) -> None:
        """Each block out of its slab's table."""
        by_slab, slab_size = self.by_slab, self.arena.slab_size
        for b in blocks:
            offset = b.offset
            placed = by_slab[slab_no := (offset - PHASE) // slab_size]
            del placed[offset]
            if not placed:
                del by_slab[slab_no]

    def _unlink(self, replaced: list[DramBlock]) -> None:
        """`drop` of each block, all indexed, whose key is about to get a new block (`insert_many`): the
        index entries are overwritten then, the rest happens here."""
        self.order.discard_many([b.key for b in replaced])
        self._let_go_many(replaced)

    def drop(self, key: bytes) -> DramBlock | None:
        """Unlink the block of `key` (None if there is none); its slot is freed now, or when its last
        lease ends. A pin on the key waits for a block again, as one made before its block came does."""
        b = self.blocks.pop(key, None)
        if b is None:
            return None
        self.order.discard(key)
        self._let_go(b)
        if b.pinned:
            self.pins.left(key)
        return b

    def _let_go(self, b: DramBlock) -> None:
        self._let_go_many((b,))

    def _let_go_many(self, blocks: Sequence[DramBlock]) -> None:
        """Blocks just taken out of the index: no longer live, out of their slabs' tables, their slots
        freed now (together), or each at its last lease's end."""
        self._unplace_many(blocks)
        free: list[int] = []
        for b in blocks:
            b.live = False
            if b.expires:
                self.timed -= 1
            if b.leases == 0:
                free.append(b.offset)
            else:
                self._unlinked.add(b)
        self.arena.free_many(free)

    def forked(self) -> None:
        """In a forked child, whose SSD tier stays the parent's: no block has a copy there."""
        for b in self.blocks.values():
            b.on_ssd = False

    def lease(self, b: DramBlock) -> None:
        """One more lease of `b`: it is neither evicted nor freed until `release`."""
        b.leases += 1
        self.leases += 1

    def release(self, b: DramBlock) -> None:
        """End one lease of `b`; the last lease of an unlinked block frees its slot."""
        b.leases -= 1
        self.leases -= 1
        if b.leases == 0 and not b.live:
            self.arena.free(b.offset)
            self._unlinked.discard(b)

    def clear(self) -> None:
        for k in list(self.blocks):
            self.drop(k)

    def view(self, b: DramBlock) -> memoryview:
        return self.arena.view(b.offset, b.size)

    # ----- choosing victims -------------------------------------------------------------------------

    def evictable(self, b: DramBlock) -> bool:
        return b.leases == 0 and not b.pinned

    def lru_victims(self, nbytes: float, at_most: int) -> list[DramBlock]:
        """Evictable blocks, first to go first, whose slots add up to `nbytes` (at most `at_most` bytes)."""
        out: list[DramBlock] = []
        freed = 0
        for k in self.order:
            if freed >= nbytes or freed >= at_most:
                break
            b = self.blocks[k]
            if self.evictable(b):
                out.append(b)
                freed += self.arena.slot_size(b.offset)
        return out

    def victims_for(self, n: int) -> tuple[list[DramBlock], list[DramBlock]]:
        """Blocks to evict so that a slot for `n` bytes frees up, and the batch to demote with them.

        Among the `SCAN` least recently used evictable blocks: the first of `n`'s size class frees
        a slot, and the next few of that class go to SSD in the same transaction but stay in DRAM
        (their eviction later costs no write). Failing that, every block of the least recently used
        slab (of another class) among them whose blocks are all evictable, so the slab returns to the
        free pool for any class: a class that finds its own blocks only among recent ones takes room
        from old blocks of another, as a whole-cache LRU would. Only where the `SCAN` oldest give
        neither is every block looked at (pins and leases everywhere)."""
        cls = self.arena.class_of(n)
        blocks, evictable = self.blocks, self.evictable
        oldest = list(islice((k for k in self.order if evictable(blocks[k])), SCAN))  # (past pinned ones)
        found = self._victims_among(iter(oldest), cls)
        if found[0] or len(oldest) < SCAN:  # (fewer: those were every evictable block)
            return found
        return self._victims_among(iter(self.order), cls)

    def _victims_among(self, keys: Iterator[bytes], cls: int) -> tuple[list[DramBlock], list[DramBlock]]:
        """`victims_for` looking at the blocks of `keys` (least recently used first) only."""
        class_of, slab_of, blocks = self.arena.class_of, self.arena.slab_of, self.blocks
        same: list[DramBlock] = []
        slabs: dict[int, None] = {}  # slabs of other classes, least recently used first
        for k in keys:
            b = blocks[k]
            if not self.evictable(b):
                continue
            if class_of(b.size) == cls:
                same.append(b)
                if len(same) >= 8:
                    break
            else:
                slabs.setdefault(slab_of(b.offset))
        if same:
            return same[:1], same
        for slab in slabs:
            whole = self._slab_blocks(slab)
            if whole is not None:
                return whole, whole
        return [], []

    def _slab_blocks(self, slab: int) -> list[DramBlock] | None:
        """The blocks of `slab` if every slot it has handed out holds an evictable indexed block (none
        reserved for a put under way, none unlinked but leased, none leased or pinned), else None."""
        placed = self.by_slab.get(slab, {})
        if len(placed) != self.arena.slab_used(slab):
            return None
        out = list(placed.values())
        return out if all(map(self.evictable, out)) else None

    def _blocks_by_slab(self) -> dict[int, list[DramBlock]]:
        return {slab: list(placed.values()) for slab, placed in self.by_slab.items()}

    def free_a_slab_by_moving(self, n: int, evict: Evict) -> bool:
        """Free a whole slab of another size class for a block of `n` bytes when every slab holds some
        pinned block (a few pinned blocks spread over many slabs would otherwise refuse puts while
        DRAM is mostly free): evict the slab's evictable blocks and copy its pinned ones into free
        slots of their class in other slabs. Only a slab with no leased block moves (a reader's view
        stays valid); the fewest pinned blocks move first. False if no slab can be freed so."""
        cls = self.arena.class_of(n)
        by_slab = self._blocks_by_slab()
        candidates = sorted((sum(b.pinned for b in bs), slab) for slab, bs in by_slab.items()
                            if self.arena.class_of(bs[0].size) != cls and not any(b.leases for b in bs))
        for _, slab in candidates:
            # as of now: making room for an earlier candidate may have evicted some of these blocks
            blocks = [b for b in by_slab[slab] if b.live and self.blocks.get(b.key) is b]
            if any(b.leases for b in blocks):
                continue
            pinned = [b for b in blocks if b.pinned]
            self._make_room_elsewhere(pinned, slab, evict)
            moved: list[tuple[DramBlock, int]] = []
            for b in pinned:
                dest = self.arena.alloc_elsewhere(b.size, slab)
                if dest is None:
                    break
                moved.append((b, dest))
            if len(moved) < len(pinned):  # no room for all of them elsewhere: undo, try the next slab
                for _, dest in moved:
                    self.arena.free(dest)
                continue
            buf = self.arena.buf
            for b, dest in moved:
                buf[dest:dest + b.size] = buf[b.offset:b.offset + b.size]
                self.arena.free(b.offset)
                self._unplace_many((b,))
                b.offset = dest
                self._place_many((b,))
            self._counters.relocations += len(moved)
            rest = [b for b in blocks if not b.pinned]
            if rest:
                evict(rest, rest)
            return True
        return False

    def _make_room_elsewhere(self, blocks: list[DramBlock], slab: int, evict: Evict) -> None:
        """Evict the least recently used evictable blocks of `blocks`' class outside `slab`, as many
        as `blocks`, so that they can move there (their slots may be free already: then a few blocks
        leave DRAM early)."""
        if not blocks:
            return
        cls = self.arena.class_of(blocks[0].size)
        room: list[DramBlock] = []
        for k in self.order:
            b = self.blocks[k]
            if self.evictable(b) and self.arena.slab_of(b.offset) != slab and self.arena.class_of(b.size) == cls:
                room.append(b)
                if len(room) == len(blocks):
                    break
        if room:
            evict(room, room)

    # ----- consistency ------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """What is wrong with this tier (empty when consistent): the allocator's own bookkeeping; every
        allocated slot is an indexed block's, an unlinked leased block's or a reservation's, and no
        two share one; the order holds exactly the indexed keys; leases are not negative; every
        block's bytes match its checksum; pins agree with the pinned blocks."""
        errors = self.arena.check()
        blocks, unlinked = self.blocks, self._unlinked
        if sum(1 for b in blocks.values() if b.expires) != self.timed:
            errors.append(f"{self.timed} DRAM blocks counted with a TTL; the index holds "
                          f"{sum(1 for b in blocks.values() if b.expires)}")
        placed = {off: b for slab in self.by_slab.values() for off, b in slab.items()}
        if placed != {b.offset: b for b in blocks.values()} or any(
                self.arena.slab_of(off) != slab_no for slab_no, slab in self.by_slab.items() for off in slab):
            errors.append("the index by slab does not hold exactly the indexed blocks, each in its slab")
        if set(self.order) != blocks.keys():
            errors.append(f"eviction order holds {len(self.order)} keys, the index {len(blocks)}")
        for k, b in blocks.items():
            if b.key != k or not b.live or b.leases < 0 or b.size > self.arena.max_block:
                errors.append(f"DRAM block {k[:24]!r}: key {b.key[:24]!r}, live {b.live}, {b.leases} leases, "
                              f"{b.size} bytes")
            elif b.size > self.arena.slot_size(b.offset):
                errors.append(f"DRAM block {k[:24]!r} of {b.size} bytes lies in a slot of "
                              f"{self.arena.slot_size(b.offset)}")
            elif checksum(self.view(b)) != b.checksum:
                errors.append(f"DRAM block {k[:24]!r}: its bytes do not match their checksum")
        if any(b.live or b.leases <= 0 for b in unlinked):
            errors.append("an unlinked DRAM block is live or no longer leased, but its slot is held")
        held_leases = sum(b.leases for b in blocks.values()) + sum(b.leases for b in unlinked)
        if held_leases != self.leases:
            errors.append(f"{self.leases} leases counted; the blocks hold {held_leases}")
        held = [b.offset for b in blocks.values()] + [b.offset for b in unlinked]
        allocated = self.arena.allocated()
        if len(set(held)) != len(held):
            errors.append("two DRAM blocks share a slot")
        if not allocated.issuperset(held):
            errors.append(f"{len(set(held) - allocated)} DRAM blocks lie in free slots")
        if len(allocated) != len(set(held)) + self._reserved:
            errors.append(f"{len(allocated)} slots allocated; {len(blocks)} blocks indexed, {len(unlinked)} "
                          f"unlinked but leased, {self._reserved} reserved")
        return errors + self.pins.check()

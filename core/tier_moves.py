"""Blocks moving between tiers: room made in DRAM by eviction (demoting the victims to SSD in one
batched transaction), trimming of a full SSD tier, and on the way up the read path: a lease of a DRAM
block or of an SSD hit promoted into DRAM, and device copies of what was read or put as a tensor.

SSD writes of blocks that stay in DRAM (the demoter's, `flush`'s) run outside the cache's lock on
blocks held leased; `begin_write`/`end_write` bracket them, and a put that finds DRAM full of such
blocks waits for them instead of failing.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from .blocks import BlockMeta
from .buffers import Destination
from .errors import BufferSizeError, CapacityError, PoolClosed
from .fastcopy import hash_at
from .sparse_log import SparseLog
from .tier_stack import TierStack
from .tiers.dram_tier import DramBlock, block_meta

_device_log = SparseLog(logging.getLogger("kvpool.cache"))

__all__ = ["TierMoves"]

_FLUSH_BATCH = 1024
"""Blocks `flush` writes per LMDB transaction at most (4 MiB of 4 KiB blocks: per-transaction costs
amortised, while LMDB's dirty-page list stays far below the size at which it spills) ..."""
_FLUSH_BATCH_BYTES = 64 << 20
"""... and bytes at most: LMDB holds a transaction's dirty pages in the writer's heap until it commits
(1024 blocks of 1 MiB took a stopping worker's heap 36 -> 648 MiB; of 4 MiB it would need 4 GiB)."""


def _batches(blocks: list[DramBlock], max_bytes: int, size: Callable[[DramBlock], int]) -> list[list[DramBlock]]:
    """`blocks` in order, cut into `flush`'s transactions: at most `_FLUSH_BATCH` blocks, and `max_bytes`
    of what they take in LMDB (`size`)."""
    out: list[list[DramBlock]] = [[]]
    held = 0
    for b in blocks:
        n = size(b)
        if out[-1] and (len(out[-1]) >= _FLUSH_BATCH or held + n > max_bytes):
            out.append([])
            held = 0
        out[-1].append(b)
        held += n
    return [batch for batch in out if batch]


class TierMoves:
    """The moves of `stack`'s blocks. Methods say whether they expect the stack's lock held."""

    def __init__(self, stack: TierStack) -> None:
        self._stack = stack
        self._writes = 0  # batches being written to SSD outside the lock, each holding its blocks leased
        self._batches: list[list[DramBlock]] = []  # those batches (their leases end in a forked child)
        self._reads = 0  # promotions reading SSD outside the lock (`wait_for_ssd`)
        self._written = stack.written  # notified as each lets go of them

    def forked(self) -> None:
        """In a forked child: the SSD writes and reads the parent's threads had under way never end here,
        so their batches' leases end now. Lock held."""
        for batch in self._batches:
            for b in batch:
                self._stack.dram.release(b)
        self._batches.clear()
        self._writes = self._reads = 0

    def alloc(self, n: int) -> int:
        """A DRAM slot for `n` bytes, evicting (demoting) synchronously if the demoter fell behind, and
        waiting for blocks that an SSD write in flight holds rather than failing for them. Raises
        CapacityError when every block is leased or pinned. Lock held."""
        stack = self._stack
        dram = stack.dram
        while True:
            offset = dram.alloc(n)
            if offset is not None:
                return offset
            dram.pins.expire()  # expired pins are evictable again before room is looked for
            victims, batch = dram.victims_for(n)
            if not victims and self._writes:
                self._written.wait()  # blocks held by a batch being written are free again soon
                stack.check_open()
                continue
            if not victims:
                if dram.free_a_slab_by_moving(n, self.evict):
                    continue
                raise CapacityError(
                    f"no room for a {n}-byte block: DRAM arena of {dram.arena.size} bytes is full of "
                    f"leased or pinned blocks ({len(dram)} blocks)", size=n, limit=dram.arena.size)
            self.evict(victims, batch)

    def alloc_many(self, sizes: Sequence[int]) -> list[int | None]:
        """`alloc` of each size (a batch's slots in one pass while there is room); None for each that
        found no room. Lock held."""
        offsets = self._stack.dram.alloc_many(sizes)
        if None not in offsets:  # (the usual batch: a slot for each)
            return offsets
        for i, off in enumerate(offsets):
            if off is None:
                try:
                    offsets[i] = self.alloc(sizes[i])
                except CapacityError:
                    pass
        return offsets

    def evict(self, victims: list[DramBlock], batch: list[DramBlock]) -> None:
        """Demote `batch` (which includes `victims`) to SSD in one transaction and drop `victims`
        from DRAM. Lock held."""
        stack = self._stack
        self.demote([b for b in batch if not b.on_ssd])
        for b in victims:
            if b.live and stack.dram.blocks.get(b.key) is b:
                self.evicted(b)

    def evicted(self, b: DramBlock) -> None:
        """Drop `b` from DRAM as evicted, counted; a block that leaves with no SSD copy (the SSD tier was
        full, or the block failed its checksum) is lost to the cache: counted as dropped. Lock held."""
        stack = self._stack
        stack.drop_dram(b.key, "evict")
        stack.counters.evictions += 1
        if stack.ssd is not None and not b.on_ssd:
            stack.counters.dropped += 1

    def begin_write(self, blocks: list[DramBlock]) -> None:
        """Hold `blocks` leased for a `demote` outside the lock. Lock held."""
        for b in blocks:
            self._stack.dram.lease(b)
        self._batches.append(blocks)
        self._writes += 1

    def end_write(self, blocks: list[DramBlock]) -> None:
        """Release the blocks of a `begin_write`; wake puts waiting for room. Lock held."""
        for b in blocks:
            self._stack.dram.release(b)
        self._batches.remove(blocks)
        self._writes -= 1
        self._written.notify_all()

    def wait_for_writes(self) -> None:
        """Until no SSD write is in flight (each has written copies it has not indexed yet). Lock held."""
        while self._writes:
            self._written.wait()

    def wait_for_ssd(self) -> None:
        """Until no SSD write nor read is in flight (a read copies out of LMDB's map): the store may
        close. Lock held."""
        while self._writes or self._reads:
            self._written.wait()

    def demote(self, blocks: list[DramBlock]) -> int:
        """Write blocks, leased or with the lock held, to SSD in one transaction and index them (they
        stay in DRAM); how many were written. A full SSD tier writes none: those later evicted leave the
        cache cleanly (counted as dropped then: `evicted`)."""
        stack = self._stack
        ssd = stack.ssd
        if ssd is None or not blocks:
            return 0
        blocks = [b for b in blocks if b.checked or self.verified(b)]  # a corrupt one is dropped, not written
        if not blocks:
            return 0
        with stack.lock:
            # one write of a key at a time (the one that ended first would queue the other's copy for
            # deletion): one under way ends first; then none replaced or removed since it was picked
            stack.await_writes([b.key for b in blocks])
            blocks = [b for b in blocks if b.live]
            if not blocks:
                return 0
            superseded = ssd.supersede(b.key for b in blocks)
            incoming = sum(ssd.footprint(b.key, b.size) for b in blocks)
            if incoming <= ssd.capacity / 4 and self._trim_ssd(incoming):
                ssd.delete_stale()  # room for this write first: LMDB refuses one that does not fit
            stack.writing.update(b.key for b in blocks)  # a put or remove of one waits for this write's end
        items: list[tuple[bytes, BlockMeta, memoryview]] = []
        try:
            metas = list(map(block_meta, blocks))
            view = stack.dram.view
            items = [(b.key, m, view(b)) for b, m in zip(blocks, metas)]
            ssd.store.batch_put(items)
        except CapacityError:
            with stack.lock:
                ssd.unsupersede(superseded)  # the old copies are still there
                self._written_out(blocks)
            return 0
        except BaseException:
            with stack.lock:
                self._written_out(blocks)  # (whatever LMDB committed is found at the next start, as before)
            raise
        finally:
            del items
        with stack.lock:
            self._written_out(blocks)
            for b, meta in zip(blocks, metas):
                if not b.live:
                    # Replaced, removed, expired or cleared while it was written outside the lock:
                    # that copy must go. A newer copy indexed meantime may have been overwritten
                    # by it, so it goes too (its DRAM block, if any, is written again on eviction).
                    if b.key in ssd:
                        stack.drop_ssd(b.key, "evict")
                    else:
                        ssd.mark_stale((b.key,))
                    continue
                b.on_ssd = True
                if b.key not in ssd:
                    ssd.add(b.key, meta)
                    for listener in stack.listeners:
                        listener.copied(b.key, "ssd")
            stack.counters.demotions += len(blocks)
            self._trim_ssd()
        return len(blocks)

    def _written_out(self, blocks: list[DramBlock]) -> None:
        """The SSD write of `blocks` ended (its copies indexed, or queued for deletion, in the same hold of
        the lock): puts and removes of their keys wait no longer. Lock held."""
        self._stack.writing.difference_update(b.key for b in blocks)
        self._written.notify_all()

    def _trim_ssd(self, incoming: int = 0) -> int:
        """Drop the first SSD blocks to go above the SSD tier's high watermark (`incoming`: bytes about
        to be written, on disk); how many went. Lock held."""
        stack = self._stack
        assert stack.ssd is not None
        gone = stack.ssd.trim(stack.config.high_watermark, stack.config.low_watermark, incoming)
        for k in gone:
            b = stack.dram.blocks.get(k)
            if b is not None:
                b.on_ssd = False
            stack.left(k, "ssd", "evict")
        stack.counters.ssd_evictions += len(gone)
        return len(gone)

    def promote(self, k: bytes, now: float) -> DramBlock | None:
        """Copy a verified SSD block into DRAM and return it leased; None if gone, expired or corrupt,
        or if DRAM has no room (everything leased or pinned: a miss now, not an error)."""
        stack = self._stack
        ssd, dram = stack.ssd, stack.dram
        if ssd is None:
            return None
        with stack.lock:
            size = ssd.size_of(k)
            if size is None or size > dram.arena.max_block:  # (a tier written with larger slabs: a miss here)
                return None
            sized = ssd.version_of(k)  # the copy the slot is sized for
            try:
                offset = self.alloc(size)
            except CapacityError:
                return None
            self._reads += 1

        def into_slot(meta: BlockMeta, payload: memoryview) -> BlockMeta | None:
            if meta.size != size or (meta.expires and meta.expires <= now):
                return None
            dram.arena.buf[offset:offset + size] = payload
            return meta

        try:
            meta = ssd.store.read(k, into_slot)
        except BaseException:
            with stack.lock:
                dram.unreserve(offset)  # (a read that failed: its slot back)
            raise
        finally:
            with stack.lock:
                self._reads -= 1
                self._written.notify_all()
        with stack.lock:
            if meta is None:
                dram.unreserve(offset)
                if k in ssd and ssd.version_of(k) == sized:  # that copy did not read whole: corrupt (or expired);
                    stack.drop_ssd(k, "corrupt")  # another is a newer one put and flushed meanwhile: a miss now
                return None
            current = dram.blocks.get(k)
            if current is not None or k not in ssd or ssd.version_of(k) != meta.version:
                # Put, removed, replaced on SSD (put, flushed and evicted) or promoted by another reader
                # while this one read SSD: what was read may be outdated, so it must not replace what
                # is there now (a miss, if nothing is in DRAM).
                dram.unreserve(offset)
                if current is None:
                    return None
                dram.lease(current)
                stack.counters.hits_dram += 1
                return current
            b = DramBlock(k, offset, size, meta.checksum, meta.expires, on_ssd=True, version=meta.version)
            stack.commit(b)
            dram.lease(b)
            ssd.touch(k)
            stack.counters.hits_ssd += 1
            stack.counters.promotions += 1
        return b

    # ----- the read path ----------------------------------------------------------------------------

    def acquire(self, k: bytes) -> DramBlock | None:
        """Lease the DRAM block of `k`, promoting it from SSD if needed; None on a miss. Lock not held."""
        return self.acquire_many((k,))[0]

    def acquire_many(self, keys: Sequence[bytes]) -> list[DramBlock | None]:
        """`acquire` of each key: the DRAM hits in one pass under one lock (a same-node reader's batch),
        then any other key (expired, on SSD, absent) on its own. Lock not held."""
        stack, dram = self._stack, self._stack.dram
        with stack.lock:
            stack.check_open()
            found = list(map(dram.blocks.get, keys))
            floor = stack.readable_from
            if floor:  # fenced: only what is newer than anything this worker can have missed
                found = [b if b is not None and b.version >= floor else None for b in found]
            if dram.timed:  # TTL'd blocks are held: an expired one is left to the per-key path
                now = time.time()
                found = [None if b is not None and b.expired(now) else b for b in found]
            touch = dram.order.touch
            hits = 0
            every = stack.config.verify_dram_reads
            unchecked: list[int] = []
            for i, b in enumerate(found):
                if b is not None:
                    b.leases += 1  # DramTier.lease, inlined on the hottest path
                    touch(b.key)
                    hits += 1
                    if every or not b.checked:
                        unchecked.append(i)
            dram.leases += hits
            stack.counters.hits_dram += hits
        if unchecked:  # committed on their writer's word (or every read is checked): hashed before a byte goes out
            good = self.verified_many([cast(DramBlock, found[i]) for i in unchecked])
            bad = [i for i, ok in zip(unchecked, good) if not ok]
            if bad:
                with stack.lock:
                    for i in bad:
                        dram.release(cast(DramBlock, found[i]))
                        found[i] = None
                    stack.counters.hits_dram -= len(bad)  # not served: `_acquire_one` counts its miss
                hits -= len(bad)
        if hits < len(found):
            found = [b if b is not None else self._acquire_one(k) for k, b in zip(keys, found)]
        return found

    def _acquire_one(self, k: bytes) -> DramBlock | None:
        now = time.time()
        stack, dram = self._stack, self._stack.dram
        with stack.lock:
            stack.check_open()
            floor = stack.readable_from
            b = dram.blocks.get(k)
            if b is not None and b.version < floor:
                b = None
            if b is not None and b.expired(now):
                stack.drop_dram(k, "expire")
                b = None
            if b is not None:
                b.leases += 1  # DramTier.lease, inlined on the hottest path
                dram.leases += 1
                dram.order.touch(k)
                stack.counters.hits_dram += 1
                return b
            on_ssd = stack.on_ssd(k, now) and (not floor or stack.version_of(k) >= floor)
        if on_ssd:
            b = self.promote(k, now)
            if b is not None:
                return b
        with stack.lock:
            stack.counters.misses += 1
        return None

    def verified(self, b: DramBlock) -> bool:
        """False if the leased block's bytes fail their checksum, hashed where the block was committed
        unchecked (the first time only) or `verify_dram_reads` is set (every time); the block is then
        dropped: a miss. Lock not held."""
        return self.verified_many([b])[0]

    def verified_many(self, blocks: Sequence[DramBlock]) -> list[bool]:
        """`verified` of each leased block, those to hash hashed in one call that lets go of the GIL."""
        stack = self._stack
        every = stack.config.verify_dram_reads
        todo = [b for b in blocks if every or not b.checked]
        if not todo:
            return [True] * len(blocks)
        offsets = np.fromiter((b.offset for b in todo), dtype="<i8", count=len(todo))
        sizes = np.fromiter((b.size for b in todo), dtype="<i8", count=len(todo))
        buf = stack.dram.arena.buf  # (held here, the memory stays mapped through a close meanwhile)
        if buf is None:
            raise PoolClosed("the cache was closed during the call")
        bad: set[int] = set()
        for b, got in zip(todo, hash_at(buf, offsets, sizes).tolist()):
            if got == b.checksum:
                b.checked = True
            else:
                bad.add(id(b))
        if bad:
            with stack.lock:
                for b in todo:
                    if id(b) in bad:
                        stack.counters.checksum_failures += 1
                        if stack.dram.blocks.get(b.key) is b:
                            stack.drop_dram(b.key, "corrupt")
        return [id(b) not in bad for b in blocks]

    def copy_to_device(self, k: bytes, t: Any, block: DramBlock) -> None:
        """Keep a device copy of tensor `t`, the bytes of `block`, unless `block` was replaced meantime.
        Lock not held."""
        stack = self._stack
        device = stack.device
        if device is None or not device.fits(t):
            return
        with stack.lock:
            if stack.dram.blocks.get(k) is not block:
                return  # replaced, removed or evicted since it was read: the copy could be stale
            try:
                stack.counters.device_evictions += device.put(k, t)
            except RuntimeError as e:  # (torch's, a full GPU's among them): a cache of a cache goes without
                _device_log.log("device copy of a block not made (the read or put itself is done): %s", e)

    def read_device(self, k: bytes, dest: Destination) -> int:
        """Copy `k`'s device copy into `dest` (a tensor); its size, or -1 without a current copy. Lock
        not held."""
        stack = self._stack
        device = stack.device
        assert device is not None
        with stack.lock:
            stack.check_open()
            t = device.get(k)
            floor = stack.readable_from  # (fenced: a worker back from an absence reads no older block)
            if t is None or not stack.present(k, time.time()) or (floor and stack.version_of(k) < floor):
                return -1  # a device copy is only as good as the block below it
            n = int(t.numel())
            if n > dest.nbytes:
                raise BufferSizeError(f"block {k[:24]!r} is {n} bytes; the destination holds {dest.nbytes}",
                                      key=k, size=n, limit=dest.nbytes)
            device.touch(k)
            stack.counters.hits_device += 1
        dest.tensor[:n].copy_(t)
        return n

    def flush(self) -> int:
        """Write every DRAM block without an SSD copy to SSD, one transaction per `_batches` (they stay in
        DRAM); returns how many were written. It first waits for the writes in flight: a block is never
        in two writes at once (the later one's index entry could outlive a deletion queued between
        them). Lock not held."""
        stack = self._stack
        ssd = stack.ssd
        if ssd is None:
            return 0
        with stack.lock:
            self.wait_for_writes()
            stack.check_open()
            pending = [b for b in stack.dram.blocks.values() if not b.on_ssd]
            self.begin_write(pending)
        written = 0
        try:
            # at most an eighth of the SSD tier a transaction: what a write makes room for first (`demote`)
            for batch in _batches(pending, min(_FLUSH_BATCH_BYTES, int(ssd.capacity) // 8),
                                  lambda b: ssd.footprint(b.key, b.size)):
                with stack.lock:
                    stack.check_open()  # a close waits for the batch under way, not for the rest (PoolClosed)
                written += self.demote(batch)
        finally:
            with stack.lock:
                self.end_write(pending)
        return written

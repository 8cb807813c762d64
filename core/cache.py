"""TieredCache: immutable blocks by key over device, DRAM and SSD tiers, in one process.

Blocks are written, checksummed, then committed; only committed blocks are visible. DRAM is the
home tier; above its high watermark a background thread (`demoter`) demotes least-recently-used
blocks to SSD in batched transactions until the low watermark. An SSD hit promotes the block back to
DRAM. Readers hold a lease, so a block being read is never evicted or overwritten under them; a
replaced or removed block's slot is freed when its last lease ends. Pins keep blocks in DRAM for a
while (`pins`). The tiers live in `tiers/`, held together by `tier_stack` and moved by `tier_moves`.
Every block has a version (`kvpool.core.versions`, stamped here unless the writer stamped it): the
cache keeps the newest, ignores puts older than it, and removals leave tombstones.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from .buffers import Destination, destinations, readable_all
from .cache_events import CacheListener
from .config import CacheConfig, load
from .demoter import Demoter
from .errors import BlockTooLarge, BufferSizeError, InvalidArgument, PoolClosed, StorageError
from .fastcopy import copy, copy_hash
from .keys import Key, key_bytes, keys_bytes
from .replica_state import ReplicaState
from .stats import CacheStats
from .tier_moves import TierMoves
from .tier_stack import TierStack, with_prefix
from .tiers.device import DeviceTier
from .tiers.dram import DramArena
from .tiers.dram_tier import BlockRef, DramBlock, new_blocks
from .tiers.ssd_tier import SsdTier
from .versions import CLOCK, REMOVED, SUPERSEDED

__all__ = ["TieredCache", "BlockRef"]

log = logging.getLogger("kvpool.cache")


class TieredCache:
    """A block cache over a device tier (optional), a shared-memory DRAM arena and an LMDB SSD tier.

    Sizes are bytes, durations seconds. A miss is `None` (get) or `-1` (get_into), never an exception.
    Build it from a `CacheConfig`, or from keyword overrides of one (`TieredCache(dram_bytes=...)`),
    which are layered over `KVPOOL_*` environment variables and defaults. `share_arena=True` (the
    worker) names the DRAM arena in /dev/shm for same-node clients to map; otherwise it is private.
    Thread-safe.
    """

    def __init__(self, config: CacheConfig | None = None, *, share_arena: bool = False, **overrides: Any) -> None:
        self.config = config if config is not None else load(CacheConfig, **overrides)
        self._stack = stack = TierStack(self.config, share_arena=share_arena)
        self._lock = stack.lock
        self._dram = stack.dram
        self._moves = TierMoves(stack)
        self._demoter = Demoter(stack, self._moves)
        self._demoter.start()
        self.replicas = ReplicaState(stack)
        """Versions as replicas compare them, the fence of a worker back from an absence, its change log."""
        # A cache dropped without close() is closed as it goes (its demoter thread holds the stack, never
        # the cache): its thread, arena and SSD folder are let go of, as at close().
        self._finalizer = weakref.finalize(self, _close, stack, self._moves, self._demoter)
        _CACHES.add(self)

    @property
    def arena(self) -> DramArena:
        """The DRAM tier's shared-memory arena (the worker serves same-node clients from it)."""
        return self._dram.arena

    @property
    def ssd(self) -> SsdTier | None:
        """The SSD tier (its LMDB store is `ssd.store`), or None without `ssd_path`."""
        return self._stack.ssd

    @property
    def device(self) -> DeviceTier | None:
        """The device tier, or None (no `device` configured, or "auto" without CUDA)."""
        return self._stack.device

    @property
    def max_block(self) -> int:
        """Largest block accepted, in bytes (the DRAM slab size)."""
        return self._dram.arena.max_block

    # ----- writing ----------------------------------------------------------------------------------

    def put(self, key: Key, data: Any, *, pin_s: float = 0.0, ttl_s: float | None = None) -> None:
        """Store `data` (bytes-like, numpy, torch) under `key`, replacing any previous block. `pin_s` > 0
        pins it in DRAM for that long (see `pin`); `ttl_s` makes it a miss after that long.

        Raises InvalidKey, BlockTooLarge, CapacityError (everything leased/pinned) or PoolClosed;
        on these errors nothing is stored. StorageError: stored (and pinned), but not durable: a full
        disk kept the older SSD copy, which a crash before it is deleted would serve after the restart.
        """
        self.batch_put([key], [data], pin_s=pin_s, ttl_s=ttl_s)

    def batch_put(self, keys: Sequence[Key], buffers: Sequence[Any], *, pin_s: float = 0.0,
                  ttl_s: float | None = None, versions: Sequence[int] | None = None) -> None:
        """Store each buffer under its key. All inputs are validated before anything is written.
        `versions` (`kvpool.core.versions`; default: stamped now) order writes: a block older than
        the one held, or than the key's removal, is not stored (and is no error). A StorageError (see
        `put`) is raised once every block was written."""
        if len(keys) != len(buffers) or (versions is not None and len(versions) != len(keys)):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers"
                                  + (f" and {len(versions)} versions" if versions is not None else ""))
        raw_keys = keys_bytes(keys)
        views = readable_all(buffers)
        max_block = self.max_block
        for k, v in zip(raw_keys, views):
            if v.nbytes > max_block:
                raise BlockTooLarge(f"block {k[:24]!r} is {v.nbytes} bytes; the DRAM tier's max block is {max_block}",
                                    key=k, size=v.nbytes, limit=max_block)
        expires = time.time() + ttl_s if ttl_s else 0.0
        device = self._stack.device
        stamps = versions if versions is not None else CLOCK.batch(len(raw_keys))
        refused: StorageError | None = None
        for k, v, src, version in zip(raw_keys, views, buffers, stamps):
            try:
                block = self._write(k, v, expires, pin_s, version)
            except StorageError as e:  # stored, but a full disk kept an older SSD copy: the rest go on, as
                refused = refused or e  # a worker's put does, and the first refusal is raised at the end
                continue
            if block is not None and device is not None and device.holds_tensor(src):
                self._moves.copy_to_device(k, src, block)
        self._stack.counters.puts += len(raw_keys)
        if refused is not None:
            raise refused

    def _write(self, key: bytes, data: memoryview, expires: float, pin_s: float,
               version: int) -> DramBlock | None:
        """Copy `data` into a fresh slot and commit it under `key` (replacing any old block), with the
        checksum of the bytes the slot got; None if the cache holds a newer version of `key` (nothing
        stored)."""
        n = data.nbytes
        offset = self._reserve(n)
        try:  # outside the lock: the slot is ours alone
            with self._closing_met():
                csum = copy_hash(self._dram.arena.buf[offset:offset + n], data)
        except BaseException:
            self.abort(offset)
            raise
        block = DramBlock(key, offset, n, csum, expires, version=version)
        return block if self._commit(block, pin_s) else None

    @contextmanager
    def _closing_met(self) -> Iterator[None]:
        """A copy into or out of the arena, outside the lock: where the cache was closed meanwhile (the
        arena released under it), PoolClosed rather than the buffer's own ValueError or TypeError."""
        try:
            yield
        except (ValueError, TypeError):
            if self._stack.closed:
                raise PoolClosed("the cache was closed during the call") from None
            raise

    def _reserve(self, n: int) -> int:
        with self._lock:
            self._stack.check_open()
            return self._moves.alloc(n)

    def _commit(self, block: DramBlock, pin_s: float) -> bool:
        """Commit `block` unless the cache knows a version of its key as new or newer (a block or a
        removal: then its slot is freed and False returned). Version 0 is stamped now."""
        with self._lock:
            stored = self._admit(block)
            try:
                self._stack.delete_replaced()
            finally:  # (a full disk refusing the older copy's deletion: the block is stored all the same)
                if stored and pin_s > 0:
                    self._dram.pins.pin((block.key,), pin_s)
        return stored

    def _stamp(self, block: DramBlock) -> None:
        """Stamp `block` (version 0: a write of this process) now, and above every version of its key
        this cache knows: a write is newer than what it replaces, even a block the last run stamped
        ahead of this clock (a clock stepped back at a reboot). Lock held."""
        version, known = CLOCK.now(), self._stack.newest(block.key)
        if version <= known:
            CLOCK.observe(known)  # (up to CLOCK_SKEW_MS ahead: a version further ahead moves this key only)
            version = max(CLOCK.now(), known + 1)
        block.version = version

    def _admit(self, block: DramBlock) -> bool:
        """`_commit` of `block` without a pin. Lock held."""
        if block.version <= 0:
            self._stamp(block)
        else:
            CLOCK.observe(block.version)
        if not self._enter(block):
            return False
        self._stack.changes.record((block.key,), (block.version,), False)
        return True

    def _admit_many(self, blocks: list[DramBlock], keys: list[bytes]) -> list[bool]:
        """`_admit` of each block in turn (`keys`: theirs), the clock and the change log told once for the
        batch. Lock held."""
        versions = [b.version for b in blocks]
        if min(versions, default=1) > 0:  # the clock only moves: observing the newest is observing each
            if versions:
                CLOCK.observe(max(versions))
        else:
            for b in blocks:  # the clock's moves in the blocks' order (entering blocks does not move it)
                if b.version <= 0:
                    self._stamp(b)
                else:
                    CLOCK.observe(b.version)
            versions = [b.version for b in blocks]  # (as stamped)
        bulk = self._stack.commit_many(blocks, keys)  # None: not a plain batch, committed block by block
        stored: list[bool] = bulk if bulk is not None else []
        try:
            if bulk is None:
                enter = self._enter
                for b in blocks:
                    stored.append(enter(b))
        finally:
            if any(stored):
                if len(stored) == len(blocks) and all(stored):  # (the usual batch: its versions listed above)
                    self._stack.changes.record(keys, versions, False)
                else:
                    kept = [b for b, ok in zip(blocks, stored) if ok]
                    self._stack.changes.record([b.key for b in kept], [b.version for b in kept], False)
                try:
                    self._stack.delete_replaced()
                except StorageError as e:  # committed, not durable: which were stored goes with it
                    e.stored = stored
                    raise
        return stored

    def _enter(self, block: DramBlock) -> bool:
        """Commit `block` (stamped) unless the cache knows a version of its key as new or newer: then
        free its slot and return False. Lock held."""
        stack = self._stack
        key = block.key
        if block.version <= stack.newest(key):
            self._dram.unreserve(block.offset)
            return False
        stack.tombstones.discard(key)
        stack.commit(block)
        return True

    # ----- reading ----------------------------------------------------------------------------------

    def get(self, key: Key) -> bytes | None:
        """The block's bytes, or None on a miss."""
        b = self._moves.acquire(key_bytes(key))
        if b is None:
            return None
        try:
            with self._closing_met():
                view = self._readable(b)
                return None if view is None else view.tobytes()
        finally:
            self.release(b)

    def get_into(self, key: Key, buffer: Any) -> int:
        """Copy the block into `buffer`; return its size in bytes, or -1 on a miss.

        `buffer` may be larger than the block (the tail is left untouched); a smaller one raises
        BufferSizeError naming both sizes.
        """
        return self.batch_get_into([key], [buffer])[0]

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        """`get_into` for each pair; sizes, -1 for each miss."""
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        raw_keys = keys_bytes(keys)
        return [self._get_into(k, dest) for k, dest in zip(raw_keys, destinations(buffers))]

    def _get_into(self, k: bytes, dest: Destination) -> int:
        device = self._stack.device
        if device is not None and dest.tensor is not None:
            n = self._moves.read_device(k, dest)
            if n >= 0:
                return n
        b = self._moves.acquire(k)
        if b is None:
            return -1
        try:
            if b.size > dest.nbytes:
                raise BufferSizeError(f"block {k[:24]!r} is {b.size} bytes; the destination holds {dest.nbytes}",
                                      key=k, size=b.size, limit=dest.nbytes)
            if not self._moves.verified(b):
                return -1
            with self._closing_met():
                copy(dest.view[:b.size], self._dram.arena.view(b.offset, b.size))
        finally:
            self.release(b)
        dest.finish(b.size)
        if device is not None and dest.tensor is not None and device.holds_tensor(dest.tensor):
            self._moves.copy_to_device(k, dest.tensor[:b.size], b)
        return b.size

    @contextmanager
    def lease(self, key: Key) -> Iterator[memoryview | None]:
        """Hold a block in DRAM and yield a read-only view of its bytes (None on a miss).

        The block is neither evicted nor freed while the lease is held; do not keep the view after.
        """
        b = self._moves.acquire(key_bytes(key))
        try:
            yield None if b is None else self._readable(b)
        finally:
            if b is not None:
                self.release(b)

    @contextmanager
    def batch_lease(self, keys: Sequence[Key]) -> Iterator[list[memoryview | None]]:
        """`lease` of each key at once: a read-only view per key, None for each miss."""
        raw_keys = keys_bytes(keys)
        blocks: list[DramBlock | None] = []
        try:
            for k in raw_keys:
                blocks.append(self._moves.acquire(k))
            yield [None if b is None else self._readable(b) for b in blocks]
        finally:
            for b in blocks:
                if b is not None:
                    self.release(b)

    def _readable(self, b: DramBlock) -> memoryview | None:
        """A read-only view of the leased block `b`, or None if it failed verification."""
        if not self._moves.verified(b):
            return None
        with self._closing_met():
            return self._dram.view(b).toreadonly()

    # ----- lookups, removal, pins ---------------------------------------------------------------

    def exists(self, key: Key) -> bool:
        """True if a committed, unexpired block is stored under `key` in any tier."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[Key]) -> list[bool]:
        """`exists` of each key, under one lock; the cost grows with len(keys), not with the blocks held."""
        raw_keys = keys_bytes(keys, lengths=False)
        now = time.time()
        with self._lock:
            self._stack.check_open()
            held = self._stack.presence(raw_keys, now)
        if not all(held):
            keys_bytes([k for k, h in zip(raw_keys, held) if not h])  # raises for a bad key (one found is valid)
        return held

    def prefix_match(self, keys: Sequence[Key]) -> int:
        """Length of the longest prefix of the key chain `keys` whose blocks are all present; the cost
        grows with len(keys) (a few C-level passes over them), not with the blocks held."""
        raw_keys = keys_bytes(keys, lengths=False)
        now = time.time()
        with self._lock:
            self._stack.check_open()
            n = self._stack.prefix_match(raw_keys, now)
        if n < len(raw_keys):
            keys_bytes(raw_keys[n:])  # raises for a bad key (one found is valid)
        return n

    def remove(self, key: Key) -> bool:
        """Remove the block from every tier; True if it was present."""
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: Sequence[Key], versions: Sequence[int] | None = None) -> list[bool]:
        """`remove` of each key, as of `versions` (default: stamped now): a key whose block is newer
        than its removal keeps it (False). Each removal leaves a tombstone (`versions.Tombstones`), so
        a put older than it that arrives later does not bring the key back."""
        return [o == REMOVED for o in self.remove_as_of(keys, versions)]

    def remove_as_of(self, keys: Sequence[Key], versions: Sequence[int] | None = None) -> list[int]:
        """`batch_remove`, each key's outcome told apart: REMOVED (a block a read would have served was
        removed), 0 (nothing to remove, or only a block no read would serve: fenced off, expired) or
        SUPERSEDED (its block is as new as the removal or newer, and stays)."""
        raw_keys = keys_bytes(keys)
        stamps = list(versions) if versions is not None else CLOCK.batch(len(raw_keys))
        if len(stamps) != len(raw_keys):
            raise InvalidArgument(f"{len(raw_keys)} keys but {len(stamps)} versions")
        with self._lock:
            stack = self._stack
            stack.check_open()
            doomed: dict[bytes, int] = {}
            kept: set[bytes] = set()
            for k, v in zip(raw_keys, stamps):
                CLOCK.observe(v)
                if v > stack.version_of(k):
                    stack.tombstones.add(k, v)
                    doomed[k] = max(v, doomed.get(k, 0))
                else:  # a block as new or newer: the removal changes nothing
                    kept.add(k)
            stack.changes.record(doomed, doomed.values(), True)
            gone = list(doomed)
            seen = dict(zip(gone, stack.presence(gone, time.time())))  # as a read would have said: not a
            # block fenced off (a worker back from an absence) nor an expired one
            found = {k: held and seen[k] for k, held in zip(gone, stack.remove(gone))}
        out = []
        for k in raw_keys:  # a key named twice was removed by its first mention
            out.append(REMOVED if found.pop(k, False) else SUPERSEDED if k in kept and k not in doomed else 0)
        return out

    def clear(self, prefix: Key | None = None) -> None:
        """Remove every block from every tier, or (with `prefix`) every block whose key starts with it
        (a model's or a tenant's namespace). Leased blocks are freed when their leases end. Pins stay.
        The clear is remembered as of a version stamped now (`versions.Clears`, and the change log):
        an older put of a key under it that arrives later (a replica back from a pause, a repair) does
        not bring the key back, and a peer that was away learns of it when it catches up."""
        raw = b"" if prefix is None else key_bytes(prefix)
        stack = self._stack
        with self._lock:
            stack.check_open()
            version = CLOCK.now()
            stack.clears.add(raw, version)  # from here no block under `raw` as old as the clear is admitted
            stack.changes.record_clear(raw, version)
            if prefix is None:
                stack.clear()
                return
            held, mark = stack.key_lists(), stack.changes.next_seq
        # The keys under the prefix are picked out without the lock (a pass over every key: a tenant's
        # clears would otherwise stall the worker), then removed under it but those put since (the change
        # log says which; where it ran past that, those newer than the clear: a block held before the clear
        # may carry a later version, from a writer whose clock runs ahead).
        doomed = with_prefix(held, raw)
        with self._lock:
            stack.check_open()
            since = stack.changes.puts_since(mark)
            stack.remove([k for k in doomed if k not in since] if since is not None
                         else [k for k in doomed if stack.version_of(k) <= version])

    def drop_all(self) -> None:
        """Drop every block from every tier, as `clear()` does, but remembering no clear: for a worker
        that cannot vouch for its own blocks (it missed changes made while it was away), which says
        nothing of the keys as its peers hold them. A full disk that keeps the SSD copies for now is
        logged (they are dropped all the same, and deleted once it lets the demoter)."""
        with self._lock:
            self._stack.check_open()
            try:
                self._stack.clear()
            except StorageError as e:
                log.warning("blocks dropped, not yet deleted from SSD: %s", e)

    def pin(self, key: Key, pin_s: float) -> None:
        """Keep the block of `key` in DRAM (never evicted) for `pin_s` seconds from now, renewing any
        earlier pin; `pin_s` <= 0 unpins. See `kvpool.core.pins` for the bounds."""
        self.batch_pin([key], pin_s)

    def batch_pin(self, keys: Sequence[Key], pin_s: float, holder: int = 0) -> None:
        """`pin` of each key, on behalf of `holder` (a worker's client process: another holder's unpin
        leaves this one's pin in place; see `kvpool.core.pins`). A key whose block is not in DRAM yet is
        pinned when it is committed, if that happens within `pins.PENDING_PIN_S`."""
        raw_keys = keys_bytes(keys)
        with self._lock:
            self._stack.check_open()
            self._dram.pins.pin(raw_keys, pin_s, holder)

    # ----- the slot protocol (the worker serves its arena through these) -----------------------

    def reserve(self, nbytes: int) -> int:
        """Allocate an arena slot of `nbytes` for a block about to be written; returns its offset.

        Raises BlockTooLarge or CapacityError. The slot is invisible until `commit`; `abort` frees it.
        """
        if nbytes > self.max_block or nbytes < 0:
            raise BlockTooLarge(f"block of {nbytes} bytes; the DRAM tier's max block is {self.max_block}",
                                size=nbytes, limit=self.max_block)
        return self._reserve(nbytes)

    def commit(self, key: Key, offset: int, nbytes: int, csum: int, *, pin_s: float = 0.0,
               ttl_s: float | None = None, version: int = 0) -> bool:
        """Publish the `nbytes` written at `offset` (from `reserve`) under `key` with checksum `csum`.
        A live pin on `key` (`pin`) pins it; `pin_s`, `ttl_s` as for `put`. `version` (0: stamped
        now): if the cache holds a newer version of `key` (or of its removal), the slot is freed
        instead and False returned."""
        expires = time.time() + ttl_s if ttl_s else 0.0
        stored = self._commit(DramBlock(key_bytes(key), offset, nbytes, csum, expires, version=version), pin_s)
        with self._lock:
            self._stack.counters.puts += 1
        return stored

    def reserve_many(self, sizes: Sequence[int]) -> list[int | None]:
        """`reserve` of each size under one lock (a same-node writer's batch): each slot's offset, None
        for each that found no room. Raises BlockTooLarge, reserving nothing, if a size is out of range."""
        if sizes and (max(sizes) > self.max_block or min(sizes) < 0):
            bad = max(sizes) if max(sizes) > self.max_block else min(sizes)
            raise BlockTooLarge(f"block of {bad} bytes; the DRAM tier's max block is {self.max_block}",
                                size=bad, limit=self.max_block)
        with self._lock:
            self._stack.check_open()
            return self._moves.alloc_many(sizes)

    def commit_many(self, keys: Sequence[bytes], offsets: Sequence[int], sizes: Sequence[int],
                    csums: Sequence[int], versions: Sequence[int] | None = None, *,
                    checked: bool = True) -> list[bool]:
        """`commit` of each block (canonical keys; no pin of its own, no TTL) under one lock: a same-node
        writer's batch. A live pin on a key pins its block, as for `commit`. `versions` as for `commit`
        (default: stamped now); False for each block not stored (its key holds a newer version).
        `checked=False`: the caller has not hashed the blocks' bytes against `csums`; the cache does
        at each block's first read (a lease, a get, a write to SSD), and a block that fails is a miss."""
        keys = keys if isinstance(keys, list) else list(keys)
        blocks = new_blocks(keys, offsets, sizes, csums, versions, checked)
        with self._lock:
            stored = self._admit_many(blocks, keys)
            self._stack.counters.puts += len(blocks)
        return stored

    def abort(self, offset: int) -> None:
        """Free a reserved slot that will not be committed."""
        with self._lock:
            self._dram.unreserve(offset)

    def acquire(self, key: Key) -> BlockRef | None:
        """Lease a block (promoting it from SSD if needed); its `offset`, `size` and `checksum` locate
        it in `arena`. Hold it briefly and `release` it; None on a miss."""
        return self._moves.acquire(key_bytes(key))

    def acquire_many(self, keys: Sequence[bytes]) -> list[BlockRef | None]:
        """`acquire` of each of `keys` (canonical bytes), the DRAM hits under one lock (a same-node
        reader's batch); `release_many` them."""
        return list(self._moves.acquire_many(keys))

    def release(self, ref: BlockRef) -> None:
        """End a lease from `acquire` (or one this cache took for a read)."""
        with self._lock:
            self._dram.release(cast(DramBlock, ref))  # every BlockRef this cache hands out is its DramBlock

    def release_many(self, refs: Iterable[BlockRef]) -> None:
        """`release` of each lease, under one lock."""
        with self._lock:
            release = self._dram.release
            for ref in cast("Iterable[DramBlock]", refs):  # every BlockRef this cache hands out is its DramBlock
                release(ref)

    # ----- listeners, reports, lifecycle ------------------------------------------------------------

    def add_listener(self, listener: CacheListener, *, replay: bool = False) -> None:
        """Tell `listener` of every block stored, copied between tiers, dropped from one or removed
        from the cache, from now on (see `kvpool.core.cache_events`). `replay=True` first tells it of
        every block held now (`stored` in DRAM, or in SSD for SSD-only blocks, then `copied` for a
        block's second tier), with no change slipping in between."""
        with self._lock:
            self._stack.add_listener(listener, replay)

    def remove_listener(self, listener: CacheListener) -> None:
        with self._lock:
            self._stack.remove_listener(listener)

    def flush(self) -> int:
        """Write every DRAM block that has no SSD copy to the SSD tier (blocks stay in DRAM).

        After it returns, a restart serves those blocks from SSD. Returns the number written.
        """
        return self._moves.flush()

    def stats(self) -> CacheStats:
        """Counters, each tier's fill (bytes and blocks) and the pins, as of now."""
        with self._lock:
            return self._stack.stats()

    def check(self) -> list[str]:
        """Every broken invariant of the cache's bookkeeping, in words; empty when it is consistent
        (as diskcache's `Cache.check`). It waits for SSD writes in flight, then, under the lock, checks
        the arena's allocator, the DRAM index against the arena and the eviction order, each DRAM
        block's bytes against its checksum, leases and pins, the SSD index against LMDB's headers,
        and the device tier's accounting. It reads every block: a diagnostic, not for a hot path."""
        with self._lock:
            self._stack.check_open()
            self._moves.wait_for_writes()
            return self._stack.check()

    def close(self) -> None:
        """Stop the demoter, apply pending SSD deletions, release the arena and close LMDB.

        DRAM blocks not yet on SSD are lost unless `flush()` ran first.
        """
        self._finalizer()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(stack: TierStack, moves: TierMoves, demoter: Demoter) -> None:
    """`TieredCache.close` of the cache whose parts these are. On the demoter's own thread (a garbage
    collection there finalized the cache), which cannot wait for itself, a short thread does it."""
    if demoter.is_current():
        threading.Thread(target=_close, args=(stack, moves, demoter), name="kvpool-cache-close", daemon=True).start()
        return
    with stack.lock:
        if stack.closed:
            return
        stack.closed = True
        stack.demote_due.notify_all()
        moves.wait_for_ssd()  # a flush's write, a read's copy out of LMDB's map: ended first
    demoter.join()
    stack.close()


_CACHES: weakref.WeakSet[TieredCache] = weakref.WeakSet()
"""Every cache of this process, for `fork()`."""
_forking = threading.Lock()
"""Held from a fork's `before` to its `after`: one fork at a time takes the caches' locks (`_held`)."""
_held: list[TieredCache] = []


_LOCK_WAIT_S = 1.0
"""How long a fork waits for a cache's lock: a thread that holds one may itself be forking, waiting for
`_forking` (one fork at a time): past it, the child's copy of that cache is closed instead."""
_missed: list[TieredCache] = []


def _before_fork() -> None:
    """Each cache's lock taken by the forking thread: the child's copy is of no half-made change."""
    _forking.acquire()
    _held.clear()
    _missed.clear()
    for cache in list(_CACHES):  # (a WeakSet yields live caches only)
        (_held if cache._lock.acquire(timeout=_LOCK_WAIT_S) else _missed).append(cache)


def _after_fork_in_parent() -> None:
    for cache in _held:
        cache._lock.release()
    _held.clear()
    _missed.clear()
    _forking.release()


def _after_fork_in_child() -> None:
    """The child's copy of each cache (see `TierStack.forked`), with a demoter thread of its own; one
    whose lock another thread held at the fork is closed (PoolClosed: that thread's change is half made)."""
    for cache in _held:
        stack = cache._stack
        stack.forked()
        cache._moves.forked()
        if not stack.closed:
            cache._demoter.restart()
        cache._lock.release()
    for cache in _missed:
        cache._stack.closed = True
    _held.clear()
    _missed.clear()
    _forking.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)

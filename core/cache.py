"""TieredCache: immutable blocks by key over device, DRAM and SSD tiers, in one process.

Blocks are written, checksummed, then committed; only committed blocks are visible. DRAM is the
home tier; above its high watermark a background thread demotes least-recently-used blocks to SSD in
batched transactions until the low watermark. An SSD hit promotes the block back to DRAM. Readers
hold a lease, so a block being read is never evicted or overwritten under them; a replaced or
removed block's slot is freed when its last lease ends.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .blocks import BlockMeta, checksum
from .buffers import Destination, readable
from .cache_events import CacheListener
from .config import CacheConfig, load
from .errors import BlockTooLarge, BufferSizeError, CapacityError, PoolClosed
from .keys import Key, key_bytes
from .policies import EVICTION_POLICY
from .stats import CacheStats
from .tiers.device import DeviceTier, cuda_available
from .tiers.dram import DramArena, sweep_dead_arenas
from .tiers.ssd import SsdTier

_DEMOTE_BATCH_BYTES = 64 << 20


@dataclass(eq=False)
class _Block:
    """A committed block in the DRAM arena."""

    key: bytes
    offset: int
    size: int
    checksum: int
    expires: float
    leases: int = 0
    pinned: bool = False
    live: bool = True  # False once replaced, removed or evicted; the slot is freed at zero leases
    on_ssd: bool = False  # an identical copy is committed in the SSD tier

    @property
    def meta(self) -> BlockMeta:
        return BlockMeta(self.size, self.checksum, self.expires)

    def expired(self, now: float) -> bool:
        return bool(self.expires) and self.expires <= now


class TieredCache:
    """A block cache over a device tier (optional), a shared-memory DRAM arena and an LMDB SSD tier.

    Sizes are bytes, TTLs seconds. A miss is `None` (get) or `-1` (get_into), never an exception.
    Build it from a `CacheConfig`, or from keyword overrides of one (`TieredCache(dram_bytes=...)`),
    which are layered over `KVPOOL_*` environment variables and defaults. `share_arena=True` (the
    worker) names the DRAM arena in /dev/shm for same-node clients to map; otherwise it is private.
    """

    def __init__(self, config: CacheConfig | None = None, *, share_arena: bool = False, **overrides: Any) -> None:
        self.config = config if config is not None else load(CacheConfig, **overrides)
        cfg = self.config
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._ssd_writes = 0  # demoter and flush batches in flight, each holding its blocks leased
        self._ssd_written = threading.Condition(self._lock)  # notified as each lets go of them
        self._closed = False
        self.stats_ = CacheStats()
        self._dram: dict[bytes, _Block] = {}
        self._dram_order = EVICTION_POLICY[cfg.policy]()
        self.ssd: SsdTier | None = None
        self._ssd_sizes: dict[bytes, int] = {}
        self._ssd_expires: dict[bytes, float] = {}  # of the SSD blocks that have a TTL
        self._ssd_order = EVICTION_POLICY[cfg.policy]()
        self._ssd_bytes = 0
        self._stale_ssd: list[bytes] = []  # keys whose SSD copy is outdated; the demoter deletes them
        self._listeners: tuple[CacheListener, ...] = ()  # told of every block change, under the lock
        if share_arena:
            sweep_dead_arenas()  # what a kill -9'd worker on this node left
        self.arena = DramArena(cfg.dram_bytes, cfg.dram_slab_size, cfg.dram_name, cfg.prefault, shared=share_arena)
        try:
            if cfg.ssd_path:
                self.ssd = SsdTier(cfg.ssd_path, cfg.ssd_map_size, cfg.ssd_sync)
                for key, meta in self.ssd.scan():
                    self._ssd_sizes[key] = meta.size
                    if meta.expires:
                        self._ssd_expires[key] = meta.expires
                    self._ssd_order.add(key)
                    self._ssd_bytes += meta.size
            device = cfg.device
            if device == "auto":
                device = "cuda" if cuda_available() else None
            self.device: DeviceTier | None = DeviceTier(device) if device else None
        except BaseException:
            if self.ssd is not None:
                self.ssd.close()
            self.arena.close()  # a shared-memory name outlives the process unless it is unlinked
            raise
        self._device_order = EVICTION_POLICY[cfg.policy]()
        self._device_bytes = 0
        self._demoter = threading.Thread(target=self._demote_loop, name="kvpool-demoter", daemon=True)
        self._demoter.start()

    # ----- public API -------------------------------------------------------------------------

    @property
    def max_block(self) -> int:
        """Largest block accepted, in bytes (the DRAM slab size)."""
        return self.arena.max_block

    def put(self, key: Key, data: Any, *, pin: bool = False, ttl: float | None = None) -> None:
        """Store `data` (bytes-like, numpy, torch) under `key`, replacing any previous block.

        Raises InvalidKey, BlockTooLarge, CapacityError (everything leased/pinned) or PoolClosed;
        on error nothing is stored.
        """
        self.batch_put([key], [data], pin=pin, ttl=ttl)

    def batch_put(self, keys: Sequence[Key], buffers: Sequence[Any], *, pin: bool = False,
                  ttl: float | None = None) -> None:
        """Store each buffer under its key. All inputs are validated before anything is written."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        raw_keys = [key_bytes(k) for k in keys]
        views = [readable(b) for b in buffers]
        for k, v in zip(raw_keys, views):
            if v.nbytes > self.max_block:
                raise BlockTooLarge(f"block {k[:24]!r} is {v.nbytes} bytes; the DRAM tier's max block is {self.max_block}")
        expires = time.time() + ttl if ttl else 0.0
        for k, v, src in zip(raw_keys, views, buffers):
            block = self._write(k, v, checksum(v), expires, pin)
            if self.device is not None and self._on_device(src):
                self._device_put(k, src, block)
        self.stats_.puts += len(raw_keys)

    def get(self, key: Key) -> bytes | None:
        """The block's bytes, or None on a miss."""
        k = key_bytes(key)
        with self.lease(k) as view:
            return None if view is None else view.tobytes()

    def get_into(self, key: Key, buffer: Any) -> int:
        """Copy the block into `buffer`; return its size in bytes, or -1 on a miss.

        `buffer` may be larger than the block (the tail is left untouched); a smaller one raises
        BufferSizeError naming both sizes.
        """
        return self.batch_get_into([key], [buffer])[0]

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        """`get_into` for each pair; sizes, -1 for each miss."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        raw_keys = [key_bytes(k) for k in keys]
        return [self._get_into(k, Destination(b)) for k, b in zip(raw_keys, buffers)]

    def exists(self, key: Key) -> bool:
        """True if a committed, unexpired block is stored under `key` in any tier."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[Key]) -> list[bool]:
        raw_keys = [key_bytes(k) for k in keys]
        now = time.time()
        with self._lock:
            self._check_open()
            return [self._present(k, now) for k in raw_keys]

    def prefix_match(self, keys: Sequence[Key]) -> int:
        """Length of the longest prefix of the key chain `keys` whose blocks are all present."""
        raw_keys = [key_bytes(k) for k in keys]
        now = time.time()
        with self._lock:
            self._check_open()
            for i, k in enumerate(raw_keys):
                if not self._present(k, now):
                    return i
        return len(raw_keys)

    def remove(self, key: Key) -> bool:
        """Remove the block from every tier; True if it was present."""
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: Sequence[Key]) -> list[bool]:
        raw_keys = [key_bytes(k) for k in keys]
        found = []
        with self._lock:
            self._check_open()
            for k in raw_keys:
                hit = self._drop_dram(k, "remove")
                if self.device is not None and k in self.device.blocks:
                    self._device_drop(k)
                if k in self._ssd_sizes:
                    self._ssd_forget(k, "remove")
                    hit = True
                found.append(hit)
            gone = [k for k, f in zip(raw_keys, found) if f]
            if self.ssd is not None and gone:
                self._stale_ssd.extend(gone)
                self._delete_stale()  # a full disk leaves them queued: the demoter retries
        return found

    def add_listener(self, listener: CacheListener, *, replay: bool = False) -> None:
        """Tell `listener` of every block stored, copied between tiers, dropped from one or removed
        from the cache, from now on (see `kvpool.core.cache_events`). `replay=True` first tells it of
        every block held now (`stored` in DRAM, or in SSD for SSD-only blocks, then `copied` for a
        block's second tier), with no change slipping in between."""
        with self._lock:
            if replay:
                for k in self._dram:
                    listener.stored(k, "dram")
                for k in self._ssd_sizes:
                    (listener.copied if k in self._dram else listener.stored)(k, "ssd")
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: CacheListener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    def pin(self, key: Key, pinned: bool = True) -> bool:
        """Keep a DRAM block from eviction (or release it); False if it is not in DRAM."""
        k = key_bytes(key)
        with self._lock:
            self._check_open()
            b = self._dram.get(k)
            if b is None:
                return False
            b.pinned = pinned
            return True

    @contextmanager
    def lease(self, key: Key) -> Iterator[memoryview | None]:
        """Hold a block in DRAM and yield a read-only view of its bytes (None on a miss).

        The block is neither evicted nor freed while the lease is held; do not keep the view after.
        """
        k = key_bytes(key)
        block = self._acquire(k)
        if block is None:
            yield None
            return
        try:
            yield self.arena.view(block.offset, block.size).toreadonly() if self._verified(block) else None
        finally:
            self._release(block)

    # ----- in-place access (the worker serves its arena through these) ------------------------

    def reserve(self, nbytes: int) -> int:
        """Allocate an arena slot of `nbytes` for a block about to be written; returns its offset.

        Raises BlockTooLarge or CapacityError. The slot is invisible until `commit`; `abort` frees it.
        """
        if nbytes > self.max_block or nbytes < 0:
            raise BlockTooLarge(f"block of {nbytes} bytes; the DRAM tier's max block is {self.max_block}")
        return self._reserve(nbytes)

    def commit(self, key: Key, offset: int, nbytes: int, csum: int, *, pin: bool = False,
               ttl: float | None = None) -> None:
        """Publish the `nbytes` written at `offset` (from `reserve`) under `key` with checksum `csum`."""
        expires = time.time() + ttl if ttl else 0.0
        self._commit(_Block(key_bytes(key), offset, nbytes, csum, expires, pinned=pin))
        with self._lock:
            self.stats_.puts += 1

    def abort(self, offset: int) -> None:
        """Free a reserved slot that will not be committed."""
        self._unreserve(offset)

    def acquire(self, key: Key) -> _Block | None:
        """Lease a block (promoting it from SSD if needed); its `offset`, `size`, `checksum` locate it
        in `arena`. Hold it briefly and `release` it; None on a miss."""
        return self._acquire(key_bytes(key))

    def release(self, block: _Block) -> None:
        self._release(block)

    def clear(self, prefix: Key | None = None) -> None:
        """Remove every block from every tier, or (with `prefix`) every block whose key starts with it
        (a model's or a tenant's namespace). Leased blocks are freed when their leases end."""
        if prefix is not None:
            p = key_bytes(prefix)
            with self._lock:
                self._check_open()
                doomed = {k for k in self._dram if k.startswith(p)} | {k for k in self._ssd_sizes if k.startswith(p)}
                if self.device is not None:
                    doomed.update(k for k in self.device.blocks if k.startswith(p))
                self.batch_remove(sorted(doomed))
            return
        with self._lock:
            self._check_open()
            for k in list(self._dram):
                self._drop_dram(k)
            if self.device is not None:
                self.device.clear()
                self._device_order.clear()
                self._device_bytes = 0
            self._ssd_sizes.clear()
            self._ssd_expires.clear()
            self._ssd_order.clear()
            self._ssd_bytes = 0
            if self.ssd is not None:
                self.ssd.clear()
            for listener in self._listeners:
                listener.cleared()

    def flush(self) -> int:
        """Write every DRAM block that has no SSD copy to the SSD tier (blocks stay in DRAM).

        After it returns, a restart serves those blocks from SSD. Returns the number written.
        """
        if self.ssd is None:
            return 0
        with self._lock:
            self._check_open()
            pending = [b for b in self._dram.values() if not b.on_ssd]
            for b in pending:
                b.leases += 1
            self._ssd_writes += 1
        try:
            for i in range(0, len(pending), 256):
                self._demote_to_ssd(pending[i:i + 256])
        finally:
            with self._lock:
                for b in pending:
                    self._release_locked(b)
                self._ssd_writes -= 1
                self._ssd_written.notify_all()
        return len(pending)

    def stats(self) -> dict[str, int]:
        """Counters and tier fill: hits/misses per tier, bytes per tier, evictions, demotions,
        promotions, checksum failures."""
        with self._lock:
            s = self.stats_.as_dict()
            s.update(dram_bytes=self.arena.used_bytes, dram_capacity=self.arena.size,
                     dram_blocks=len(self._dram), ssd_bytes=self._ssd_bytes,
                     ssd_blocks=len(self._ssd_sizes), device_bytes=self._device_bytes,
                     device_blocks=len(self._device_order))
            if self.ssd is not None:
                s["checksum_failures"] += self.ssd.corrupt
            return s

    def close(self) -> None:
        """Stop the demoter, apply pending SSD deletions, release the arena and close LMDB.

        DRAM blocks not yet on SSD are lost unless `flush()` ran first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        self._demoter.join()
        with self._lock:
            if self.ssd is not None:
                self.ssd.close()
            self.arena.close()
            self._dram.clear()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- write path -------------------------------------------------------------------------

    def _write(self, key: bytes, data: memoryview, csum: int, expires: float, pin: bool) -> _Block:
        """Copy `data` into a fresh slot and commit it under `key` (replacing any old block)."""
        n = data.nbytes
        offset = self._reserve(n)
        try:
            self.arena.buf[offset:offset + n] = data  # outside the lock: the slot is ours alone
        except BaseException:
            self._unreserve(offset)
            raise
        return self._commit(_Block(key, offset, n, csum, expires, pinned=pin))

    def _reserve(self, n: int) -> int:
        with self._lock:
            self._check_open()
            return self._alloc(n)

    def _unreserve(self, offset: int) -> None:
        with self._lock:
            self.arena.free(offset)

    def _commit(self, block: _Block, leased: bool = False) -> _Block:
        """Make a written slot visible under its key; a copy already on SSD stays valid."""
        key = block.key
        with self._lock:
            self._drop_dram(key)
            if self.device is not None:
                self._device_drop(key)
            if key in self._ssd_sizes and not block.on_ssd:
                self._ssd_forget(key)
                self._stale_ssd.append(key)
            self._dram[key] = block
            self._dram_order.add(key)
            for listener in self._listeners:  # on_ssd: a promotion, the same bytes as the SSD copy
                (listener.copied if block.on_ssd else listener.stored)(key, "dram")
            if leased:
                block.leases += 1
            if self.arena.used_bytes > self.config.high_watermark * self.arena.size:
                self._wake.notify()
        return block

    def _alloc(self, n: int) -> int:
        """A slot for `n` bytes, evicting (demoting) synchronously if the demoter fell behind, and
        waiting for blocks that an SSD write in flight holds rather than failing for them."""
        while True:
            offset = self.arena.alloc(n)
            if offset is not None:
                return offset
            victims, batch = self._victims_for(n)
            if not victims and self._ssd_writes:
                self._ssd_written.wait()  # blocks held by a batch being written are free again soon
                self._check_open()
                continue
            if not victims:
                if self._free_a_slab_by_moving(n):
                    continue
                raise CapacityError(
                    f"no room for a {n}-byte block: DRAM arena of {self.arena.size} bytes is full of "
                    f"leased or pinned blocks ({len(self._dram)} blocks)")
            self._evict(victims, batch)

    def _evictable(self, b: _Block) -> bool:
        return b.leases == 0 and not b.pinned

    def _victims_for(self, n: int) -> tuple[list[_Block], list[_Block]]:
        """Blocks to evict so that a slot for `n` bytes frees up, and the batch to demote with them.

        The least recently used evictable block of `n`'s size class frees a slot; the next few of
        that class go to SSD in the same transaction but stay in DRAM (their eviction later costs
        no write). Failing that, every block of the least recently used slab whose blocks are all
        evictable, so the slab returns to the free pool for any class."""
        cls = self.arena.class_of(n)
        same: list[_Block] = []
        slabs: dict[int, None] = {}  # slabs of other classes, least recently used first
        for k in self._dram_order:
            b = self._dram[k]
            if not self._evictable(b):
                continue
            if self.arena.class_of(b.size) == cls:
                same.append(b)
                if len(same) >= 8:
                    break
            else:
                slabs.setdefault(self.arena.slab_of(b.offset))
        if same:
            return same[:1], same
        by_slab = self._blocks_by_slab()
        for slab in slabs:
            if all(self._evictable(b) for b in by_slab[slab]):
                return by_slab[slab], by_slab[slab]
        return [], []

    def _blocks_by_slab(self) -> dict[int, list[_Block]]:
        """The DRAM blocks grouped by the slab that holds them. Caller holds the lock."""
        by_slab: dict[int, list[_Block]] = {}
        for b in self._dram.values():
            by_slab.setdefault(self.arena.slab_of(b.offset), []).append(b)
        return by_slab

    def _free_a_slab_by_moving(self, n: int) -> bool:
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
            blocks = [b for b in by_slab[slab] if b.live and self._dram.get(b.key) is b]
            if any(b.leases for b in blocks):
                continue
            pinned = [b for b in blocks if b.pinned]
            self._make_room_elsewhere(pinned, slab)
            moved: list[tuple[_Block, int]] = []
            for b in pinned:
                dest = self.arena.alloc_elsewhere(b.size, slab)
                if dest is None:
                    break
                moved.append((b, dest))
            if len(moved) < len(pinned):  # no room for all of them elsewhere: undo, try the next slab
                for _, dest in moved:
                    self.arena.free(dest)
                continue
            for b, dest in moved:
                self.arena.buf[dest:dest + b.size] = self.arena.buf[b.offset:b.offset + b.size]
                self.arena.free(b.offset)
                b.offset = dest
            self.stats_.relocations += len(moved)
            rest = [b for b in blocks if not b.pinned]
            if rest:
                self._evict(rest, rest)
            return True
        return False

    def _make_room_elsewhere(self, blocks: list[_Block], slab: int) -> None:
        """Evict the least recently used evictable blocks of `blocks`' class outside `slab`, as many
        as `blocks`, so that they can move there (their slots may be free already: then a few blocks
        leave DRAM early)."""
        if not blocks:
            return
        cls = self.arena.class_of(blocks[0].size)
        room: list[_Block] = []
        for k in self._dram_order:
            b = self._dram[k]
            if (self._evictable(b) and self.arena.slab_of(b.offset) != slab
                    and self.arena.class_of(b.size) == cls):
                room.append(b)
                if len(room) == len(blocks):
                    break
        if room:
            self._evict(room, room)

    def _evict(self, victims: list[_Block], batch: list[_Block]) -> None:
        """Demote `batch` (which includes `victims`) to SSD in one transaction and drop `victims`
        from DRAM. Caller holds the lock."""
        self._demote_to_ssd([b for b in batch if not b.on_ssd])
        for b in victims:
            if b.live and self._dram.get(b.key) is b:
                self._drop_dram(b.key, "evict")
                self.stats_.evictions += 1

    def _demote_to_ssd(self, blocks: list[_Block]) -> None:
        """Write leased (or, under the lock, current) blocks to SSD and index them."""
        if self.ssd is None or not blocks:
            return
        keys = {b.key for b in blocks}
        with self._lock:
            # This write supersedes pending deletions of older copies; deleting after it would
            # delete the new copy.
            superseded = [k for k in self._stale_ssd if k in keys]
            if superseded:
                self._stale_ssd = [k for k in self._stale_ssd if k not in keys]
        items = [(b.key, b.meta, self.arena.view(b.offset, b.size)) for b in blocks]
        try:
            self.ssd.put_many(items)
        except CapacityError:
            with self._lock:
                self._stale_ssd.extend(superseded)  # the old copies are still there
                self.stats_.dropped += len(blocks)  # SSD full: the blocks leave the cache cleanly
            return
        finally:
            del items
        with self._lock:
            for b in blocks:
                if not b.live:
                    # Replaced, removed, expired or cleared while it was written outside the lock:
                    # that copy must go. A newer copy indexed meantime may have been overwritten
                    # by it, so it goes too (its DRAM block, if any, is written again on eviction).
                    if b.key in self._ssd_sizes:
                        self._ssd_forget(b.key, "evict")
                        current = self._dram.get(b.key)
                        if current is not None:
                            current.on_ssd = False
                    self._stale_ssd.append(b.key)
                    continue
                b.on_ssd = True
                if b.key not in self._ssd_sizes:
                    self._ssd_sizes[b.key] = b.size
                    self._ssd_order.add(b.key)
                    self._ssd_bytes += b.size
                    if b.expires:
                        self._ssd_expires[b.key] = b.expires
                    for listener in self._listeners:
                        listener.copied(b.key, "ssd")
            self.stats_.demotions += len(blocks)
            self._trim_ssd()

    def _trim_ssd(self) -> None:
        """Drop least recently used SSD blocks above the SSD high watermark (map size based)."""
        assert self.ssd is not None
        cap = self.ssd.map_size * 0.8
        if self._ssd_bytes <= cap * self.config.high_watermark:
            return
        target = cap * self.config.low_watermark
        gone = []
        for k in self._ssd_order:
            if self._ssd_bytes <= target:
                break
            gone.append(k)
            self._ssd_bytes -= self._ssd_sizes[k]
        for k in gone:
            self._ssd_order.discard(k)
            del self._ssd_sizes[k]
            self._ssd_expires.pop(k, None)
            b = self._dram.get(k)
            if b is not None:
                b.on_ssd = False
            self._left(k, "ssd", "evict")
        self._stale_ssd.extend(gone)
        self.stats_.ssd_evictions += len(gone)

    def _demote_loop(self) -> None:
        """Background: keep DRAM under the high watermark by demoting LRU blocks in batches."""
        cfg = self.config
        stuck = False  # the last pass found nothing evictable: wait for the next commit, not spin
        stale_stuck = False  # the last deletion failed (a full disk): retry after a wake-up, not spin
        while True:
            with self._lock:
                while not self._closed and (not self._stale_ssd or stale_stuck) and \
                        (stuck or self.arena.used_bytes <= cfg.high_watermark * self.arena.size):
                    self._wake.wait()
                    stuck = stale_stuck = False
                if self._closed:
                    break
                stale_stuck = not self._delete_stale()
                victims = self._lru_victims(self.arena.used_bytes - cfg.low_watermark * self.arena.size)
                stuck = not victims
                for b in victims:
                    b.leases += 1  # hold them while their bytes are written outside the lock
                self._ssd_writes += 1
            try:
                self._demote_to_ssd([b for b in victims if not b.on_ssd])
            finally:
                with self._lock:
                    for b in victims:
                        self._release_locked(b)
                        if b.live and b.leases == 0 and self._dram.get(b.key) is b and not b.pinned:
                            self._drop_dram(b.key, "evict")
                            self.stats_.evictions += 1
                    self._ssd_writes -= 1
                    self._ssd_written.notify_all()
        with self._lock:
            self._delete_stale()

    def _delete_stale(self) -> bool:
        """Delete outdated SSD copies; False if the disk refused (they stay queued). Caller holds the
        lock: a block written and indexed meantime must not lose its copy."""
        if self._stale_ssd and self.ssd is not None:
            try:
                self.ssd.delete(self._stale_ssd)
            except CapacityError:
                return False
        self._stale_ssd = []
        return True

    def _lru_victims(self, nbytes: float) -> list[_Block]:
        out: list[_Block] = []
        freed = 0
        for k in self._dram_order:
            if freed >= nbytes or freed >= _DEMOTE_BATCH_BYTES:
                break
            b = self._dram[k]
            if self._evictable(b):
                out.append(b)
                freed += self.arena.slot_size(b.offset)
        return out

    def _drop_dram(self, key: bytes, why: str = "") -> bool:
        """Unlink a DRAM block; its slot is freed now or when its last lease ends. `why` (one of
        `cache_events.REASONS`) tells the listeners; a replacement drops quietly."""
        b = self._dram.pop(key, None)
        if b is None:
            return False
        self._dram_order.discard(key)
        b.live = False
        if b.leases == 0:
            self.arena.free(b.offset)
        if why:
            self._left(key, "dram", why)
        return True

    def _ssd_forget(self, key: bytes, why: str = "") -> None:
        self._ssd_bytes -= self._ssd_sizes.pop(key)
        self._ssd_expires.pop(key, None)
        self._ssd_order.discard(key)
        if why:
            self._left(key, "ssd", why)

    def _left(self, key: bytes, tier: str, why: str) -> None:
        """Tell the listeners that `tier` let go of `key`: dropped if another tier holds it, else removed."""
        elsewhere = key in (self._ssd_sizes if tier == "dram" else self._dram)
        for listener in self._listeners:
            (listener.dropped if elsewhere else listener.removed)(key, tier, why)

    def _on_ssd(self, k: bytes, now: float) -> bool:
        """Whether the SSD tier holds an unexpired block of `k` (an expired one is forgotten)."""
        if k not in self._ssd_sizes:
            return False
        expires = self._ssd_expires.get(k)
        if expires is not None and expires <= now:
            self._ssd_forget(k, "expire")
            self._stale_ssd.append(k)
            return False
        return True

    # ----- read path --------------------------------------------------------------------------

    def _present(self, k: bytes, now: float) -> bool:
        b = self._dram.get(k)
        if b is not None:
            if not b.expired(now):
                return True
            self._drop_dram(k, "expire")
        return self._on_ssd(k, now)

    def _acquire(self, k: bytes) -> _Block | None:
        """Lease the DRAM block of `k`, promoting it from SSD if needed; None on a miss."""
        now = time.time()
        with self._lock:
            self._check_open()
            b = self._dram.get(k)
            if b is not None and b.expired(now):
                self._drop_dram(k, "expire")
                b = None
            if b is not None:
                b.leases += 1
                self._dram_order.touch(k)
                self.stats_.hits_dram += 1
                return b
            on_ssd = self._on_ssd(k, now)
        if on_ssd:
            b = self._promote(k, now)
            if b is not None:
                return b
        with self._lock:
            self.stats_.misses += 1
        return None

    def _promote(self, k: bytes, now: float) -> _Block | None:
        """Copy a verified SSD block into DRAM and return it leased; None if gone, expired or corrupt."""
        if self.ssd is None:
            return None
        with self._lock:
            size = self._ssd_sizes.get(k)
            if size is None:
                return None
            try:
                offset = self._alloc(size)
            except CapacityError:
                return None  # DRAM is all leased or pinned: a miss now, not an error

        def into_slot(meta: BlockMeta, payload: memoryview) -> BlockMeta | None:
            if meta.size != size or (meta.expires and meta.expires <= now):
                return None
            self.arena.buf[offset:offset + size] = payload
            return meta

        meta = self.ssd.read(k, into_slot)
        if meta is None:
            with self._lock:
                self.arena.free(offset)
                if k in self._ssd_sizes:
                    self._ssd_forget(k, "corrupt")
                    self._stale_ssd.append(k)
            return None
        with self._lock:
            current = self._dram.get(k)
            if current is not None or k not in self._ssd_sizes:
                # Put, removed or promoted by another reader while this one read SSD: what was
                # read may be outdated, so it must not replace what is there now.
                self.arena.free(offset)
                if current is None:
                    return None
                current.leases += 1
                self.stats_.hits_dram += 1
                return current
            b = self._commit(_Block(k, offset, size, meta.checksum, meta.expires, on_ssd=True), leased=True)
            self._ssd_order.touch(k)
            self.stats_.hits_ssd += 1
            self.stats_.promotions += 1
        return b

    def _release(self, b: _Block) -> None:
        with self._lock:
            self._release_locked(b)

    def _release_locked(self, b: _Block) -> None:
        b.leases -= 1
        if b.leases == 0 and not b.live:
            self.arena.free(b.offset)

    def _get_into(self, k: bytes, dest: Destination) -> int:
        if self.device is not None and dest.tensor is not None:
            n = self._device_get(k, dest)
            if n >= 0:
                return n
        b = self._acquire(k)
        if b is None:
            return -1
        try:
            if b.size > dest.nbytes:
                raise BufferSizeError(f"block {k[:24]!r} is {b.size} bytes; the destination holds {dest.nbytes}")
            if not self._verified(b):
                return -1
            dest.view[:b.size] = self.arena.view(b.offset, b.size)
        finally:
            self._release(b)
        dest.finish(b.size)
        if self.device is not None and dest.tensor is not None and self._on_device(dest.tensor):
            self._device_put(k, dest.tensor[:b.size], b)
        return b.size

    def _verified(self, b: _Block) -> bool:
        """False if `verify_dram_reads` is set and the leased block's bytes fail their checksum
        (the block is then dropped: a miss)."""
        if not self.config.verify_dram_reads or checksum(self.arena.view(b.offset, b.size)) == b.checksum:
            return True
        self._corrupt_dram(b)
        return False

    def _corrupt_dram(self, b: _Block) -> None:
        with self._lock:
            self.stats_.checksum_failures += 1
            if self._dram.get(b.key) is b:
                self._drop_dram(b.key, "corrupt")

    # ----- device tier ------------------------------------------------------------------------

    def _on_device(self, t: Any) -> bool:
        assert self.device is not None
        return type(t).__module__.startswith("torch") and t.device == self.device.device

    def _device_put(self, k: bytes, t: Any, block: _Block) -> None:
        """Keep a device copy of `t`, the bytes of `block`, unless `block` was replaced meantime."""
        assert self.device is not None
        n = t.numel() * t.element_size()
        if n > self.config.device_bytes:
            return
        with self._lock:
            if self._dram.get(k) is not block:
                return  # replaced, removed or evicted since it was read: the copy could be stale
            self._device_drop(k)
            while self._device_bytes + n > self.config.device_bytes:
                oldest = next(iter(self._device_order))
                self._device_drop(oldest)
                self.stats_.device_evictions += 1
            self.device.put(k, t)
            self._device_order.add(k)
            self._device_bytes += n

    def _device_drop(self, k: bytes) -> None:
        assert self.device is not None
        t = self.device.blocks.get(k)
        if t is not None:
            self._device_bytes -= t.numel()
            self.device.drop(k)
            self._device_order.discard(k)

    def _device_get(self, k: bytes, dest: Destination) -> int:
        assert self.device is not None
        with self._lock:
            self._check_open()
            t = self.device.get(k)
            if t is None or not self._present(k, time.time()):
                return -1  # a device copy is only as good as the block below it
            n = t.numel()
            if n > dest.nbytes:
                raise BufferSizeError(f"block {k[:24]!r} is {n} bytes; the destination holds {dest.nbytes}")
            self._device_order.touch(k)
            self.stats_.hits_device += 1
        dest.tensor[:n].copy_(t)
        return n

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosed("the cache is closed")

"""The tiers of one cache under one lock: DRAM (always), SSD and device (when configured), the
counters, and the listeners, with what keeps them in step when a block enters or leaves a tier.

A block is committed into DRAM (its older copies in every tier go with the old bytes); it leaves a
tier by removal, eviction, expiry or a failed checksum, and the listeners hear whether that was its
last copy (`removed`) or not (`dropped`). `tier_moves` moves blocks between tiers on top of this.
Each block has a version (`kvpool.core.versions`); removals leave tombstones, and the stack logs the
changes it accepts, for a replica that comes back to catch up from.
"""
from __future__ import annotations

import logging
import math
import operator
import threading
import time

from .cache_events import CacheListener, Holdings
from .config import CacheConfig
from .errors import PoolClosed, StorageError
from .stats import CacheCounters, CacheStats
from .tiers.device import DeviceTier, cuda_available
from .tiers.dram import DramArena, sweep_dead_arenas
from .tiers.dram_tier import DramBlock, DramTier, block_meta
from .tiers.ssd import SsdStore
from .tiers.ssd_tier import SsdTier
from .versions import ChangeLog, Clears, Tombstones

__all__ = ["TierStack", "with_prefix"]

log = logging.getLogger("kvpool.ssd")

_PREFIX_CHUNK = 512
"""Keys `prefix_match` looks up at a time."""


class TierStack:
    """The tiers `config` describes; `share_arena=True` names the DRAM arena in /dev/shm for same-node
    clients to map (and first sweeps arenas that dead workers left). Every method but `close` is
    called with `lock` held."""

    def __init__(self, config: CacheConfig, *, share_arena: bool = False) -> None:
        self.config = cfg = config
        self.lock = threading.RLock()
        self.demote_due = threading.Condition(self.lock)
        """Notified when a commit leaves DRAM above its high watermark, and at close."""
        self.closed = False
        self.counters = CacheCounters()
        self.listeners: tuple[CacheListener, ...] = ()  # told of every block change, under the lock
        self.tombstones = Tombstones()
        self.clears = Clears()
        self.changes = ChangeLog()
        """Versioned puts and removes accepted, for peers that catch up (`kvpool.core.catch_up`)."""
        self._replaced = False  # a commit replaced an SSD copy since `delete_replaced`
        self.writing: set[bytes] = set()
        """Keys of blocks being written to SSD outside the lock (`TierMoves.demote`), one write of a key at
        a time: a copy written there is on SSD before the index knows of it."""
        self.written = threading.Condition(self.lock)
        """Notified as each such write ends (`TierMoves._written_out`), and as a batch's leases go (`end_write`)."""
        self._awaited: set[bytes] = set()  # keys replaced while written: `delete_replaced` waits for them
        self._fence_floor = 0  # while fenced: the oldest version a read may serve (accepted since)
        self.fence_at = math.inf
        """Monotonic seconds after which reads are misses until pushed back (a worker's heartbeat
        pushes it forward: a process paused past it wakes up fenced, before it can serve a read)."""
        self.stall_at = math.inf
        """The same, pushed by a worker's stall watch (`kvpool.core.stall_watch`) every fraction of a second."""
        if share_arena:
            sweep_dead_arenas()  # what a kill -9'd worker on this node left
        arena = DramArena(cfg.dram_bytes, cfg.dram_slab_size, cfg.dram_name, cfg.prefault, shared=share_arena)
        self.ssd: SsdTier | None = None
        store: SsdStore | None = None
        try:
            self.dram = DramTier(arena, cfg.policy, self.counters)
            if cfg.ssd_path:
                store = SsdStore(cfg.ssd_path, cfg.ssd_map_size, cfg.ssd_sync)
                self.ssd = SsdTier(store, cfg.policy)  # indexes what a previous run left
                self._drop_unreadable()
            device = cfg.device
            if device == "auto":
                device = "cuda" if cuda_available() else None
            self.device = DeviceTier(device, cfg.device_bytes, cfg.policy) if device else None
        except BaseException:
            if store is not None:
                store.close()
            arena.close()  # a shared-memory name outlives the process unless it is unlinked
            raise
        self._high_bytes = cfg.high_watermark * arena.size

    @property
    def readable_from(self) -> float:
        """The oldest block version a read may serve: 0 normally. A worker back from an absence that has
        not yet dropped what it missed (`kvpool.core.catch_up`) is fenced: only blocks newer than
        anything it can have missed (accepted since it came back) are read, the rest are misses; and
        none at all once its heartbeats stopped past `fence_at`, or its stall watch past `stall_at` (it
        may have been paused)."""
        deadline = min(self.fence_at, self.stall_at)
        if deadline != math.inf and time.monotonic() > deadline:
            return math.inf
        return self._fence_floor

    def fence(self, floor: int) -> None:
        """Serve only blocks of version `floor` or newer (0: every block)."""
        self._fence_floor = floor

    @property
    def fence_floor(self) -> float:
        """The floor `fence` set (0: none), whatever the heartbeat and stall deadlines say."""
        return self._fence_floor

    def check_open(self) -> None:
        if self.closed:
            raise PoolClosed("the cache is closed")

    # ----- blocks entering and leaving ------------------------------------------------------------

    def commit(self, block: DramBlock) -> None:
        """Make a block written into a reserved slot visible under its key. A copy already on SSD
        (`block.on_ssd`: a promotion) stays; older copies of other bytes go."""
        key = block.key
        self.dram.drop(key)  # quietly: a replacement is a store, not a removal
        if self.device is not None:
            self.device.drop(key)
        ssd = self.ssd
        if ssd is not None and key in ssd and not block.on_ssd:
            ssd.forget(key)
            ssd.mark_stale((key,))
            self._replaced = True  # deleted before the put returns (`delete_replaced`)
        elif ssd is not None and not block.on_ssd and ssd.stale_among((key,)):
            self._replaced = True  # an older copy a full disk kept: deleted before this put returns too
        if key in self.writing and not block.on_ssd:  # an older copy lands on SSD at the write's end ...
            self._awaited.add(key)  # ... and is deleted before the put returns too
            self._replaced = True
        self.dram.insert(block)
        for listener in self.listeners:  # on_ssd: a promotion, the same bytes as the SSD copy
            (listener.copied if block.on_ssd else listener.stored)(key, "dram")
        if self.dram.arena.used_bytes > self._high_bytes:
            self.demote_due.notify()

    def delete_replaced(self) -> None:
        """Delete the SSD copies that commits replaced since the last call, in one transaction, as
        `remove` does: the put that replaced one returns after it, so a kill -9 cannot leave the older
        copy to be served after a restart. A full disk leaves them queued (the demoter retries) and raises
        StorageError: the put is not acknowledged (it is served until then, but a crash would leave the
        older copy to be served after the restart)."""
        if self._replaced and self.ssd is not None:
            self._replaced = False
            self.await_writes(self._awaited)  # (each such write queues its copy for deletion as it ends)
            self._awaited.clear()
            self.delete_stale_now("put")

    def await_writes(self, keys: set[bytes] | list[bytes]) -> None:
        """Until no SSD write of a block of `keys` is in flight (at most one LMDB transaction each)."""
        while any(k in self.writing for k in keys):
            self.written.wait()

    def commit_many(self, blocks: list[DramBlock], keys: list[bytes]) -> list[bool] | None:
        """`commit` of each block (`keys`: theirs) in bulk where nothing but DRAM can know their keys (no
        device tier holding one, no SSD copy, no tombstone, no pin, no listener; keys distinct): True for
        each block stored, False for one whose key holds a version as new (its slot freed). None, having
        done nothing, where that does not hold: the caller commits them one by one."""
        if (self.listeners or self.dram.pins or len(set(keys)) != len(keys) or not self.tombstones.none_of(keys)
                or (self.clears and self.clears.newest >= min((b.version for b in blocks), default=0))
                or (self.ssd is not None and (not self.ssd.none_of(keys) or self.ssd.stale_among(keys)))
                or (self.writing and any(map(self.writing.__contains__, keys)))
                or (self.device is not None and any(map(self.device.__contains__, keys)))):
            return None
        stored = self.dram.insert_many(blocks)
        if self.dram.arena.used_bytes > self._high_bytes:
            self.demote_due.notify()
        return stored

    def version_of(self, key: bytes) -> int:
        """The version of the block of `key` this stack holds (DRAM, else SSD); 0 if none."""
        b = self.dram.blocks.get(key)
        if b is not None:
            return b.version
        return self.ssd.version_of(key) if self.ssd is not None else 0

    def newest(self, key: bytes) -> int:
        """The newest version this stack knows of `key`: its block's or its removal's; 0 if neither."""
        return max(self.version_of(key), self.removed_version(key))

    def removed_version(self, key: bytes) -> int:
        """The version of the newest removal of `key` this stack knows: its tombstone's, or a clear's."""
        return max(self.tombstones.version(key), self.clears.version(key))

    def left(self, key: bytes, tier: str, why: str) -> None:
        """Tell the listeners that `tier` let go of `key`: dropped if another tier holds it, else removed."""
        if not self.listeners:
            return
        elsewhere = key in self.dram.blocks if tier == "ssd" else (self.ssd is not None and key in self.ssd)
        for listener in self.listeners:
            (listener.dropped if elsewhere else listener.removed)(key, tier, why)

    def drop_dram(self, key: bytes, why: str) -> bool:
        """Unlink the DRAM block of `key` (its slot is freed now or at its last lease's end); `why`
        (one of `cache_events.REASONS`) tells the listeners. False if DRAM held no block of `key`."""
        if self.dram.drop(key) is None:
            return False
        self.left(key, "dram", why)
        return True

    def _drop_unreadable(self) -> None:
        """At open: drop the SSD blocks larger than this run's DRAM max block (a tier written with larger
        slabs). A read promotes a block into DRAM, so none of them could be read here, yet lookups
        (`exists`, `prefix_match`) would say them present: an engine would plan to load what every get
        then misses."""
        assert self.ssd is not None
        limit = self.dram.arena.max_block
        big = self.ssd.larger_than(limit)
        if not big:
            return
        need = max(self.ssd.size_of(k) or 0 for k in big)
        for k in big:
            self.drop_ssd(k, "evict")
        self.ssd.delete_stale()  # (a full disk leaves them queued: the demoter retries)
        log.warning("SSD tier at %s: %d blocks larger than this worker's largest block (dram_slab_size %d) "
                    "dropped: a read could never serve them (a slab size of %d or more keeps such blocks)",
                    self.config.ssd_path, len(big), limit, need)

    def drop_ssd(self, key: bytes, why: str) -> None:
        """Unindex the SSD block of `key` and queue its copy for deletion; `why` tells the listeners."""
        assert self.ssd is not None
        self.ssd.forget(key)
        self.ssd.mark_stale((key,))
        b = self.dram.blocks.get(key)
        if b is not None:
            b.on_ssd = False
        self.left(key, "ssd", why)

    def on_ssd(self, key: bytes, now: float) -> bool:
        """Whether the SSD tier holds an unexpired block of `key` (an expired one is dropped)."""
        ssd = self.ssd
        if ssd is None or key not in ssd:
            return False
        if ssd.expired(key, now):
            self.drop_ssd(key, "expire")
            return False
        return True

    def present(self, key: bytes, now: float) -> bool:
        """Whether any tier holds an unexpired block of `key` (expired ones are dropped)."""
        b = self.dram.blocks.get(key)
        if b is not None:
            if not b.expired(now):
                return True
            self.drop_dram(key, "expire")
        return self.on_ssd(key, now)

    def presence(self, keys: list[bytes], now: float) -> list[bool]:
        """`present` of each key. Without TTL'd blocks a dict lookup or two per key in C (`map`), so
        the cost grows with len(keys), not with the number of blocks held."""
        ssd = self.ssd
        floor = self.readable_from
        if floor:
            version_of = self.version_of
            return [self.present(k, now) and version_of(k) >= floor for k in keys]
        if self.dram.timed or (ssd is not None and ssd.timed):
            present = self.present
            return [present(k, now) for k in keys]
        held = list(map(self.dram.blocks.__contains__, keys))
        if ssd is not None and not all(held):
            held = list(map(operator.or_, held, ssd.holds(keys)))
        return held

    def prefix_match(self, keys: list[bytes], now: float) -> int:
        """Length of the longest prefix of `keys` whose blocks are all present (`presence` a chunk at
        a time, so a chain that breaks early costs little)."""
        for start in range(0, len(keys), _PREFIX_CHUNK):
            held = self.presence(keys[start:start + _PREFIX_CHUNK], now)
            if not all(held):
                return start + held.index(False)
        return len(keys)

    def remove(self, keys: list[bytes]) -> list[bool]:
        """Remove each key's block from every tier; whether DRAM or SSD held one. Their SSD copies are
        deleted now; a full disk leaves them to the demoter and raises StorageError (`delete_stale_now`)."""
        found = []
        stored: list[bytes] = []  # keys with a copy on SSD, or on its way there
        ssd = self.ssd
        for key in keys:
            hit = self.drop_dram(key, "remove")
            if self.device is not None:
                self.device.drop(key)
            if ssd is not None and key in ssd:
                ssd.forget(key)
                self.left(key, "ssd", "remove")
                hit = True
                stored.append(key)
            elif hit and key in self.writing:
                stored.append(key)
            found.append(hit)
        if ssd is not None and stored:
            ssd.mark_stale(stored)  # (before the wait: a newer copy written meanwhile is not marked)
            self.await_writes(stored)  # a copy being written lands first (queued as it ends) and goes too
        if ssd is not None and (stored or ssd.stale_among(keys)):  # (a retry of a refused remove too)
            self.delete_stale_now("remove")
        return found

    def delete_stale_now(self, change: str) -> None:
        """Delete the SSD copies queued for deletion, before `change` (a put, a remove) is acknowledged.
        StorageError where the disk refuses (they stay queued: the demoter retries): until they are gone
        a crash would bring them back after the restart, so the change must not be reported as done."""
        assert self.ssd is not None
        if not self.ssd.delete_stale():
            self.demote_due.notify()
            raise StorageError(f"the SSD tier's disk is full: older copies could not be deleted, so this {change} is "
                               "not durable (it holds until a restart; a crash would undo it): free disk space")

    def clear(self) -> None:
        """Remove every block from every tier, and tell the listeners. Where a full disk refuses the SSD
        tier's delete, every block goes all the same (its SSD copies queued for deletion) and the
        StorageError is raised after: the clear is not durable yet."""
        writing = list(self.writing)
        refused: StorageError | None = None
        if self.ssd is not None:
            try:
                self.ssd.clear()
            except StorageError as e:  # a full disk: every block dropped all the same, deleted later
                refused = e
        self.dram.clear()
        if self.device is not None:
            self.device.clear()
        if self.ssd is not None and writing:  # a copy being written lands after the clear (queued as it ends)
            self.await_writes(writing)
            self.ssd.delete_stale()
        for listener in self.listeners:
            listener.cleared()
        if refused is not None:
            self.demote_due.notify()
            raise refused

    def key_lists(self) -> list[list[bytes]]:
        """The keys each tier holds now, device copies included (copies: a caller may go through them
        without the lock: `with_prefix`)."""
        return [list(self.dram.blocks), *(list(tier) for tier in (self.ssd, self.device) if tier is not None)]

    def keys_with_prefix(self, prefix: bytes) -> list[bytes]:
        """Keys starting with `prefix` that any tier holds, device copies included, sorted."""
        return with_prefix(self.key_lists(), prefix)

    def add_listener(self, listener: CacheListener, replay: bool) -> None:
        """See `TieredCache.add_listener`."""
        if replay:
            holdings = Holdings(self.dram.blocks, self.ssd or ())
            if not listener.replayed(holdings):
                holdings.tell(listener)
        self.listeners = (*self.listeners, listener)

    def remove_listener(self, listener: CacheListener) -> None:
        self.listeners = tuple(x for x in self.listeners if x is not listener)

    # ----- reports --------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        dram, ssd, device = self.dram, self.ssd, self.device
        dram.pins.expire()  # count live pins only (expiry is otherwise applied when room is needed)
        pins, pending, refused = dram.pins.counts()
        s = CacheStats(**vars(self.counters), dram_bytes=dram.arena.used_bytes, dram_capacity=dram.arena.size,
                       dram_blocks=len(dram), dram_leases=dram.leases,
                       ssd_bytes=ssd.nbytes if ssd else 0, ssd_blocks=len(ssd) if ssd else 0,
                       device_bytes=device.nbytes if device else 0, device_blocks=len(device) if device else 0,
                       pins=pins, pending_pins=pending, pins_refused=refused)
        if ssd is not None:
            s.checksum_failures += ssd.store.corrupt
        return s

    def check(self) -> list[str]:
        """Every tier's own `check`, then what spans tiers: a DRAM block's SSD copy holds its bytes.
        (A block past its TTL is not an error: expiry is lazy.)"""
        dram, ssd, device = self.dram, self.ssd, self.device
        errors = dram.check()
        copies = {k: block_meta(b) for k, b in dram.blocks.items() if b.on_ssd}
        if ssd is not None:
            errors += ssd.check(copies)
        elif copies:
            errors.append(f"{len(copies)} DRAM blocks claim an SSD copy but there is no SSD tier")
        if device is not None:
            errors += device.check()  # a copy may outlive its block below: reads check `present` first
        return errors

    def forked(self) -> None:
        """In a forked child (the lock held by this thread since before the fork): what the parent's
        threads had under way is not the child's to wait for. A private arena is the child's own copy
        (copy on write); the SSD and device tiers stay the parent's (an index of its own over the
        parent's LMDB would serve, evict and overwrite the parent's blocks behind its back): the child
        works from DRAM alone. A shared arena is the worker's: the child's is closed."""
        self.writing.clear()
        self._awaited.clear()
        self.dram.forked()
        self._inherited = (self.ssd, self.device)  # kept, never closed here: the parent's
        self.ssd = self.device = None
        if self.dram.arena.shared:
            self.closed = True

    def close(self) -> None:
        """Close the SSD store and release the arena (the caller stopped every thread first)."""
        with self.lock:
            if self.ssd is not None:
                self.ssd.close()
            self.dram.arena.close()
            self.dram.blocks.clear()


def with_prefix(key_lists: list[list[bytes]], prefix: bytes) -> list[bytes]:
    """The keys of `key_lists` (`TierStack.key_lists`) that start with `prefix`, each once, sorted."""
    return sorted({k for keys in key_lists for k in keys if k.startswith(prefix)})

"""The SSD tier: an LMDB store (`ssd.SsdStore`) and what the cache knows of it without reading it:
each indexed block's size, expiry and eviction order, the bytes they add up to, and the outdated
copies that still wait to be deleted. That index is saved beside LMDB at close and read back at open
when it still matches (`ssd_index`), else rebuilt from the blocks' headers.

It holds no lock of its own: the cache calls every method with its lock held, except the store's
reads and batch writes, which the cache makes outside its lock on blocks it holds leased.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import lmdb
import numpy as np

from ..blocks import HEADER_SIZE, BlockMeta
from ..errors import CapacityError, StorageError
from ..policies import EVICTION_POLICY
from ..versions import observe
from . import ssd_index
from .ssd import SsdStore, walk_pages

__all__ = ["SsdTier"]

_FILL = 0.8
"""Share of LMDB's map size the blocks' pages may fill: the B-tree's inner pages and free lists need the rest."""
_NODE, _PAGE_HEADER = 8, 16
"""LMDB's node and page headers (bytes)."""


def on_disk(key_len: Any, size: Any, psize: int = 4096) -> Any:
    """About the bytes LMDB takes for a block of `size` payload bytes under a key of `key_len` (ints, or
    int64 arrays alike): whole overflow pages for a value too big for a leaf node (a 4 KiB block and its
    header take two 4 KiB pages), else its node in a leaf page about half full (pages split in two)."""
    value = HEADER_SIZE + size
    node = _NODE + key_len + value
    largest = ((psize - _PAGE_HEADER) // 2 & ~1) - 2  # LMDB's largest node in a leaf page
    overflow = ((value + _PAGE_HEADER - 1) // psize + 1) * psize + (_NODE + key_len + 8 + 2) * 2
    return (node > largest) * overflow + (node <= largest) * ((node + 2) * 2)


class SsdTier:
    """The blocks of `store`, indexed at open (from the index saved at the last clean close if it still
    matches LMDB, else from their headers), evicted in the order `policy` says."""

    def __init__(self, store: SsdStore, policy: str) -> None:
        self.store = store
        started = time.monotonic()
        try:
            snap = ssd_index.load(store)
            if snap is None:  # a scan meets every page: a damaged one must not kill this process
                walk_pages(store)
                snap = ssd_index.scan(store)
        except lmdb.Error as e:  # LMDB's own pages damaged (a bad disk; or ssd_sync=False and a power loss)
            raise StorageError(f"the SSD tier at {store.path} is damaged ({type(e).__name__}: {e}); move the "
                               "folder aside to start with an empty tier") from e
        self.opened_from = snap.source
        """Where the index came from at open: "index" (the saved file) or "scan" (every header)."""
        self._sizes: dict[bytes, int] = snap.sizes
        self._expires: dict[bytes, float] = snap.expires  # of the blocks that have a TTL
        self._versions: dict[bytes, int] = snap.versions
        observe(max(snap.versions.values(), default=0))  # this run stamps above what the last one wrote
        self._order = EVICTION_POLICY[policy]()
        self._order.adopt(snap.sizes)
        self.nbytes = sum(snap.sizes.values())
        """Payload bytes of the indexed blocks."""
        self._psize = int(store.env.stat()["psize"])
        self.disk_bytes = _disk_bytes(snap.sizes, self._psize)
        """What they take in LMDB, about (`on_disk`): what fills its map, and what `trim` keeps under it."""
        self._stale: dict[bytes, None] = dict.fromkeys(snap.stale)  # keys whose stored copy is outdated, in order:
        # `delete_stale` deletes them
        # LMDB's transaction id before this object's first write: at close, the index is saved only if
        # every write since was this object's own (another process's would make it wrong).
        self._txnid_base = ssd_index.last_txnid(store) - store.commits
        ssd_index.log.info("SSD tier at %s: %d blocks (%d bytes) indexed from its %s in %.2f s", store.path,
                           len(self._sizes), self.nbytes, "saved index" if snap.source == "index" else "headers",
                           time.monotonic() - started)

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._sizes)

    @property
    def capacity(self) -> float:
        """Bytes the blocks may fill on disk before the least recently used go (see `trim`)."""
        return self.store.map_size * _FILL

    @property
    def timed(self) -> bool:
        """Whether any indexed block has a TTL (if not, lookups need not check expiry)."""
        return bool(self._expires)

    def holds(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is indexed (expired or not), in one C-level pass."""
        return list(map(self._sizes.__contains__, keys))

    def none_of(self, keys: list[bytes]) -> bool:
        """Whether none of `keys` is indexed, in one C-level pass."""
        return self._sizes.keys().isdisjoint(keys)

    def size_of(self, key: bytes) -> int | None:
        return self._sizes.get(key)

    def larger_than(self, limit: int) -> list[bytes]:
        """The keys of the indexed blocks over `limit` bytes (a pass in C where there are none)."""
        sizes = self._sizes
        if not sizes or max(sizes.values()) <= limit:
            return []
        return [k for k, n in sizes.items() if n > limit]

    def version_of(self, key: bytes) -> int:
        """The version of the indexed block of `key` (0: none indexed, or a block without one)."""
        return self._versions.get(key, 0)

    def footprint(self, key: bytes, size: int) -> int:
        """What a block of `size` payload bytes under `key` would take in LMDB (`on_disk`)."""
        return int(on_disk(len(key), size, self._psize))

    def add(self, key: bytes, meta: BlockMeta) -> None:
        """Index a block now committed in the store (its key must not be indexed)."""
        self._sizes[key] = meta.size
        self._order.add(key)
        self.nbytes += meta.size
        self.disk_bytes += self.footprint(key, meta.size)
        self._versions[key] = meta.version
        if meta.expires:
            self._expires[key] = meta.expires

    def forget(self, key: bytes) -> None:
        """Unindex `key` (its stored copy stays until `mark_stale` and `delete_stale`)."""
        size = self._sizes.pop(key)
        self.nbytes -= size
        self.disk_bytes -= self.footprint(key, size)
        self._expires.pop(key, None)
        self._versions.pop(key, None)
        self._order.discard(key)

    def mark_stale(self, keys: Iterable[bytes]) -> None:
        """The stored copies of `keys` are outdated: the next `delete_stale` deletes them."""
        self._stale.update(dict.fromkeys(keys))

    def stale_among(self, keys: Iterable[bytes]) -> bool:
        """Whether a stored copy of one of `keys` waits to be deleted (a full disk refused it)."""
        stale = self._stale
        return bool(stale) and any(k in stale for k in keys)

    def expired(self, key: bytes, now: float) -> bool:
        """Whether the indexed block of `key` has a TTL that passed by `now` (unix seconds)."""
        expires = self._expires.get(key)
        return expires is not None and expires <= now

    def touch(self, key: bytes) -> None:
        self._order.touch(key)

    def trim(self, high_watermark: float, low_watermark: float, incoming: int = 0) -> list[bytes]:
        """Above `high_watermark` of `capacity` (what the blocks take on disk, `disk_bytes`, with the
        `incoming` bytes of a write about to be made), forget the first blocks to go until the rest fit
        under `low_watermark`; returns their keys (their copies are deleted with the stale ones)."""
        if self.disk_bytes + incoming <= self.capacity * high_watermark:
            return []
        target = self.capacity * low_watermark - incoming
        gone = []
        held = self.disk_bytes
        for k in self._order:
            if held <= target:
                break
            gone.append(k)
            held -= self.footprint(k, self._sizes[k])
        for k in gone:
            self.forget(k)
        self._stale.update(dict.fromkeys(gone))
        return gone

    def supersede(self, keys: Iterable[bytes]) -> list[bytes]:
        """Withdraw the pending deletions of `keys`, about to be written again (deleting after the
        write would delete the new copy); returns them, for `unsupersede` if the write fails."""
        keys = set(keys)
        superseded = [k for k in keys if k in self._stale]
        for k in superseded:
            del self._stale[k]
        return superseded

    def unsupersede(self, keys: list[bytes]) -> None:
        """The write of `keys` (from `supersede`) failed: their older copies are still there."""
        self._stale.update(dict.fromkeys(keys))

    def delete_stale(self) -> bool:
        """Delete outdated copies; False if the disk refused (they stay queued for a retry)."""
        if self._stale:
            try:
                self.store.delete(list(self._stale))
            except CapacityError:
                return False
        self._stale = {}
        return True

    @property
    def has_stale(self) -> bool:
        return bool(self._stale)

    def clear(self) -> None:
        """Forget and delete every block. Where the disk refuses the delete (full), every block is
        forgotten all the same and queued for deletion (the demoter retries; a clean close saves the
        queue with the index), and StorageError says the clear is not durable yet: a crash before the
        deletion would bring the blocks back."""
        try:
            self.store.clear()
        except CapacityError as e:
            self._stale.update(dict.fromkeys(self._sizes))
            self._forget_all()
            raise StorageError(f"the SSD tier's disk is full: its blocks are dropped but not deleted yet, so this "
                               f"clear is not durable (a crash would undo it): free disk space ({e})") from e
        self._forget_all()
        self._stale = {}

    def _forget_all(self) -> None:
        self._sizes.clear()
        self._expires.clear()
        self._versions.clear()
        self._order.clear()
        self.nbytes = self.disk_bytes = 0

    def close(self) -> None:
        """Save the index beside LMDB (if only this tier wrote since open) and close the store."""
        store = self.store
        try:
            ours = ssd_index.last_txnid(store) == self._txnid_base + store.commits
        except StorageError:  # closed already
            return
        if ours:  # sizes in eviction order: the order is saved as the dict's
            sizes = self._sizes
            ssd_index.save(store, ssd_index.Snapshot(dict(zip(self._order, map(sizes.__getitem__, self._order))),
                                                     self._expires, list(self._stale), self._versions))
        store.close()

    def check(self, copies: Mapping[bytes, BlockMeta]) -> list[str]:
        """What is wrong with the index (empty when consistent): its byte count and order agree with
        it; every indexed block is in the store with the size and expiry indexed; every stored block
        is indexed or waits to be deleted (else it would come back on restart); each of `copies` (DRAM
        blocks that claim an SSD copy) is indexed and stored with its checksum. Reads every header."""
        errors = []
        if sum(self._sizes.values()) != self.nbytes or _disk_bytes(self._sizes, self._psize) != self.disk_bytes:
            errors.append(f"SSD index counts {self.nbytes} bytes ({self.disk_bytes} on disk); its blocks add up "
                          f"to {sum(self._sizes.values())} ({_disk_bytes(self._sizes, self._psize)})")
        if set(self._order) != self._sizes.keys() or not self._expires.keys() <= self._sizes.keys():
            errors.append(f"SSD eviction order holds {len(self._order)} keys and {len(self._expires)} expiries; "
                          f"the index {len(self._sizes)} blocks")
        stored = dict(self.store.scan())
        for k, size in self._sizes.items():
            meta = stored.get(k)
            if meta is None:
                errors.append(f"{k[:24]!r} is indexed on SSD but LMDB does not hold it")
            elif (meta.size != size or meta.expires != self._expires.get(k, 0.0)
                  or meta.version != self._versions.get(k, 0)):
                errors.append(f"{k[:24]!r}: LMDB holds {meta.size} bytes expiring at {meta.expires} of version "
                              f"{meta.version}, the index {size} expiring at {self._expires.get(k, 0.0)} of version "
                              f"{self._versions.get(k, 0)}")
        for k, want in copies.items():
            meta = stored.get(k)
            if k not in self._sizes or meta is None or (meta.size, meta.checksum) != (want.size, want.checksum):
                errors.append(f"DRAM block {k[:24]!r} claims an SSD copy; the SSD tier has "
                              f"{'none' if meta is None or k not in self._sizes else 'different bytes'}")
        orphans = stored.keys() - self._sizes.keys() - set(self._stale)
        if orphans:
            errors.append(f"{len(orphans)} SSD copies are neither indexed nor queued for deletion (they would "
                          f"come back on restart), e.g. {min(orphans)[:24]!r}")
        return errors


def _disk_bytes(sizes: Mapping[bytes, int], psize: int) -> int:
    """`on_disk` summed over `sizes` (key -> payload bytes) in one numpy pass: a tier of a million
    blocks opens in a fraction of a second."""
    keys = np.fromiter(map(len, sizes), dtype=np.int64, count=len(sizes))
    return int(on_disk(keys, np.fromiter(sizes.values(), dtype=np.int64, count=len(sizes)), psize).sum())

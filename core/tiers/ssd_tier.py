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

import lmdb

from ..blocks import BlockMeta
from ..errors import CapacityError, StorageError
from ..policies import EVICTION_POLICY
from . import ssd_index
from .ssd import SsdStore

__all__ = ["SsdTier"]

_FILL = 0.8
"""Share of LMDB's map size the blocks may fill: the B-tree's pages and free lists need the rest."""


class SsdTier:
    """The blocks of `store`, indexed at open (from the index saved at the last clean close if it still
    matches LMDB, else from their headers), evicted in the order `policy` says."""

    def __init__(self, store: SsdStore, policy: str) -> None:
        self.store = store
        started = time.monotonic()
        try:
            snap = ssd_index.load(store) or ssd_index.scan(store)
        except lmdb.Error as e:  # LMDB's own pages damaged (a bad disk; or ssd_sync=False and a power loss)
            raise StorageError(f"the SSD tier at {store.path} is damaged ({type(e).__name__}: {e}); move the "
                               "folder aside to start with an empty tier") from e
        self.opened_from = snap.source
        """Where the index came from at open: "index" (the saved file) or "scan" (every header)."""
        self._sizes: dict[bytes, int] = snap.sizes
        self._expires: dict[bytes, float] = snap.expires  # of the blocks that have a TTL
        self._versions: dict[bytes, int] = snap.versions
        self._order = EVICTION_POLICY[policy]()
        self._order.extend(snap.sizes)
        self.nbytes = sum(snap.sizes.values())
        """Payload bytes of the indexed blocks."""
        self._stale: list[bytes] = snap.stale  # keys whose stored copy is outdated; `delete_stale` deletes them
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
        """Bytes the blocks may fill before the least recently used go (see `trim`)."""
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

    def version_of(self, key: bytes) -> int:
        """The version of the indexed block of `key` (0: none indexed, or a block without one)."""
        return self._versions.get(key, 0)

    def add(self, key: bytes, meta: BlockMeta) -> None:
        """Index a block now committed in the store (its key must not be indexed)."""
        self._sizes[key] = meta.size
        self._order.add(key)
        self.nbytes += meta.size
        self._versions[key] = meta.version
        if meta.expires:
            self._expires[key] = meta.expires

    def forget(self, key: bytes) -> None:
        """Unindex `key` (its stored copy stays until `mark_stale` and `delete_stale`)."""
        self.nbytes -= self._sizes.pop(key)
        self._expires.pop(key, None)
        self._versions.pop(key, None)
        self._order.discard(key)

    def mark_stale(self, keys: Iterable[bytes]) -> None:
        """The stored copies of `keys` are outdated: the next `delete_stale` deletes them."""
        self._stale.extend(keys)

    def expired(self, key: bytes, now: float) -> bool:
        """Whether the indexed block of `key` has a TTL that passed by `now` (unix seconds)."""
        expires = self._expires.get(key)
        return expires is not None and expires <= now

    def touch(self, key: bytes) -> None:
        self._order.touch(key)

    def trim(self, high_watermark: float, low_watermark: float) -> list[bytes]:
        """Above `high_watermark` of `capacity`, forget the first blocks to go until the rest fit under
        `low_watermark`; returns their keys (their copies are deleted with the stale ones)."""
        if self.nbytes <= self.capacity * high_watermark:
            return []
        target = self.capacity * low_watermark
        gone = []
        nbytes = self.nbytes
        for k in self._order:
            if nbytes <= target:
                break
            gone.append(k)
            nbytes -= self._sizes[k]
        for k in gone:
            self.forget(k)
        self._stale.extend(gone)
        return gone

    def supersede(self, keys: Iterable[bytes]) -> list[bytes]:
        """Withdraw the pending deletions of `keys`, about to be written again (deleting after the
        write would delete the new copy); returns them, for `unsupersede` if the write fails."""
        keys = set(keys)
        superseded = [k for k in self._stale if k in keys]
        if superseded:
            self._stale = [k for k in self._stale if k not in keys]
        return superseded

    def unsupersede(self, keys: list[bytes]) -> None:
        """The write of `keys` (from `supersede`) failed: their older copies are still there."""
        self._stale.extend(keys)

    def delete_stale(self) -> bool:
        """Delete outdated copies; False if the disk refused (they stay queued for a retry)."""
        if self._stale:
            try:
                self.store.delete(self._stale)
            except CapacityError:
                return False
        self._stale = []
        return True

    @property
    def has_stale(self) -> bool:
        return bool(self._stale)

    def clear(self) -> None:
        """Forget and delete every block."""
        self._sizes.clear()
        self._expires.clear()
        self._versions.clear()
        self._order.clear()
        self.nbytes = 0
        self.store.clear()

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
                                                     self._expires, self._stale, self._versions))
        store.close()

    def check(self, copies: Mapping[bytes, BlockMeta]) -> list[str]:
        """What is wrong with the index (empty when consistent): its byte count and order agree with
        it; every indexed block is in the store with the size and expiry indexed; every stored block
        is indexed or waits to be deleted (else it would come back on restart); each of `copies` (DRAM
        blocks that claim an SSD copy) is indexed and stored with its checksum. Reads every header."""
        errors = []
        if sum(self._sizes.values()) != self.nbytes:
            errors.append(f"SSD index counts {self.nbytes} bytes; its blocks add up to {sum(self._sizes.values())}")
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

"""What a TieredCache tells its listeners: every block that enters, moves between tiers or leaves it.

A listener is registered with `TieredCache.add_listener`. The cache calls it with its lock held, from
the thread that made the change, in the order the changes happened: a listener must be quick (append
to a queue), must not raise, and must never call the cache back. `kvpool.core.events` builds the
published block events (NATS, vLLM's ZMQ format) on this interface.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

__all__ = ["TIERS", "REASONS", "CacheListener", "Holdings"]

TIERS = ("dram", "ssd")
"""Tiers reported. Device copies mirror DRAM blocks of the same node and are not reported."""

REASONS = ("remove", "evict", "expire", "corrupt")
"""Why a tier let go of a block: a caller removed it, the tier needed room (LRU eviction or a full
SSD), its TTL passed, or its bytes failed their checksum."""


class CacheListener:
    """Do-nothing hooks; subclasses override what they need. Keys are the cache's raw key bytes."""

    def stored(self, key: bytes, tier: str) -> None:
        """New bytes were committed under `key` in `tier` (a put; a replaced block's older copies in
        other tiers are gone with it). Called once per block put."""

    def copied(self, key: bytes, tier: str) -> None:
        """A held block got a copy in another `tier`: demotion written to SSD (before it leaves DRAM,
        or by `flush`), or promotion from SSD into DRAM. Its other copies stay."""

    def dropped(self, key: bytes, tier: str, reason: str) -> None:
        """`tier`'s copy of `key` is gone but another tier still holds the block (e.g. DRAM eviction
        of a block already demoted to SSD: the end of a move down)."""

    def removed(self, key: bytes, tier: str, reason: str) -> None:
        """The block left the cache: `tier` held its last copy. `reason` is one of `REASONS`."""

    def cleared(self) -> None:
        """Every block was removed (`TieredCache.clear`)."""

    def replayed(self, holdings: Holdings) -> bool:
        """`add_listener(replay=True)`: True if this listener takes the blocks held as one snapshot,
        to tell itself of later, off the cache's lock; False (the default) to be told of each block
        there and then, under the lock (a million blocks: about a second in which the cache waits)."""
        return False


class Holdings:
    """The blocks a cache holds at one moment, to be told to a listener later (`replayed`): copies of
    the DRAM tier's keys and the SSD tier's, taken under the cache's lock (a million keys: tens of
    milliseconds)."""

    def __init__(self, dram: Mapping[bytes, object], ssd: Iterable[bytes]) -> None:
        self._dram = dict(dram)
        self._ssd = list(ssd)

    def __iter__(self) -> Iterator[tuple[str, bytes, str]]:
        """(kind, key, tier) of each: `stored` in DRAM, then `stored` in SSD for an SSD-only block or
        `copied` for a block DRAM holds too."""
        for k in self._dram:
            yield "stored", k, "dram"
        dram = self._dram
        for k in self._ssd:
            yield ("copied" if k in dram else "stored"), k, "ssd"

    def on_ssd(self) -> Holdings:
        """The blocks the SSD tier holds, each as `stored` there (what outlives the process)."""
        return Holdings({}, self._ssd)

    def tell(self, listener: CacheListener) -> None:
        """Tell `listener` of each block, as `add_listener(replay=True)` does."""
        for kind, key, tier in self:
            (listener.copied if kind == "copied" else listener.stored)(key, tier)

"""What a TieredCache tells its listeners: every block that enters, moves between tiers or leaves it.

A listener is registered with `TieredCache.add_listener`. The cache calls it with its lock held, from
the thread that made the change, in the order the changes happened: a listener must be quick (append
to a queue), must not raise, and must never call the cache back. `kvpool.core.events` builds the
published block events (NATS, vLLM's ZMQ format) on this interface.
"""
from __future__ import annotations

__all__ = ["TIERS", "REASONS", "CacheListener"]

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

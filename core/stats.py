"""What a block cache reports: its counters (hits and misses per tier, movement between tiers,
failures), how full each tier is, and its pins.

`CacheCounters` is the live tally the cache increments under its lock; `CacheStats` is the snapshot
that `TieredCache.stats()` returns. Both convert to and from plain dictionaries (a worker's STATS
reply, Prometheus); `from_dict` ignores fields it does not know, so an older reader accepts a newer
worker's reply.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["CacheCounters", "CacheStats"]

_S = TypeVar("_S", bound="CacheCounters")


@dataclasses.dataclass
class CacheCounters:
    """Events counted since the cache opened (every field a count of blocks)."""

    puts: int = 0
    hits_device: int = 0
    hits_dram: int = 0
    hits_ssd: int = 0
    misses: int = 0
    evictions: int = 0
    """Blocks leaving DRAM (demoted or, without an SSD tier, dropped)."""
    demotions: int = 0
    """Blocks copied down to SSD (on their way out of DRAM, or by flush)."""
    promotions: int = 0
    ssd_evictions: int = 0
    device_evictions: int = 0
    dropped: int = 0
    """Blocks evicted from DRAM with no SSD copy though there is an SSD tier (it was full, or the block
    failed its checksum): lost to the cache."""
    checksum_failures: int = 0
    relocations: int = 0
    """Pinned blocks copied to another slab of their class so that a whole slab could be freed."""

    def as_dict(self) -> dict[str, int]:
        """Every field by name, in declaration order (the shape of a worker's STATS reply)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[_S], values: Mapping[str, Any]) -> _S:
        """The stats in `values`; fields it lacks are 0, keys this version does not know are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) for k, v in values.items() if k in known})


@dataclasses.dataclass
class CacheStats(CacheCounters):
    """A snapshot of a cache: its counters, then each tier's fill (bytes, blocks), then its pins."""

    dram_bytes: int = 0
    """Bytes of DRAM slots in use (committed blocks, reservations, and freed blocks still leased)."""
    dram_capacity: int = 0
    dram_blocks: int = 0
    dram_leases: int = 0
    """Leases held now on DRAM blocks (readers in progress; one that never ends shows here)."""
    ssd_bytes: int = 0
    """Payload bytes of the blocks indexed on SSD."""
    ssd_blocks: int = 0
    device_bytes: int = 0
    device_blocks: int = 0
    pins: int = 0
    """Keys pinned now (their blocks are kept in DRAM), those waiting for their blocks included."""
    pending_pins: int = 0
    """Pins on keys whose blocks are not (yet) in DRAM."""
    pins_refused: int = 0
    """Pins refused because `kvpool.core.pins.MAX_PENDING_PINS` were already waiting for their blocks."""

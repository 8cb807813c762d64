"""Counters of the block cache (hits and misses per tier, movement between tiers, failures)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CacheStats:
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
    """Blocks lost to a full SSD tier on demotion."""
    checksum_failures: int = 0
    relocations: int = 0
    """Pinned blocks copied to another slab of their class so that a whole slab could be freed."""

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

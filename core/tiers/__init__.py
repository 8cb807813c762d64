"""Storage tiers of the block cache: device (torch), DRAM (shared-memory arena), SSD (LMDB)."""

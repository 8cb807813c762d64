"""Storage tiers of the block cache, each its storage and its index: DRAM (`dram.DramArena`, a shared-memory
arena, indexed by `dram_tier.DramTier`), SSD (`ssd.SsdStore`, LMDB, indexed by `ssd_tier.SsdTier`) and the
device (`device.DeviceTier`, torch tensors, both in one)."""

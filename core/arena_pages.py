"""A client's mapping of a worker's arena, its page tables filled a region at a time.

A process that maps the arena takes a page fault at its first touch of each 4 KiB page of it (here a
put into fresh slots ran at half the speed of one into slots touched before). Before it first copies
into or out of a region, the client asks the kernel to map the whole region in one call
(MADV_POPULATE_WRITE / MADV_POPULATE_READ, Linux 5.14 and later): the faults are paid once per
region, in bulk. Where the kernel refuses, pages are faulted one by one at first touch, as before.
"""
from __future__ import annotations

import mmap

import numpy as np

__all__ = ["REGION_BYTES", "ArenaPages"]

REGION_BYTES = 1 << 20
"""The arena is readied in regions of this many bytes: here 1 MiB takes ~0.12 ms at once against ~0.2 ms
of faults, and a region of 16 MiB ~1.9 ms, too long a wait for the one small block that touches it first."""
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class ArenaPages:
    """The regions of one mapping (`DramArena.attach`'s view) this process has readied."""

    def __init__(self, view: memoryview, writable: bool) -> None:
        mapping = view.obj
        self._mapping = mapping if isinstance(mapping, mmap.mmap) else None
        self._size = view.nbytes
        self._advice = _POPULATE_WRITE if writable else _POPULATE_READ
        self._ready = np.zeros(-(-self._size // REGION_BYTES), dtype=bool)
        """Whether each region has been readied (by the kernel's leave, or it refused: see `_refused`)."""
        self._refused = self._mapping is None

    def ready(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Map the regions that the blocks at `offsets` (of `sizes` bytes; offsets < 0 are skipped)
        touch, where this process has not yet. Once they are, a check costs a few array operations."""
        if self._refused or not offsets.size:
            return
        low, high = int(offsets.min()), int((offsets + sizes).max())
        if low >= 0 and self._ready[low // REGION_BYTES:(high - 1) // REGION_BYTES + 1].all():
            return  # the usual batch, once warm: every region between its first and last block is ready
        firsts = np.maximum(offsets, 0) // REGION_BYTES  # (a miss asks for region 0: harmless)
        lasts = (np.maximum(offsets, 0) + np.maximum(sizes, 1) - 1) // REGION_BYTES
        done = self._ready
        if done[firsts].all() and done[lasts].all():
            return
        for first, last in zip(firsts.tolist(), lasts.tolist()):
            for region in range(first, last + 1):
                if not done[region] and not self._refused:
                    self._populate(region)

    def _populate(self, region: int) -> None:
        start = region * REGION_BYTES
        assert self._mapping is not None  # (else refused)
        try:
            self._mapping.madvise(self._advice, start, min(REGION_BYTES, self._size - start))
        except (OSError, ValueError):
            self._refused = True  # an older kernel: pages fault in at first touch
            return
        self._ready[region] = True

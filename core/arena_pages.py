"""A client's mapping of a worker's arena, its page tables filled a region at a time.

A process that maps the arena takes a page fault at its first touch of each 4 KiB page of it (here a
put into fresh slots ran at half the speed of one into slots touched before). Before it first copies
into or out of a region, the client asks the kernel to map the whole region in one call
(MADV_POPULATE_WRITE / MADV_POPULATE_READ, Linux 5.14 and later): the faults are paid once per
region, in bulk. Where the kernel refuses, pages are faulted one by one at first touch, as before.

A client's transport also readies the rest of the mapping from a thread of its own (`background=True`,
where the C extension lets the call go without the GIL): a put that lands in a region this process never
touched otherwise pays for its page tables inside the put (here 64 MiB of 1 MiB puts into fresh regions
ran at 0.47 of memcpy, the same into readied ones at 0.73). It costs that process the page tables of the
whole arena (2 MiB per GiB) and ~0.12 ms of a core per MiB, once, beside its work. Only regions whose
memory exists are readied that way (the worker prefaults its arena by default): readying the others
would allocate them.
"""
from __future__ import annotations

import mmap
import threading
from types import ModuleType

import numpy as np

from .errors import ProtocolError

__all__ = ["REGION_BYTES", "ArenaPages"]

REGION_BYTES = 1 << 20
"""The arena is readied in regions of this many bytes: here 1 MiB takes ~0.12 ms at once against ~0.2 ms
of faults, and a region of 16 MiB ~1.9 ms, too long a wait for the one small block that touches it first."""
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_native: ModuleType | None
try:
    from . import _native
except ImportError:  # without the extension madvise holds the GIL: nothing is readied in the background
    _native = None


class ArenaPages:
    """The regions of one mapping (`DramArena.attach`'s view) this process has readied."""

    def __init__(self, view: memoryview, writable: bool, background: bool = False) -> None:
        mapping = view.obj
        self._view = view
        self._mapping = mapping if isinstance(mapping, mmap.mmap) else None
        self._size = view.nbytes
        self._advice = _POPULATE_WRITE if writable else _POPULATE_READ
        self._flags = bytearray(-(-self._size // REGION_BYTES))
        """Whether each region has been readied (by the kernel's leave, or it refused: see `_refused`); as bytes
        for a put's usual test (`0 not in` a slice: ~0.1 us, against ~1.6 for numpy's), ..."""
        self._ready = np.frombuffer(self._flags, dtype=bool)
        """... and as an array (the same memory) for the rest."""
        self._refused = self._mapping is None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background and _native is not None and not self._refused:
            self._thread = threading.Thread(target=self._ready_all, name="kvpool-arena-pages", daemon=True)
            self._thread.start()

    def ready(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Map the regions that the blocks at `offsets` (of `sizes` bytes; offsets < 0 are skipped)
        touch, where this process has not yet. Once they are, a check costs one pass over the slots (a
        few array operations without the C extension).
        Every slot a worker names passes here before a byte moves: ProtocolError if one does not lie
        within the mapping."""
        if not offsets.size:
            return
        if _native is not None:  # the checks in one pass, then one test of the span (the usual batch, warm)
            try:
                span = _native.slot_span(np.ascontiguousarray(offsets, dtype="<i8"),
                                         np.ascontiguousarray(sizes, dtype="<i8"), self._size)
            except ValueError:
                raise ProtocolError(f"the worker named a slot outside its arena of {self._size} bytes") from None
            if span is None:
                return
            low, high = span
            if self._refused or (high > low and self._all_ready(low, high)):
                return
        if int(offsets.min()) < 0:  # misses among them (offset < 0): they name no slot
            kept = offsets >= 0
            offsets, sizes = offsets[kept], sizes[kept]
            if not offsets.size:
                return
        if int(sizes.min()) < 0 or bool((offsets > self._size - sizes).any()):  # (no sum that could wrap)
            raise ProtocolError(f"the worker named a slot outside its arena of {self._size} bytes")
        if self._refused:
            return
        low, high = int(offsets.min()), int((offsets + sizes).max())
        if self._all_ready(low, high):
            return  # the usual batch, once warm: every region between its first and last block is ready
        last_region = self._ready.size - 1  # (an empty slot at the arena's very end readies the last)
        firsts = np.minimum(offsets // REGION_BYTES, last_region)
        lasts = np.minimum((offsets + np.maximum(sizes, 1) - 1) // REGION_BYTES, last_region)
        done = self._ready
        if done[firsts].all() and done[lasts].all():
            return
        for first, last in zip(firsts.tolist(), lasts.tolist()):
            for region in range(first, last + 1):
                if not done[region] and not self._refused:
                    self._populate(region)

    def _all_ready(self, low: int, high: int) -> bool:
        """Whether every region that bytes `low` to `high` (past the end) touch is readied."""
        return 0 not in self._flags[low // REGION_BYTES:(high - 1) // REGION_BYTES + 1]

    def close(self) -> None:
        """Stop readying in the background (returns once the thread is gone: at most one region's call
        away). The owner calls it before it unmaps the view."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _ready_all(self) -> None:
        """The background thread's work: every region not yet readied whose memory the worker has, in
        order, until `close`. (Readying a region of a worker that does not prefault its arena would
        allocate it: such a region is left to the first block that lands in it.)"""
        assert _native is not None  # (else no thread)
        for region in range(self._ready.size):
            if self._stop.is_set() or self._refused:
                return
            if self._ready[region]:
                continue
            start = region * REGION_BYTES
            try:
                resident = _native.resident(self._view[start:min(start + REGION_BYTES, self._size)])
            except (OSError, ValueError):
                return  # (a view released under the thread: see `_populate`)
            if resident:
                self._populate(region)

    def _populate(self, region: int) -> None:
        start = region * REGION_BYTES
        stop = min(start + REGION_BYTES, self._size)
        assert self._mapping is not None  # (else refused)
        try:
            if _native is not None:
                _native.advise(self._view[start:stop], self._advice)  # (the GIL let go meanwhile)
            else:
                self._mapping.madvise(self._advice, start, stop - start)
        except (OSError, ValueError):
            self._refused = True  # an older kernel (or a view released under a thread): faults at first touch
            return
        self._ready[region] = True

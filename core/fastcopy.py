"""Block copies that hash what they write: the copy kernels of the same-node paths.

`copy_hash(dst, src)` copies `src` into `dst` (writable, of the same length) and returns the XXH3-64 of
the bytes written (`blocks.checksum`); `copy(dst, src)` only copies. Both take any C-contiguous buffers
(memoryviews of the arena, numpy arrays, bytes).

Where the C extension `kvpool.core._native` was built (`pip install -e .` builds it when a C compiler is
present; `SIMD` says which kernels it runs, "none" without it), a block of 8 KiB or more is copied in
16 KiB chunks through a buffer that stays in L1: each chunk is read once from the source, hashed there
and written with non-temporal stores, so the checksum is of exactly the bytes written (even if the
source changes meanwhile: a slot of a shared arena that another process reuses), and a copy of
megabytes neither reads its destination first nor pushes the caller's working set out of the caches.
On this project's 2-vCPU test machine (docs/BENCHMARKS.md, run AD) a 1 MiB copy and hash from memory
took 150-175 us this way against 170-205 as a copy then a hash, and a copy alone 118-123 against
memcpy's 145-160. Without the extension the results are the same, copied and hashed by Python (a slice
assignment, then xxhash). Overlapping buffers are copied as by memmove either way.
"""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from .blocks import checksum

__all__ = ["copy_hash", "copy", "SIMD"]

_native: ModuleType | None
try:
    from . import _native
except ImportError:  # no C compiler when it was installed: the same results, in two passes
    _native = None


def _copy(dst: Any, src: Any) -> None:
    memoryview(dst).cast("B")[:] = memoryview(src).cast("B")  # (sizes that differ: ValueError, as from the extension)


def _copy_hash(dst: Any, src: Any) -> int:
    _copy(dst, src)
    return checksum(memoryview(dst).cast("B"))


copy_hash: Callable[[Any, Any], int]
copy: Callable[[Any, Any], None]
if _native is not None:
    copy_hash = _native.copy_hash
    copy = _native.copy
    SIMD: str = _native.simd()
else:
    copy_hash = _copy_hash
    copy = _copy
    SIMD = "none"

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

`hash_at(buf, offsets, sizes)` is the checksum of each slot of a mapping (a worker checking what
same-node writers committed), in one call that lets go of the GIL while it hashes. `copy_from(dsts,
src, offsets, sizes)` copies a batch of slots out of a mapping into the caller's buffers (a same-node
get) in one call: no Python slice or call per block; `copy_into(dst, offsets, srcs)` is its twin for a
same-node put, each source copied into its slot and hashed as `copy_hash` does.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from .blocks import checksum
from .errors import InvalidArgument

__all__ = ["copy_hash", "copy", "copy_from", "copy_into", "hash_at", "writable_all", "SIMD"]

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


def _typed(call: Callable[..., Any], *args: Any) -> Any:
    """A call into the extension, its ValueError (a slot outside a buffer, columns of other lengths) raised
    as InvalidArgument."""
    try:
        return call(*args)
    except ValueError as e:
        raise InvalidArgument(str(e)) from e


def hash_at(buf: Any, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The XXH3-64 (`blocks.checksum`) of `buf[offsets[i]:offsets[i] + sizes[i]]` for each i, as uint64s;
    InvalidArgument for a slot outside `buf`."""
    offsets = np.ascontiguousarray(offsets, dtype="<i8")
    sizes = np.ascontiguousarray(sizes, dtype="<i8")
    out = np.empty(len(offsets), dtype="<u8")
    if _native is not None:
        _typed(_native.hash_at, out, buf, offsets, sizes)
        return out
    view = memoryview(buf).cast("B")
    for i, (off, n) in enumerate(zip(offsets.tolist(), sizes.tolist())):
        if off < 0 or n < 0 or off + n > view.nbytes:
            raise InvalidArgument("a slot outside the buffer")
        out[i] = checksum(view[off:off + n])
    return out


def copy_from(dsts: Sequence[Any], src: Any, offsets: np.ndarray, sizes: np.ndarray) -> int:
    """`dsts[i][:sizes[i]] = src[offsets[i]:offsets[i] + sizes[i]]` for each i in order, but where
    `offsets[i] < 0` (a miss: skipped). Returns -1, or the index of the first destination shorter than
    its size (the copies stop there: it and those after it are untouched). InvalidArgument for a slot
    outside `src`, or columns whose lengths differ from `dsts`'."""
    offsets = np.ascontiguousarray(offsets, dtype="<i8")
    sizes = np.ascontiguousarray(sizes, dtype="<i8")
    if _native is not None:
        return int(_typed(_native.copy_from, dsts, src, offsets, sizes))
    if not len(dsts) == len(offsets) == len(sizes):
        raise InvalidArgument("copy_from wants as many destinations as int64 offsets and int64 sizes")
    view = memoryview(src).cast("B")
    for i, (dst, off, n) in enumerate(zip(dsts, offsets.tolist(), sizes.tolist())):
        if off < 0:
            continue
        if n < 0 or off + n > view.nbytes:
            raise InvalidArgument("a slot outside the source")
        out = memoryview(dst).cast("B")
        if out.nbytes < n:
            return i
        out[:n] = view[off:off + n]
    return -1


def writable_all(buffers: Sequence[Any]) -> bool:
    """Whether `copy_from` can copy into each of `buffers` as it is (a writable C-contiguous buffer: a
    numpy array, a bytearray, a writable memoryview), asked of each in one native call; False without
    the extension (the caller then makes flat byte views first: `buffers.destination_views`)."""
    return _native is not None and _native.writable_all(buffers)


def copy_into(dst: Any, offsets: np.ndarray, srcs: Sequence[Any]) -> np.ndarray:
    """`dst[offsets[i]:offsets[i] + len(srcs[i])] = srcs[i]` for each i in order (`copy_hash`'s copy);
    the XXH3-64 of the bytes each slot got, as uint64s. InvalidArgument for a slot outside `dst` (the
    copies stop there), or as many offsets as sources not."""
    offsets = np.ascontiguousarray(offsets, dtype="<i8")
    out = np.empty(len(offsets), dtype="<u8")
    if _native is not None:
        _typed(_native.copy_into, out, dst, offsets, srcs)
        return out
    if len(srcs) != len(offsets):
        raise InvalidArgument("copy_into wants as many sources as int64 offsets and uint64 outputs")
    view = memoryview(dst).cast("B")
    for i, (off, src) in enumerate(zip(offsets.tolist(), srcs)):
        n = memoryview(src).nbytes
        if off < 0 or off + n > view.nbytes:
            raise InvalidArgument("a slot outside the destination")
        out[i] = _copy_hash(view[off:off + n], src)
    return out


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

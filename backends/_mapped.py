"""Whether an address range is host memory this process may read and write (its /proc/self/maps).

An engine hands the pool raw pointers (`HostBuffers.register`). One into GPU memory (an engine written
against Mooncake, which moves GPU memory by RDMA, registers its GPU KV allocations), into a freed or
read-only region, or a wrong number, would crash the engine with SIGSEGV at the first copy. Under
CUDA's unified addressing a device allocation lies in ranges the driver maps with no access for the
CPU, so every such pointer is one whose range some part of is not mapped readable and writable.
"""
from __future__ import annotations

_MAPS = "/proc/self/maps"


def first_inaccessible(ptr: int, size: int) -> int | None:
    """The first address of [ptr, ptr + size) not in a readable and writable mapping of this process;
    None if the whole range is (or if this system has no /proc/self/maps to tell)."""
    try:
        with open(_MAPS, "rb") as f:
            maps = f.read()
    except OSError:
        return None
    end, at = ptr + size, ptr
    for line in maps.splitlines():  # ascending, not overlapping (the kernel's order)
        span, perms = line.split(b" ", 2)[:2]
        lo_s, hi_s = span.split(b"-")
        lo, hi = int(lo_s, 16), int(hi_s, 16)
        if hi <= at:
            continue
        if lo > at or perms[:2] != b"rw":
            return at
        at = hi
        if at >= end:
            return None
    return at

"""The DRAM tier's storage: one POSIX shared-memory arena carved by a slab allocator.

The arena is created 0600 and pre-faulted once at start (first touch of fresh shared memory is ~60x
slower than a warm write here). Slabs of `slab_size` bytes are handed to size classes on demand and
returned when empty; allocating and freeing a block is pure Python bookkeeping, never a system call.
Other processes on the node map the same arena by name (`DramArena.attach`) and read blocks in place.
An arena nobody else maps (an embedded pool's) is unlinked as soon as it is mapped, so no exit, not even
kill -9, can leave it behind; a shared one that a killed owner left is swept by the next shared arena
(its creator holds a lock on it while it lives: the kernel, not a pid, says whether it does).
"""
from __future__ import annotations

import _posixshmem
import bisect
import errno
import fcntl
import mmap
import os
import secrets
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CapacityError, ConfigError, PoolUnavailable

__all__ = ["DramArena", "arena_names", "size_classes", "sweep_dead_arenas"]

_ALIGN = 64
_MIN_CLASS = 256
PHASE = 2048
"""Where in a page the slabs start: every slot of a page-multiple class starts `PHASE` bytes past a page
boundary. A copy runs at half speed here when its destination starts a few bytes past the same point
of a page as its source (4K aliasing: a 64 KiB get from a page-aligned slot into a numpy array, which
starts 16 bytes into a page, moved 4.7 GB/s against 11 into a page-aligned one). Buffers start on a
page (mmap, pinned memory), 16 bytes in (malloc'd: numpy) or 64 (torch); mid-page is far from all."""


def size_classes(slab_size: int) -> list[int]:
    """Slot sizes: four per power of two (x1, x1.25, x1.5, x1.75), so waste stays under 25%."""
    out: list[int] = []
    p = _MIN_CLASS
    while p <= slab_size:
        for num in (4, 5, 6, 7):
            c = (p * num // 4 + _ALIGN - 1) // _ALIGN * _ALIGN
            if c <= slab_size:
                out.append(c)
        p *= 2
    out.append(slab_size)  # the largest block is a whole slab, whatever its size
    return sorted(set(out))


@dataclass
class _Slab:
    cls: int
    free: list[int]  # free slot offsets (absolute)
    used: int = 0


_RUN_FREE = 8
"""Slots freed together (`DramArena.free_many`), at least as many as this and all of one slab, are freed at once."""


def arena_names(pid: int | None = None) -> set[str]:
    """Names of the arenas a process created (theirs start kvpool-<pid>-); they outlive a killed one."""
    prefix = f"kvpool-{os.getpid() if pid is None else pid}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


_YOUNG_S = 10.0
"""An unlocked arena still empty (0 bytes) and this recent is not swept: its creator locks it first and
sizes it after, so it may be between creating and locking it. Any other unlocked arena is dead."""


def sweep_dead_arenas() -> list[str]:
    """Unlink this user's kvpool arenas that no process holds any more (a kill -9'd worker's); returns
    their names. A live arena's creator holds a lock on it for as long as it lives (`DramArena`), so
    liveness is asked of the kernel, not of a pid: a pid means nothing in another pid namespace (a
    worker in a container is pid 1, sharing the node's /dev/shm). Another user's arena is never touched."""
    return [name for name in os.listdir("/dev/shm") if name.startswith("kvpool-") and _take_if_dead(name)]


def _take_if_dead(name: str) -> bool:
    """Unlink the arena `name` if it is this user's and no process holds its lock; whether it was."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except OSError:
        return False  # gone already, or not ours to open
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or (st.st_size == 0 and time.time() - st.st_ctime < _YOUNG_S):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its creator lives
        try:
            _posixshmem.shm_unlink("/" + name)
        except FileNotFoundError:
            return False  # another sweeper got there first
        return True
    finally:
        os.close(fd)


def _check_arena(fd: int, name: str, size: int) -> None:
    """An arena a same-node client may map: this user's, 0600, `size` bytes."""
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600 or st.st_size != size:
        raise PoolUnavailable(f"the arena {name!r} is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}, "
                              f"{st.st_size} bytes; this client maps only its own user's 0600 arena of {size} bytes")


class DramArena:
    """A named shared-memory arena with a size-class slab allocator.

    `alloc(n)` returns the absolute offset of a slot of at least `n` bytes, or None when no slot of
    that class and no empty slab is left (the cache then evicts). `free(offset)` returns it.
    """

    def __init__(self, size: int, slab_size: int = 16 << 20, name: str | None = None,
                 prefault: bool = True, shared: bool = True) -> None:
        """`shared=False`: no other process will `attach`, so the memory is private to this process
        (anonymous: nothing is left in /dev/shm however the process ends)."""
        if slab_size % mmap.PAGESIZE or size < slab_size:
            raise ConfigError(f"arena of {size} bytes / slab of {slab_size}: slab must be page-aligned "
                              f"({mmap.PAGESIZE} bytes) and fit", size=slab_size, limit=size)
        self.name = name or f"kvpool-{os.getpid()}-{secrets.token_hex(4)}"  # see arena_names
        self.slab_size = slab_size
        self.size = size // slab_size * slab_size
        """Bytes of slots (whole slabs); the shared object is `length` bytes, slabs from `PHASE` on."""
        self.length = self.size + PHASE
        self._lock_fd: int | None = None
        if shared:
            self._mmap, self._lock_fd = self._create_shared(name, prefault)
        else:
            # private and anonymous: nothing in /dev/shm however the process ends, and a forked child's
            # writes are its own (copy on write), never into the blocks its parent's index names
            try:
                self._mmap = mmap.mmap(-1, self.length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except OSError as e:
                raise CapacityError(f"cannot map a DRAM arena of {self.length} bytes: {e}") from e
        self._owner = shared  # the creator of a shared arena unlinks its name on close
        self.shared = shared
        """Whether other processes may map it (a worker's), or it is private to this one."""
        self.buf = np.frombuffer(self._mmap, dtype=np.uint8)
        self._view = memoryview(self._mmap)  # sliced per block: `view`
        if prefault:
            self._prefault()
        self.classes = size_classes(slab_size)
        self._free_slabs = list(range(self.size // slab_size - 1, -1, -1))
        self._slabs: dict[int, _Slab] = {}
        self._partial: list[dict[int, None]] = [{} for _ in self.classes]
        self.used_bytes = 0  # bytes in allocated slots

    def _create_shared(self, name: str | None, prefault: bool) -> tuple[mmap.mmap, int]:
        """The arena's object in /dev/shm, mapped, and its descriptor, which holds its lock (it says the
        arena is live; closed, released, with the arena: see sweep_dead_arenas)."""
        if name:
            _take_if_dead(name)  # a configured name its last owner (killed) left
        try:
            fd = _posixshmem.shm_open("/" + self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except FileExistsError:
            raise ConfigError(f"the DRAM arena name {self.name!r} is taken in /dev/shm by a live worker: give "
                              "each worker its own") from None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked before it is sized
        try:
            # Reserving the pages up front turns a too-small /dev/shm into an error here instead
            # of a SIGBUS at first touch.
            if prefault:
                os.posix_fallocate(fd, 0, self.length)
            else:
                os.ftruncate(fd, self.length)
            return mmap.mmap(fd, self.length), fd
        except OSError as e:
            os.close(fd)
            _posixshmem.shm_unlink("/" + self.name)
            raise CapacityError(f"cannot create a DRAM arena of {self.length} bytes in /dev/shm: {e}") from e

    @classmethod
    def attach(cls, name: str, size: int, writable: bool = False) -> memoryview:
        """Map another process's arena (a same-node client): read-only unless `writable` (a writer, which
        copies into slots it ALLOCs). Only an arena of this user's, mode 0600 and exactly `size` bytes,
        checked with fstat before and after mapping: a stranger's arena (which could be read, or
        shrunk under the mapping for a SIGBUS) is refused with PoolUnavailable."""
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR if writable else os.O_RDONLY, mode=0o600)
        except OSError as e:
            raise PoolUnavailable(f"cannot open the worker's arena {name!r}: {e}") from e
        try:
            _check_arena(fd, name, size)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = mmap.mmap(fd, size, prot=prot)
            try:
                _check_arena(fd, name, size)
            except BaseException:
                mapping.close()
                raise
            return memoryview(mapping)
        finally:
            os.close(fd)

    def _prefault(self) -> None:
        populate = getattr(mmap, "MADV_POPULATE_WRITE", None)
        if populate is not None:
            try:
                self._mmap.madvise(populate)
                return
            except OSError as e:
                if e.errno == errno.ENOMEM:  # touching the pages instead would bring the OOM killer
                    self.close()
                    raise CapacityError(f"no memory for a DRAM arena of {self.length} bytes: {e}") from e
        self.buf[::mmap.PAGESIZE] = 0

    @property
    def max_block(self) -> int:
        return self.slab_size

    def class_of(self, nbytes: int) -> int:
        """Index of the smallest class that holds `nbytes` (caller checks nbytes <= max_block)."""
        return bisect.bisect_left(self.classes, max(nbytes, 1))

    def slot_size(self, offset: int) -> int:
        return self.classes[self._slabs[self.slab_of(offset)].cls]

    def alloc(self, nbytes: int) -> int | None:
        return self.alloc_many((nbytes,))[0]

    def alloc_many(self, sizes: Sequence[int]) -> list[int | None]:
        """`alloc` of each size in turn, in one call (a batch's slots): an offset, or None for each
        size that found no slot. A batch of one size class (the usual one) takes its slots a slab's
        free list at a time."""
        if sizes and min(sizes) > 0 and self.class_of(min(sizes)) == self.class_of(max(sizes)):
            return self._take(self.class_of(sizes[0]), len(sizes))
        out: list[int | None] = []
        for nbytes in sizes:
            out += self._take(self.class_of(nbytes), 1)
        return out

    def _take(self, cls: int, n: int) -> list[int | None]:
        """`n` slots of class `cls`, the same ones `n` single allocations would give, in their order;
        None for each that found no room."""
        out: list[int | None] = []
        csize, partial = self.classes[cls], self._partial[cls]
        while n:
            if partial:
                slab_no = next(iter(partial))
                slab = self._slabs[slab_no]
            elif self._free_slabs:
                slab_no = self._free_slabs.pop()
                base = self._base(slab_no)
                slab = _Slab(cls, [base + i * csize for i in range(self.slab_size // csize - 1, -1, -1)])
                self._slabs[slab_no] = slab
                partial[slab_no] = None
            else:
                out += [None] * n
                break
            free = slab.free
            k = min(n, len(free))
            taken = free[-k:]
            del free[-k:]
            taken.reverse()  # a free list is popped from its end
            out += taken
            slab.used += k
            if not free:
                del partial[slab_no]
            self.used_bytes += k * csize
            n -= k
        return out

    def free(self, offset: int) -> None:
        self.free_many((offset,))

    def free_many(self, offsets: Iterable[int]) -> None:
        """`free` of each slot, in one call (a batch's replaced blocks). A batch's slots mostly lie in
        one slab (allocated together): those are freed at once (a commit of 32 blocks replaced freed
        their slots one by one in ~20 us)."""
        offs = offsets if isinstance(offsets, list) else list(offsets)
        k = len(offs)
        slab = None
        if k >= _RUN_FREE:  # (a single free, a release's, goes slot by slot at once)
            slab_no = (min(offs) - PHASE) // self.slab_size
            slab = self._slabs.get(slab_no)
        if slab is None or slab.used < k or (max(offs) - PHASE) // self.slab_size != slab_no:
            self._free_each(offs)  # (also slots freed twice: raised as one at a time does)
            return
        slab.free += offs
        slab.used -= k
        self.used_bytes -= k * self.classes[slab.cls]
        if slab.used == 0:
            self._partial[slab.cls].pop(slab_no, None)
            del self._slabs[slab_no]
            self._free_slabs.append(slab_no)
        elif len(slab.free) == k:  # (its free list was empty: it was full)
            self._partial[slab.cls][slab_no] = None

    def _free_each(self, offsets: Iterable[int]) -> None:
        """`free_many`, slot by slot."""
        slabs, partial, classes, size = self._slabs, self._partial, self.classes, self.slab_size
        for offset in offsets:
            slab_no = (offset - PHASE) // size
            slab = slabs[slab_no]
            free = slab.free
            free.append(offset)
            slab.used -= 1
            self.used_bytes -= classes[slab.cls]
            if slab.used == 0:
                partial[slab.cls].pop(slab_no, None)
                del slabs[slab_no]
                self._free_slabs.append(slab_no)
            elif len(free) == 1:
                partial[slab.cls][slab_no] = None

    def alloc_elsewhere(self, nbytes: int, slab_no: int) -> int | None:
        """A slot for `nbytes` in a partly used slab of its class other than `slab_no` (to move a block
        out of that slab), or None."""
        cls = self.class_of(nbytes)
        other = next((n for n in self._partial[cls] if n != slab_no), None)
        if other is None:
            return None
        slab = self._slabs[other]
        offset = slab.free.pop()
        slab.used += 1
        if not slab.free:
            del self._partial[cls][other]
        self.used_bytes += self.classes[cls]
        return offset

    def slab_used(self, slab_no: int) -> int:
        """How many slots of slab `slab_no` are handed out now (0: a free slab)."""
        slab = self._slabs.get(slab_no)
        return 0 if slab is None else slab.used

    def can_alloc(self, nbytes: int) -> bool:
        return bool(self._partial[self.class_of(nbytes)] or self._free_slabs)

    def slab_of(self, offset: int) -> int:
        return (offset - PHASE) // self.slab_size

    def _base(self, slab_no: int) -> int:
        """The offset of slab `slab_no`'s first slot."""
        return slab_no * self.slab_size + PHASE

    def allocated(self) -> set[int]:
        """Offsets of every slot handed out and not freed (for `check`; linear in the slots)."""
        out: set[int] = set()
        for slab_no, slab in self._slabs.items():
            csize = self.classes[slab.cls]
            base = self._base(slab_no)
            out.update(range(base, base + self.slab_size // csize * csize, csize))
            out.difference_update(slab.free)
        return out

    def check(self) -> list[str]:
        """What is wrong with the allocator's bookkeeping (empty when consistent): every slab's used
        and free slots add up to its capacity, `used_bytes` is their sum, the free-slab pool and the
        partly used slabs are what the slabs say."""
        errors: list[str] = []
        used = 0
        for slab_no, slab in self._slabs.items():
            csize = self.classes[slab.cls]
            count = self.slab_size // csize
            base = self._base(slab_no)
            if slab.used <= 0 or slab.used + len(slab.free) != count or len(set(slab.free)) != len(slab.free):
                errors.append(f"slab {slab_no}: {slab.used} used + {len(slab.free)} free slots of {csize} bytes; "
                              f"it has {count}")
            if any(not base <= f < base + count * csize or (f - base) % csize for f in slab.free):
                errors.append(f"slab {slab_no}: a free slot is not a slot of that slab")
            if (slab_no in self._partial[slab.cls]) != bool(slab.free):
                errors.append(f"slab {slab_no}: listed as partly used {slab_no in self._partial[slab.cls]}, "
                              f"{len(slab.free)} free slots")
            used += slab.used * csize
        if used != self.used_bytes:
            errors.append(f"arena used_bytes {self.used_bytes}; its slabs hold {used}")
        slabs = self.size // self.slab_size
        if set(self._free_slabs) & set(self._slabs) or len(self._free_slabs) + len(self._slabs) != slabs:
            errors.append(f"{len(self._free_slabs)} free + {len(self._slabs)} used slabs; the arena has {slabs}")
        return errors

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._view[offset:offset + nbytes]

    def close(self) -> None:
        """Unmap; the creating process also unlinks the name."""
        if self._mmap is None:
            return
        self.buf = None  # type: ignore[assignment]
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        self._mmap = None  # type: ignore[assignment]
        if self._owner:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

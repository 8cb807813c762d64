"""The SSD tier's store: blocks in an LMDB environment, `header || bytes` per key, checksummed on every read.

Writes go in batches, one transaction each. A value that fails its header or checksum is a miss: it
is deleted and counted. LMDB commits are atomic, so after a kill -9 a reopened tier serves every
committed block and none half-written. The environment is reopened after fork (pid change).
What the cache knows of the stored blocks without reading them (sizes, expiry, order) is
`ssd_tier.SsdTier`'s; this module only serializes (`blocks`) and stores.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import signal
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn, TypeVar

import lmdb

from ..auth import private_dir
from ..blocks import HEADER_SIZE, BlockMeta, CorruptBlock, decode, decode_header, encode_header
from ..errors import CapacityError, StorageError

__all__ = ["SsdStore", "walk_pages", "LOCK_FILE"]

log = logging.getLogger("kvpool.ssd")

_INHERITED = -2
"""`_lock_fd` of a store in a forked child: its parent holds the folder; the child holds nothing."""
_STORES: weakref.WeakSet[SsdStore] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    """In a forked child: let go of the parent's folder locks (a child that outlived its parent would
    otherwise keep the folder held; one that uses the store works under its parent's lock)."""
    for store in list(_STORES):
        if store._lock_fd >= 0:
            store._unlock.detach()
            os.close(store._lock_fd)
            store._lock_fd = _INHERITED


os.register_at_fork(after_in_child=_drop_inherited_locks)

LOCK_FILE = "kvpool.lock"
"""Held (flock) by the process whose store has the folder open; holds that process's pid."""

T = TypeVar("T")


class SsdStore:
    """LMDB-backed block store at `path` (a directory) with a maximum size of `map_size` bytes.

    `sync=True` makes each committed batch durable against power loss (fsync per transaction);
    with `sync=False` a committed batch survives a crash of the process, not of the machine.
    """

    def __init__(self, path: str | os.PathLike[str], map_size: int, sync: bool = True) -> None:
        self.path = Path(path)
        self.map_size = map_size
        self.sync = sync
        self.corrupt = 0
        self.commits = 0
        """Write transactions this object committed (`ssd_index` tells its own writes from others')."""
        self._pid = -1
        self._env: lmdb.Environment | None = None
        self._lock_fd = -1
        self._damage_logged = False
        _STORES.add(self)
        self._open()

    def _hold(self) -> None:
        """Take `LOCK_FILE` in the folder for this store's life (a forked child works under its parent's):
        two workers given one SSD folder would each serve, evict and overwrite the other's blocks
        behind its back (and share a worker id), so the second is refused."""
        lock = self.path / LOCK_FILE
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StorageError(f"cannot open the SSD tier at {self.path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            who = "another cache of this process" if holder == str(os.getpid()) else f"another process (pid {holder})"
            raise StorageError(f"the SSD tier at {self.path} is in use by {who}; each worker (and each "
                               "cache) needs an SSD folder of its own: close the other first") from None
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        self._unlock = weakref.finalize(self, os.close, fd)  # a store dropped unclosed lets go too
        with contextlib.suppress(OSError):  # the pid is for the message above only (a full disk: none)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _open(self) -> None:
        try:  # 0700 folder, 0600 files: blocks are readable by this user only
            private_dir(self.path, tighten=True)
        except OSError as e:  # the folder cannot be made (permissions, a file in the way)
            raise StorageError(f"cannot open the SSD tier at {self.path}: {e}") from e
        if self._lock_fd == -1:
            self._hold()
        try:
            self._env = lmdb.open(str(self.path), map_size=self.map_size, subdir=True, sync=self.sync,
                                  metasync=self.sync, readahead=False, max_readers=512, lock=True, mode=0o600)
            self._check_length(self._env)
            self._room_to_write(self._env)
            for name in ("data.mdb", "lock.mdb"):  # files an older version made 0644
                f = self.path / name
                if f.exists() and f.stat().st_uid == os.getuid() and f.stat().st_mode & 0o077:
                    f.chmod(0o600)
        except (lmdb.Error, OSError) as e:
            self.close()
            raise StorageError(f"cannot open the SSD tier at {self.path}: {e}") from e
        self._pid = os.getpid()

    def _check_length(self, env: lmdb.Environment) -> None:
        """StorageError if the data file is shorter than the pages its meta page says are in use (a copy
        cut short, a truncated file): LMDB would map them anyway, and the first touch of one past the
        end kills the process (SIGBUS), at every start."""
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        have = (self.path / "data.mdb").stat().st_size
        if have < need:
            raise StorageError(f"it is damaged: data.mdb is {have} bytes where its meta page needs {need}; move "
                               "the folder aside (its blocks are lost) and start again")

    def _room_to_write(self, env: lmdb.Environment) -> None:
        """Map past the pages in use (a tier written with a larger `map_size`), with a quarter of the
        configured map to spare: LMDB maps the whole file anyway, but with no page of the map free it
        writes nothing again, not even a delete, so the tier could never trim back under `map_size`
        (its capacity stays the configured one: the first write trims it)."""
        used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        if used > self.map_size:
            env.set_mapsize(used + self.map_size // 4)
            log.warning("SSD tier at %s: %d MiB in use where map_size is %d MiB (a smaller map than it was "
                        "written with): mapped past them, and trimmed back to the map's capacity as it is written",
                        self.path, used >> 20, self.map_size >> 20)

    @property
    def env(self) -> lmdb.Environment:
        if self._pid != os.getpid():
            # An inherited LMDB handle must not be used in a forked child, and lmdb refuses a second
            # open of files this process still has open: close the child's copy (which releases only
            # the child's own locks and reader slots), then reopen.
            if self._env is not None:
                self._env.close()
            self._open()
        if self._env is None:
            raise StorageError(f"SSD tier at {self.path} is closed")
        return self._env

    def scan(self) -> Iterator[tuple[bytes, BlockMeta]]:
        """(key, meta) of every stored block, read from headers only (payloads are not verified).

        A value whose header is corrupt is skipped, counted and (once the scan is done) deleted."""
        bad = []
        with self.env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                try:
                    meta = decode_header(value)
                except CorruptBlock:
                    bad.append(bytes(key))
                    continue
                yield bytes(key), meta
        if bad:
            self.corrupt += len(bad)
            self._delete_corrupt(bad)

    def batch_put(self, items: Iterable[tuple[bytes, BlockMeta, memoryview]]) -> int:
        """Write blocks in one transaction; return bytes written. Raises CapacityError when full.

        Nothing of a failed batch is written (the transaction aborts as a whole).
        """
        written = 0
        staging = bytearray()
        with self._write() as txn:
            for key, meta, data in items:
                n = HEADER_SIZE + meta.size
                if len(staging) < n:
                    staging = bytearray(n)
                staging[:HEADER_SIZE] = encode_header(meta)
                staging[HEADER_SIZE:n] = data
                txn.put(key, memoryview(staging)[:n])
                written += meta.size
        return written

    @contextmanager
    def _write(self) -> Iterator[lmdb.Transaction]:
        """A write transaction, with LMDB's failures translated here, in one place. A transaction that
        fails writes nothing. A full map, and a failed write (LMDB reports the short write of a full
        disk or an exceeded quota as EIO), are CapacityError: the caller drops what it wanted stored."""
        try:
            with self.env.begin(write=True) as txn:
                yield txn
            self.commits += 1
        except lmdb.MapFullError as e:
            raise CapacityError(f"SSD tier at {self.path} is full (map_size {self.map_size} bytes)",
                                limit=self.map_size) from e
        except lmdb.Error as e:
            raise CapacityError(f"SSD tier at {self.path} could not write: {e} (disk full or over quota?)") from e

    def read(self, key: bytes, sink: Callable[[BlockMeta, memoryview], T]) -> T | None:
        """Call `sink(meta, payload)` with a verified zero-copy view of the block; None on a miss.

        The view is valid only inside `sink`. A corrupt value is deleted, counted, and is a miss.
        """
        try:
            with self.env.begin(buffers=True) as txn:
                value = txn.get(key)
                if value is None:
                    return None
                try:
                    meta, payload = decode(value)
                except CorruptBlock:
                    pass
                else:
                    return sink(meta, payload)
        except lmdb.Error as e:  # LMDB's own pages damaged: a miss, counted; deleting could make it worse
            self.corrupt += 1
            (log.debug if self._damage_logged else log.warning)(
                "SSD tier at %s: reading %r failed (%s: %s); a miss. Its LMDB file is damaged: move the folder "
                "aside to start clean%s", self.path, key[:24], type(e).__name__, e,
                "" if self._damage_logged else " (logged once)")
            self._damage_logged = True
            return None
        self.corrupt += 1
        self._delete_corrupt([key])
        return None

    def _delete_corrupt(self, keys: list[bytes]) -> None:
        """Delete corrupt values if the disk lets us; a later read or scan finds them corrupt again."""
        try:
            self.delete(keys)
        except CapacityError:
            pass

    def contains(self, key: bytes) -> bool:
        with self.env.begin(buffers=True) as txn:
            return txn.get(key) is not None

    def delete(self, keys: Iterable[bytes]) -> None:
        """Delete blocks; CapacityError if the disk cannot take even that (deletes write pages too)."""
        with self._write() as txn:
            for key in keys:
                txn.delete(key)

    def clear(self) -> None:
        with self._write() as txn:
            txn.drop(self.env.open_db(txn=txn), delete=False)

    def data_file(self) -> Path:
        return self.path / "data.mdb"

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            self._env.close()
        self._env = None
        if self._lock_fd >= 0:
            self._unlock()
        self._lock_fd = -1


WALK_QUIET_S = 120.0
"""How long `walk_pages` waits for its child's next sign of progress (every `_WALK_STEP` entries)."""
_WALK_STEP = 1 << 16


def walk_pages(store: SsdStore) -> None:
    """Walk every branch and leaf page of `store`'s B-tree in a forked child; StorageError if the child
    does not come through. LMDB meets a damaged page with an assertion (SIGABRT) or a fault (SIGBUS),
    not an error, so a scan of a damaged tier in this process would kill it, at every start. The walk
    reads no block's bytes (overflow pages), only what leads to them: 0.3-0.4 s per million blocks. The
    child reports progress on a pipe, and its end (never through `waitpid`, which a process ignoring
    SIGCHLD cannot use); a walk past the entries LMDB counts is a loop in damaged pages. Where no
    child can be made (no memory for a fork), the scan goes ahead unwalked, logged."""
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        os.close(read_end)
        os.close(write_end)
        log.warning("SSD tier at %s: no child to walk its pages first (%s); scanning in this process", store.path, e)
        return
    if pid == 0:  # pragma: no cover (the child)
        os.close(read_end)
        _walk(store, write_end)
    os.close(write_end)
    try:
        verdict = _walk_verdict(read_end)
    finally:
        os.close(read_end)
        with contextlib.suppress(OSError):  # (gone already, or reaped by whoever ignores SIGCHLD)
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    if verdict:
        raise StorageError(f"the SSD tier at {store.path} is damaged ({verdict}): move the folder aside to start "
                           "with an empty tier")


def _walk_verdict(fd: int) -> str:
    """What the walk's pipe says: empty if the walk ended well, else what went wrong. (`poll`, not
    `select`: a process with a thousand files open has pipes numbered past select's FD_SETSIZE.)"""
    waiting = select.poll()
    waiting.register(fd, select.POLLIN)
    while True:
        if not waiting.poll(WALK_QUIET_S * 1000):
            return f"a walk of its pages made no progress in {WALK_QUIET_S:.0f} s"
        got = os.read(fd, 4096)
        if not got:
            return "a walk of its pages died (an LMDB assertion or fault)"
        if b"L" in got:
            return "a walk of its pages went past the entries LMDB counts"
        if b"E" in got:
            return "a walk of its pages met an LMDB error"
        if b"K" in got:
            return ""


def _walk(store: SsdStore, fd: int) -> NoReturn:  # pragma: no cover (a forked child)
    """`walk_pages`' child: no logging, no import, no lock another thread may have held at the fork. It
    writes "." every `_WALK_STEP` entries, then "K" (done), "E" (an LMDB error) or "L" (a loop)."""
    code = b"E"
    try:
        if store._env is not None:
            store._env.close()  # (the child's copy; LMDB refuses a second open of files still open)
        env = lmdb.open(str(store.path), readonly=True, subdir=True, lock=True, readahead=False)
        with env.begin() as txn:
            bound = int(env.stat()["entries"]) + 1
            for n, _ in enumerate(txn.cursor().iternext(keys=True, values=False), 1):
                if n % _WALK_STEP == 0:
                    os.write(fd, b".")
                if n > bound:
                    code = b"L"
                    break
            else:
                code = b"K"
    finally:
        with contextlib.suppress(OSError):
            os.write(fd, code)
        os._exit(0)

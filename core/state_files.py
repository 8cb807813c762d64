"""What a worker keeps on disk about itself: its id, its alive stamp, and the sweep of files that
workers no longer running left in the state dir.

A worker with an SSD tier keeps its id (and its alive and held-since stamps) beside that tier, since
the id follows the blocks; one without holds nothing after a restart, so it takes a new id each start
and leaves no file, but for a cluster worker with a configured id (one alive stamp per name). Each start
removes the per-port files dead workers (of this and older releases) left in the state dir.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .auth import private_dir, write_private
from .catch_up import AliveStamp
from .config import WORKER_ID, CacheConfig, default_state_dir
from .errors import StorageError

__all__ = ["binding", "id_file", "named_alive_stamp", "sweep_dead_workers", "stored_worker_id"]

log = logging.getLogger("kvpool.worker")


def id_file(cache: CacheConfig) -> Path | None:
    """Where a worker keeps its id, and its alive and held-since stamps beside it: by its SSD tier (the id
    follows the blocks). None without one: a restart holds no block, so no id needs to outlive the
    worker; it takes a new one each start (unless configured) and leaves no file behind."""
    return Path(cache.ssd_path) / "kvpool-worker-id" if cache.ssd_path else None


def named_alive_stamp(worker_id: str) -> AliveStamp:
    """The alive stamp of a cluster worker without an SSD tier whose id is configured (`--worker-id`): a
    restart under that id must not vouch for what its last run accepted (`kvpool.core.catch_up`), so it
    is kept in the state dir by id: one small file per name ever configured (a hash for a name unfit
    for a file), where per-port files grew with every start on a new port."""
    fit = re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", worker_id)
    name = worker_id if fit else hashlib.sha256(worker_id.encode()).hexdigest()[:32]
    folder = default_state_dir()
    private_dir(folder, tighten=True)
    return AliveStamp(folder / f"worker-id-{name}.alive")


_PORT_FILE = re.compile(r"worker-(\d+)\.(?:sock|id|alive|held)")
"""What a worker without an SSD tier leaves in the state dir by its TCP port: its Unix socket (after a
kill -9), and, from releases that kept them there, its id and alive and held-since stamps."""


@contextmanager
def binding(folder: Path, wait_s: float = 5.0) -> Iterator[None]:
    """Held (a lock on a file in `folder`, the state dir) while a worker puts its Unix socket there and
    while a start sweeps the folder: a sweep never removes a socket a worker bound after the sweep looked
    at it. Only this user's processes can hold it (the folder is private); one that holds it longer than
    `wait_s` (stopped in a debugger) is waited for no longer: the caller goes on without it, as before."""
    fd = os.open(folder / ".kvpool-bind.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("%s is held for over %.0f s: going on without it", folder / ".kvpool-bind.lock",
                                wait_s)
                    break
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # (lets go of the lock)


def sweep_dead_workers(folder: Path) -> int:
    """Remove from `folder` (the state dir) the per-port files of workers that no longer run; returns how
    many. A port's files are a live worker's while something listens on the port (in this network
    namespace) or its Unix socket there answers (a worker in another namespace sharing the folder); if
    neither can be told, they are kept. A worker with an SSD tier keeps its files beside it, never here."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    by_port: dict[int, list[str]] = {}
    for name in names:
        m = _PORT_FILE.fullmatch(name)
        if m:
            by_port.setdefault(int(m.group(1)), []).append(name)
    if not by_port:
        return 0
    try:
        with binding(folder):
            return _sweep(folder, by_port)
    except OSError as e:  # (a folder this user cannot write: nothing could be removed from it either)
        log.debug("%s not swept: %s", folder, e)
        return 0


def _sweep(folder: Path, by_port: dict[int, list[str]]) -> int:
    listening = _listening_ports()
    swept = 0
    for port, files in by_port.items():
        if listening is not None and port in listening:
            continue
        answers = _unix_answers(folder / f"worker-{port}.sock")
        if answers or (answers is None and listening is None):
            continue
        if answers is False:  # it may be one a worker starts right now: that one listens on its TCP port first
            again = _listening_ports()
            if again is None or port in again:
                continue
        for name in files:
            try:
                os.unlink(folder / name)
                swept += 1
            except OSError as e:  # gone already (another start swept it), or not ours to remove
                log.debug("%s not removed: %s", folder / name, e)
    return swept


def _listening_ports() -> set[int] | None:
    """The TCP ports something listens on in this network namespace (the kernel's tables); None where
    they cannot be read (not Linux)."""
    ports: set[int] = set()
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:  # no IPv6, or no /proc
            continue
        read = True
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN; fields[1] is address:port in hex
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports if read else None


def _unix_answers(path: Path) -> bool | None:
    """Whether a process listens on the Unix socket at `path` (a full backlog, or any doubt, counts as
    yes); None if there is nothing at `path`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)  # a live worker's full backlog must not hold up this start
    try:
        sock.connect(str(path))
    except FileNotFoundError:
        return None
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    finally:
        sock.close()
    return True


def stored_worker_id(path: Path) -> str:
    """The id saved at `path`, or a new random one saved there: a restart on the same state keeps its
    id, so placement sends it the keys its SSD tier holds."""
    try:  # (never blocking: a FIFO planted as the id file would hold the start up for ever)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            raw = f.read(4096).strip() if regular else b""
    except FileNotFoundError:
        pass
    except OSError as e:  # a file where the folder should be, a link planted as the id file, a folder
        raise StorageError(f"cannot read the worker id at {path}: {e.strerror or e}") from e
    else:
        if not regular:
            raise StorageError(f"the worker id file {path} is not a regular file: remove it to start under a new "
                               "id (the SSD tier's blocks are kept)")
        if raw:
            wid = raw.decode("ascii", errors="replace")
            if not WORKER_ID.fullmatch(wid):  # a flipped bit, a torn write: not an id NATS would take
                raise StorageError(f"the worker id file {path} is damaged ({raw[:40]!r}): delete it to start "
                                   "under a new id (the SSD tier's blocks are kept)")
            return wid
    wid = secrets.token_hex(4)
    try:
        private_dir(path.parent, tighten=path.parent == default_state_dir())
        write_private(path, wid + "\n", durable=True)
    except OSError as e:  # a read-only or full disk, a file where the folder should be
        raise StorageError(f"cannot save the worker id at {path}: {e.strerror or e}") from e
    return wid

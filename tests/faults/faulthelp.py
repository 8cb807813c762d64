"""Helpers of the fault suite (a plain module, so tests and child scripts can import it).

Blocks describe themselves (key, version and size are in their first bytes; the rest derives from
them), so a reader can tell a right block from a wrong one without remembering what was put, and a
check never depends on the timing of a fault.
"""
from __future__ import annotations

import struct
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvpool.core import KVPoolError, PoolUnavailable
from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

_HEAD = struct.Struct("<QQQ")  # key hash, version, size


def block(key: str, size: int, version: int = 0) -> bytes:
    """Bytes of `key`'s block number `version`: self-describing, non-periodic."""
    kh = xxhash.xxh3_64_intdigest(key.encode())
    body = np.random.default_rng([kh, version, size]).bytes(max(0, size - _HEAD.size))
    return (_HEAD.pack(kh, version, size) + body)[:size]


def is_block_of(key: str, data: bytes | memoryview, version: int = 0, unsure: Iterable[int] = ()) -> bool:
    """Whether `data` is exactly `key`'s block number `version` (the newest put that succeeded), or one
    of `unsure` (puts after it that failed: each may or may not have been stored). An older version
    is a stale read, and is not accepted."""
    allowed = {version, *unsure}
    if len(data) < _HEAD.size:
        return any(bytes(data) == block(key, len(data), v) for v in allowed)
    _, got, size = _HEAD.unpack_from(data)
    return got in allowed and size == len(data) and bytes(data) == block(key, size, got)


def poll(predicate: Callable[[], bool], timeout: float, every: float = 0.05) -> bool:
    """Wait until `predicate()` holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def wait_members(client: PoolClient, n: int, timeout: float = 15.0) -> None:
    assert client.wait_for_members(lambda m: len(m) == n, timeout), \
        f"members: {sorted(client.members())}"


def worker_id(w: WorkerProcess) -> str:
    """The id a running worker registered under (from its HELLO)."""
    with PoolClient(mode="local", worker=w.address, timeout_s=5) as c:
        return str(next(iter(c.members())))


def heap_bytes(pid: int) -> int:
    """Anonymous resident memory of a process (a worker's arena is shared memory and does not count)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


@contextmanager
def bounded(seconds: float, what: str) -> Iterator[None]:
    """Fail if the body takes longer than `seconds` (it must not hang past its bound)."""
    t0 = time.monotonic()
    yield
    took = time.monotonic() - t0
    assert took <= seconds, f"{what} took {took:.1f} s; its bound is {seconds} s"


@dataclass
class LoadReport:
    """What a Load saw: committed keys, typed errors, wrong bytes (must stay empty), slowest op."""

    committed: dict[str, int] = field(default_factory=dict)  # key -> size
    versions: dict[str, int] = field(default_factory=dict)  # key -> newest version put that succeeded (if rewritten)
    unsure: dict[str, set[int]] = field(default_factory=dict)  # key -> later versions whose put failed
    failed_puts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    ops: int = 0
    slowest_s: float = 0.0


class Load:
    """Mixed load from one client in a thread: put a batch of new keys (or, a `rewrite` fraction of
    the time, new versions of committed ones), read back a random batch of committed ones, repeat.
    A read must be a hit with the bytes of the newest version put (or of a later one whose put failed),
    or a miss; an operation must return within `bound_s` and fail, if at all, with a typed KVPoolError."""

    def __init__(self, client: PoolClient, prefix: str, *, batch: int = 16, size: int = 64 << 10,
                 bound_s: float = 8.0, seed: int = 0, rewrite: float = 0.0) -> None:
        self.client, self.prefix, self.batch, self.size, self.bound_s = client, prefix, batch, size, bound_s
        self.rewrite = rewrite
        self.report = LoadReport()
        self.putting = threading.Event()  # set while a batch put is in flight
        self.getting = threading.Event()
        self._stop = threading.Event()
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"load-{prefix}", daemon=True)
        self._n = 0

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadReport:
        self._stop.set()
        self._thread.join(self.bound_s * 3)
        assert not self._thread.is_alive(), "the load thread hangs"
        return self.report

    def ops_done(self) -> int:
        with self._lock:
            return self.report.ops

    def wait_ops(self, n: int, timeout: float = 30.0) -> None:
        target = self.ops_done() + n
        assert poll(lambda: self.ops_done() >= target, timeout), f"load stalled at {self.ops_done()} ops"

    def _timed(self, what: str, flag: threading.Event, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` with `flag` set meanwhile; a KVPoolError is recorded and returned, not raised."""
        flag.set()
        t0 = time.monotonic()
        try:
            return fn(*args)
        except KVPoolError as e:
            with self._lock:
                kind = f"PoolUnavailable ({type(e).__name__})" if isinstance(e, PoolUnavailable) else type(e).__name__
                self.report.errors.append(f"{what}: {kind}: {e}")
            return e
        finally:
            took = time.monotonic() - t0
            flag.clear()
            with self._lock:
                self.report.ops += 1
                self.report.slowest_s = max(self.report.slowest_s, took)

    def _run(self) -> None:
        r = self.report
        tried: dict[str, int] = {}  # key -> last version put, whether or not it succeeded
        while not self._stop.is_set():
            if r.committed and self._rng.random() < self.rewrite:
                pool = list(r.committed)
                keys = list({pool[i] for i in self._rng.integers(0, len(pool), self.batch)})
                for k in keys:
                    tried[k] = tried.get(k, 0) + 1
            else:
                keys = [f"{self.prefix}-{self._n + i}" for i in range(self.batch)]
                self._n += self.batch
            blocks = [block(k, self.size, tried.get(k, 0)) for k in keys]
            out = self._timed("put", self.putting, self.client.batch_put, keys, blocks)
            with self._lock:
                if isinstance(out, KVPoolError):
                    r.failed_puts.extend(keys)
                    for k in keys:
                        if k in r.committed:
                            r.unsure.setdefault(k, set()).add(tried.get(k, 0))
                else:
                    r.committed.update((k, self.size) for k in keys)
                    for k in keys:
                        if tried.get(k, 0):
                            r.versions[k] = tried[k]
                        r.unsure.pop(k, None)
                pool = list(r.committed)
            if not pool:
                continue
            pick = [pool[i] for i in self._rng.integers(0, len(pool), self.batch)]
            bufs = [bytearray(self.size) for _ in pick]
            sizes = self._timed("get", self.getting, self.client.batch_get_into, pick, bufs)
            if isinstance(sizes, KVPoolError):
                continue
            with self._lock:
                for k, n, b in zip(pick, sizes, bufs):
                    if n < 0:
                        r.misses += 1
                    elif is_block_of(k, memoryview(b)[:n], r.versions.get(k, 0), r.unsure.get(k, ())):
                        r.hits += 1
                    else:
                        r.wrong.append(k)


def read_all(client: PoolClient, keys: dict[str, int], chunk: int = 64, versions: dict[str, int] | None = None,
             unsure: dict[str, set[int]] | None = None) -> tuple[list[str], list[str]]:
    """Read every key back: (hits, misses). Asserts that each hit is the newest version put (`versions`,
    default 0), or one of `unsure` (later puts that failed)."""
    versions = versions or {}
    unsure = unsure or {}
    hits: list[str] = []
    misses: list[str] = []
    items = list(keys.items())
    for i in range(0, len(items), chunk):
        part = items[i:i + chunk]
        bufs = [bytearray(n) for _, n in part]
        sizes = client.batch_get_into([k for k, _ in part], bufs)
        for (k, n), got, b in zip(part, sizes, bufs):
            if got < 0:
                misses.append(k)
            else:
                assert got == n and is_block_of(k, b, versions.get(k, 0), unsure.get(k, ())), \
                    f"wrong or outdated bytes for {k}"
                hits.append(k)
    return hits, misses


def metric(port: int, series: str) -> float:
    """The value of `series` (a name, with its labels if any: `kvpool_catch_ups_total{cause="stall"}`) on
    the worker's metrics port, summed over its lines; 0 if it has none yet."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(series + " "))


def inproc_worker(tmp_path: Any, **cache: object) -> Any:
    """A started worker in this process (no token: `no_auth`), its Unix socket in `tmp_path`, its cache of
    `cache`'s options (unprefaulted); the caller stops it."""
    from kvpool.core.config import CacheConfig, WorkerConfig
    from kvpool.core.server import Worker

    return Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), no_auth=True),  # type: ignore[arg-type]
                  CacheConfig(prefault=False, **cache)).start()  # type: ignore[arg-type]


SMALL_DRAM = {"KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "0"}
"""A worker's environment for a small arena (`dram_bytes="4MiB"`) of 1 MiB slabs, unprefaulted."""


def fill_then_full_disk(w: WorkerProcess, keys: list[str], size: int = 64 << 10) -> list[str]:
    """Put `keys[:120]` through `w`'s small arena (most reach its SSD tier), make its disk full (a file
    quota at data.mdb's size: LMDB can take no page more), put the rest; the first 120 still held."""
    import resource

    with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
        for i in range(0, 120, 20):  # 7.5 MiB through a 4 MiB arena: most go to SSD
            c.batch_put(keys[i:i + 20], [block(k, size) for k in keys[i:i + 20]])
        time.sleep(0.5)  # (the demoter's last batch)
        full = (w.state_dir / "ssd" / "data.mdb").stat().st_size
        resource.prlimit(w.proc.pid, resource.RLIMIT_FSIZE, (full, full))  # the disk is full from here
        for i in range(120, len(keys), 20):
            c.batch_put(keys[i:i + 20], [block(k, size) for k in keys[i:i + 20]])
        return [k for k in keys[:120] if c.exists(k)]

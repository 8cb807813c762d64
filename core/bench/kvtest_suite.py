"""Kvtest: openYuanrong kvtest's benchmark mode: set/get on the local worker and across nodes.

Each test mode runs for every data size: `set_local` / `get_local` talk to this node's worker through
shared memory, `set_cross_node` / `get_cross_node` to the other node's worker over TCP; a get mode
first stores its keys (untimed) where it will read them, then reads random ones and checks every
block's bytes. `--threads` clients run at once, held to `--target-qps` calls per second; a call moves
`--batch-size` keys. The two workers are started here (node ids kvtest-a, kvtest-b) unless a kvtest
instance config names them: `listen_port` is this node's worker (started with `rocksdb_store_dir`
as its SSD tier if none serves there) and `remote_worker` the other node's, which must be running.
Ratios: each mode's GB/s against numpy copies of the same blocks. `--csv` writes kvtest's rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..client import PoolClient
from ..config import parse_size
from ..errors import ConfigError, PoolUnavailable
from ..procs import WorkerProcess
from . import cache_options, kvtest_csv
from .content import BlockContent, memcpy_gbps
from .kvtest_instance import check_listen_port
from .measure import emit, gbps
from .pacing import Pacer

__all__ = ["MODES", "KvtestOptions", "add_arguments", "resolve", "run"]

log = logging.getLogger("kvpool.bench")

MODES = ("set_local", "get_local", "set_cross_node", "get_cross_node")
_KEYS_PER_GET_MODE = 256
"""Distinct keys a get mode stores first and then reads at random."""


@dataclasses.dataclass
class KvtestOptions:
    modes: list[str]
    sizes: list[int]
    threads: int = 1
    target_qps: float = 0.0
    batch_size: int = 1
    ops: int = 200
    """calls per (mode, size), over all threads"""
    listen_port: int | None = None
    store_dir: str | None = None
    remote_worker: str | None = None
    csv: str | None = None

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"test_mode {', '.join(bad) or 'empty'}: kvpool bench kvtest runs {', '.join(MODES)}")
        if self.threads < 1 or self.batch_size < 1 or self.ops < 1 or self.target_qps < 0:
            raise ConfigError(f"num_threads {self.threads}, batch_keys_count {self.batch_size} and ops {self.ops} "
                              f"must be >= 1, target_qps {self.target_qps} >= 0")
        if (self.listen_port is None) != (self.remote_worker is None):
            raise ConfigError("listen_port and remote_worker name this node's and the other node's worker: give both")
        if self.listen_port is not None:
            check_listen_port(self.listen_port)
        if not self.sizes or min(self.sizes) < cache_options.MIN_BLOCK:
            raise ConfigError(f"data_sizes {self.sizes}: every size must be >= {cache_options.MIN_BLOCK} bytes")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--test-mode", help=f"comma-separated modes (default all: {','.join(MODES)})")
    p.add_argument("--data-sizes", help="comma-separated block sizes, e.g. 64KiB,1MiB (64KiB,1MiB; --quick 64KiB)")
    p.add_argument("--threads", type=int, help="clients at once (1)")
    p.add_argument("--target-qps", type=float, help="calls per second over all threads (0 = unlimited)")
    p.add_argument("--batch-size", type=int, help="keys per call (1)")
    p.add_argument("--ops", type=int, help="calls per mode and size (200; --quick 100)")
    p.add_argument("--csv", metavar="FILE", help="also write kvtest's CSV rows to FILE")
    p.add_argument("--config", action="append", help="kvtest JSON files (test_mode, data_sizes, num_threads, "
                   "target_qps, batch_keys_count, listen_port, rocksdb_store_dir, remote_worker, ...)")


def _modes(value: Any) -> list[str]:
    if not isinstance(value, (str, list)):
        raise ConfigError(f"test_mode {value!r}: give a mode or a list of modes ({', '.join(MODES)})")
    return [str(m).strip() for m in (value.split(",") if isinstance(value, str) else value) if str(m).strip()]


_SHARED = {"data_sizes": "sizes", "threads": "threads", "target_qps": "target_qps", "batch_size": "batch_size",
           "ops": "ops", "listen_port": "listen_port", "store_dir": "store_dir", "remote_worker": "remote_worker"}
"""cache_options' names of the kvtest keys this mode uses -> KvtestOptions fields"""
_CACHE_ONLY = ("key_pool_size", "hit_rate", "inference_delay_ms", "namespace", "cluster")


def resolve(args: argparse.Namespace) -> KvtestOptions:
    """Defaults < kvtest config files (kvtest's key names; `test_mode` one mode or a list) < flags."""
    values: dict[str, Any] = {"modes": list(MODES), "sizes": [64 << 10] if args.quick else [64 << 10, 1 << 20],
                              "ops": 100 if args.quick else 200}
    for path in args.config or []:
        raw = cache_options.read_kvtest(path)
        if "test_mode" in raw:
            values["modes"] = _modes(raw.pop("test_mode"))
        if raw.get("mode", "benchmark") != "benchmark" or "pipeline" in raw:
            raise ConfigError(f"config {path!r}: mode {raw.get('mode')!r} / pipeline are kvtest's cache mode "
                              "(kvpool bench cache); kvpool bench kvtest runs mode 'benchmark'")
        raw.pop("mode", None)
        cfg = cache_options.from_kvtest(path, raw)
        cache_only = sorted(k for k in cfg if k in _CACHE_ONLY or k == "role")
        if cache_only:
            raise ConfigError(f"config {path!r}: {', '.join(cache_only)} belong to cache mode (kvpool bench cache)")
        if "duration" in cfg:
            raise ConfigError(f"config {path!r}: kvpool bench kvtest runs a number of calls per mode: give ops, "
                              "not duration")
        if "block_size" in cfg:
            values["sizes"] = [cfg.pop("block_size")]
        values.update({_SHARED[k]: v for k, v in cfg.items() if k in _SHARED})
    if args.test_mode:
        values["modes"] = _modes(args.test_mode)
    if args.data_sizes:
        values["sizes"] = [parse_size(s) for s in args.data_sizes.split(",")]
    for flag in ("threads", "target_qps", "batch_size", "ops", "csv"):
        if getattr(args, flag) is not None:
            values[flag] = getattr(args, flag)
    return KvtestOptions(**values)


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@contextmanager
def _workers(opts: KvtestOptions, block: int) -> Iterator[tuple[str, str]]:
    """(this node's worker as a Unix socket path, the other node's as host:port)."""
    with ExitStack() as stack:
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-kvtest-")))
        dram = str(max(256 << 20, 4 * _KEYS_PER_GET_MODE * block))
        if opts.remote_worker is None:
            local = WorkerProcess(state / "a", dram_bytes=dram, node_id="kvtest-a")
            stack.callback(local.stop)
            remote = WorkerProcess(state / "b", dram_bytes=dram, node_id="kvtest-b")
            stack.callback(remote.stop)
            yield local.wait_ready().unix_path, remote.wait_ready().address
            return
        assert opts.listen_port is not None
        host, _, port = opts.remote_worker.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
        except (OSError, ValueError) as e:
            raise PoolUnavailable(f"remote_worker {opts.remote_worker} does not answer ({e}): start the other "
                                  "node's worker first") from e
        if not _answers(opts.listen_port):
            extra = (["--ssd-path", str(Path(opts.store_dir).resolve()), "--ssd-map-size", "4GiB"]
                     if opts.store_dir else [])
            w = WorkerProcess(state / "a", dram_bytes=dram, extra=extra, port=opts.listen_port)
            stack.callback(w.stop)
            w.wait_ready()
        with PoolClient(mode="local", worker=f"127.0.0.1:{opts.listen_port}") as probe:
            (unix,) = (info.unix for info in probe.members().values())
        yield (unix if os.path.exists(unix) else f"127.0.0.1:{opts.listen_port}"), opts.remote_worker


def _one(opts: KvtestOptions, mode: str, size: int, address: str, run: str) -> dict[str, Any]:
    """Run one mode at one size; its latencies (s), failed calls, bytes moved and seconds."""
    blocks = BlockContent([size])
    prefix = f"kvtest/{run}/{mode}/{size}/"
    keys = [f"{prefix}{i}" for i in range(_KEYS_PER_GET_MODE)]
    get = mode.startswith("get")
    if get:
        with PoolClient(mode="local", worker=address) as c:
            for i in range(0, len(keys), 16):
                c.batch_put(keys[i:i + 16], [blocks.make(k) for k in keys[i:i + 16]])
    pacer = Pacer(opts.target_qps)
    lat: list[float] = []
    failed = moved = 0
    lock = threading.Lock()
    next_call = iter(range(opts.ops))
    set_keys = iter(range(1 << 62))
    started = threading.Barrier(opts.threads + 1)  # the clock starts once every client is connected ...
    ended: list[float] = []  # ... and stops at the last call's end, before the clients close
    refused: list[Exception] = []  # why clients could not connect

    def loop(seed: int) -> None:
        nonlocal failed, moved
        rng = random.Random(seed)
        bufs = [np.empty(size, dtype=np.uint8) for _ in range(opts.batch_size)]
        with ExitStack() as stack:
            try:
                client = stack.enter_context(PoolClient(mode="local", worker=address))
                client.exists(prefix)  # connected: a first call's setup is the client's, not the mode's
            except Exception as e:  # the mode raises it (an AuthError stays one)
                refused.append(e)
                started.abort()  # the others stop at the barrier rather than wait for this one
                return
            try:
                started.wait()
            except threading.BrokenBarrierError:
                return
            while True:
                with lock:
                    if next(next_call, None) is None:
                        ended.append(time.perf_counter())
                        return
                    batch = [rng.choice(keys) if get else f"{prefix}{next(set_keys)}" for _ in range(opts.batch_size)]
                data = None if get else [blocks.make(k) for k in batch]
                pacer.wait()
                t = time.perf_counter()
                ok, sizes = True, None
                try:
                    if get:
                        sizes = client.batch_get_into(batch, bufs)
                    else:
                        client.batch_put(batch, data or [])
                except (PoolUnavailable, ConfigError):
                    ok = False
                seconds = time.perf_counter() - t  # the call's latency; the bytes are checked after it
                if sizes is not None:
                    ok = all(n == size and blocks.check(k, b, n) for k, n, b in zip(batch, sizes, bufs))
                with lock:
                    lat.append(seconds)
                    failed += not ok
                    moved += size * len(batch) if ok else 0

    threads = [threading.Thread(target=loop, args=(i,), name=f"kvtest-{mode}-{i}") for i in range(opts.threads)]
    for t in threads:
        t.start()
    try:
        started.wait()
    except threading.BrokenBarrierError:
        pass  # a client could not connect
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if refused:
        log.error("%s: %d of %d clients could not connect to %s", mode, len(refused), opts.threads, address)
        raise refused[0]
    return {"lat": lat, "failed": failed, "moved": moved, "seconds": max(ended, default=time.perf_counter()) - t0}


def _label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 and size % (1 << 20) == 0 else f"{size >> 10}KiB" \
        if size % 1024 == 0 else f"{size}B"


def run(args: argparse.Namespace) -> int:
    opts = resolve(args)
    if opts.csv:
        kvtest_csv.check_writable(opts.csv)
    run_id = os.urandom(4).hex()
    metrics: dict[str, Any] = {"threads": opts.threads, "batch_size": opts.batch_size, "ops": opts.ops,
                               "block_sizes": opts.sizes}
    if opts.target_qps:
        metrics["target_qps"] = opts.target_qps
    latencies: dict[str, list[float]] = {}
    rows: list[dict[str, object]] = []
    results: dict[tuple[str, int], dict[str, Any]] = {}
    with _workers(opts, max(opts.sizes)) as (local, remote):
        metrics["local_worker"], metrics["remote_worker"] = local, remote
        for size in opts.sizes:
            for mode in opts.modes:
                r = _one(opts, mode, size, local if mode.endswith("_local") else remote, run_id)
                results[(mode, size)] = r
                name = f"{mode}_{_label(size)}"
                latencies[name] = r["lat"]
                metrics.update({f"{name}_gbps": round(gbps(r["moved"], r["seconds"]), 3),
                                f"{name}_qps": round(len(r["lat"]) / r["seconds"], 1), f"{name}_fail": r["failed"]})
                op = mode if len(opts.sizes) == 1 else name
                rows.append(kvtest_csv.row(op, r["lat"], r["failed"], r["seconds"], r["moved"]))
    size = max(opts.sizes)
    memcpy = memcpy_gbps(size, max(1, min(_KEYS_PER_GET_MODE, (64 << 20) // size)), 3)
    ratios = {f"{mode}_vs_memcpy": gbps(r["moved"], r["seconds"]) / memcpy
              for (mode, s), r in results.items() if s == size}
    failed = sum(r["failed"] for r in results.values())
    emit("kvtest", {**metrics, "failed_calls": failed}, ratios, args.json,
         notes=f"{len(opts.modes)} modes x {len(opts.sizes)} sizes, {opts.threads} threads", latencies=latencies)
    if opts.csv:
        kvtest_csv.write(opts.csv, rows)
    return 1 if failed else 0

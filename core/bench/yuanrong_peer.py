"""openYuanrong datasystem (the seed's system) as a peer: its worker on this node, its Python clients.

`Worker` starts a `datasystem_worker` exactly as `dscli start -d DIR -w --worker_address ...
--start_metastore_service true --metastore_address ...` would (dscli's own code builds the command
line), but as a child of this process: on free loopback ports, with its built-in metastore (no etcd)
and its state in a temporary folder that goes with it. `same_node` sets kvpool's same-node path
against its KVClient on the same batches, taking turns, with every method it offers per size and
with its shared-memory threshold (`oc_shm_transfer_threshold_kb`, default 500) at its default and at
0, so that small values travel through shared memory too. The package is an optional extra:
`pip install -e '.[peers]'` (openyuanrong-datasystem 0.8.1).
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import numpy as np

from ..client import PoolClient
from ..errors import BenchError
from ..nats_server import free_port
from ..procs import WorkerProcess
from .measure import best_in_turns, filled, gbps, percentiles_us
from .peer_procs import spawn, stop, tail

__all__ = ["INSTALL", "SIZES", "Worker", "available", "connect", "same_node", "size_tag"]

INSTALL = "pip install -e '.[peers]'  (openyuanrong-datasystem==0.8.1)"
_START_S = 90.0
_UDS_MAX = 107
_MSET_MAX = 500 << 10
"""KVClient.mset refuses values of 500 KiB and more (its docstring): larger ones only go by mcreate."""
SIZES = (64 << 10, 256 << 10, 1 << 20)
"""Block sizes `same_node` compares."""
_ONE_KEY_BLOCK = 64 << 10
"""Block size of the one-key get latencies."""


def available() -> bool:
    """Whether openYuanrong datasystem's Python package is importable here."""
    try:
        import yr.datasystem  # noqa: F401  (optional peer, no stubs: see pyproject)
    except ImportError:
        return False
    return True


def _datasystem() -> Any:
    try:
        import yr.datasystem as ds  # optional peer, no stubs: see pyproject
    except ImportError as e:
        raise BenchError(f"the openYuanrong peer needs the openyuanrong-datasystem package in this Python "
                         f"({e}); install it with: {INSTALL}") from e
    return ds


def size_tag(block: int) -> str:
    """`_64k`, `_256k`, `_1m`: the suffix of a block size in metric and ratio names."""
    return f"_{block >> 20}m" if block >= 1 << 20 and not block % (1 << 20) else f"_{block >> 10}k"


class Worker:
    """One openYuanrong datasystem worker on 127.0.0.1 (free ports), started and stopped by this process.

    `shm_threshold_kb`: its `oc_shm_transfer_threshold_kb` (None: its default, 500). Use as a context
    manager, or `start()` several and then `wait_ready()` each (they start in parallel)."""

    def __init__(self, *, shm_threshold_kb: int | None = None, shared_memory_mb: int = 1024) -> None:
        self.host, self.port = "127.0.0.1", 0
        self.shm_threshold_kb, self.shared_memory_mb = shm_threshold_kb, shared_memory_mb
        self.proc: subprocess.Popen[Any] | None = None
        self._dir: str | None = None
        self._log: IO[bytes] | None = None
        self._ready = ""

    def _command(self, home: str) -> list[str]:
        """The worker's command line as `dscli start -d home -w ARGS` builds it (defaults from its
        worker_config.json, paths under `home`)."""
        _datasystem()
        try:
            from yr.datasystem.cli.command import BaseCommand
            from yr.datasystem.cli.start import Command
        except ImportError as e:
            raise BenchError(f"openYuanrong's dscli is not importable ({e}); install it with: {INSTALL}") from e
        if BaseCommand.logger is None:  # else dscli logs its INFO lines to our stdout
            BaseCommand.logger = logging.getLogger("kvpool.bench.dscli")
            BaseCommand.logger.setLevel(logging.WARNING)
        self.port, metastore = free_port(), free_port()
        uds = os.path.join(home, "u")  # it adds /<8 hex>/client.sock; a Unix socket path has at most 107 bytes
        if len(uds) + len("/01234567/client.sock") > _UDS_MAX:
            raise BenchError(f"the openYuanrong worker's state folder {home} is too long a path for its Unix "
                             f"socket (at most {_UDS_MAX} bytes): set TMPDIR to a shorter folder")
        args = ["--worker_address", f"{self.host}:{self.port}", "--start_metastore_service", "true",
                "--unix_domain_socket_dir", uds,
                "--metastore_address", f"{self.host}:{metastore}",
                "--shared_memory_size_mb", str(self.shared_memory_mb),
                "--spill_directory", os.path.join(home, "spill"), "--spill_size_limit", str(1 << 30)]
        if self.shm_threshold_kb is not None:
            args += ["--oc_shm_transfer_threshold_kb", str(self.shm_threshold_kb)]
        dscli = Command()
        dscli._home_dir = home  # what `dscli start -d home` sets
        try:
            params: dict[str, str] = dscli.parse_cli_args(args)
            self._ready = params["ready_check_path"]
            command: list[str] = dscli.build_command(params, False)
        except (ValueError, KeyError, RuntimeError) as e:
            raise BenchError(f"dscli could not build the worker's command line: {e!r}") from e
        return command

    def start(self) -> Worker:
        self._dir = tempfile.mkdtemp(prefix="kvpool-yuanrong-")
        try:
            command = self._command(self._dir)
            env = dict(os.environ)
            lib = os.path.join(os.path.dirname(command[0]), "lib")
            env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
            self._log = tempfile.TemporaryFile()  # noqa: SIM115  (lives as long as the worker: stop() closes it)
            self.proc = spawn(command, self._log, stdout=self._log, stdin=subprocess.DEVNULL, env=env,
                               cwd=self._dir)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> Worker:
        """Until the worker says it is ready (its ready-check file); BenchError, with what it logged,
        when it exits or is not ready within 90 s."""
        proc, log = self.proc, self._log
        if proc is None or log is None:
            raise BenchError("the openYuanrong worker was not started (call start() first)")
        deadline = time.monotonic() + _START_S
        while not os.path.exists(self._ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                status = (f"is not ready after {_START_S:.0f} s" if proc.poll() is None
                          else f"exited with status {proc.poll()} before it was ready")
                log_tail = tail(log) or self._glog_tail()
                self.stop()
                raise BenchError(f"the openYuanrong datasystem worker on {self.host}:{self.port} {status}: {log_tail}")
            time.sleep(0.1)
        return self

    def _glog_tail(self) -> str:
        logs = sorted(Path(self._dir or ".").glob("datasystem/logs/*ERROR*"))
        return logs[-1].read_text(errors="replace")[-2000:] if logs else "(no output)"

    def stop(self) -> None:
        """Stop the worker (SIGTERM, then SIGKILL) and remove its state folder."""
        try:
            if self.proc is not None:
                stop(self.proc)
        finally:
            self.proc = None
            if self._log is not None:
                self._log.close()
                self._log = None
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    def __enter__(self) -> Worker:
        return self.start().wait_ready()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def kv_client(self) -> Any:
        """An initialised `yr.datasystem.KVClient` connected to this worker."""
        return connect("KVClient", self.host, self.port)

    def stream_client(self) -> Any:
        """An initialised `yr.datasystem.StreamClient` connected to this worker."""
        return connect("StreamClient", self.host, self.port)


def connect(kind: str, host: str, port: int) -> Any:
    """An initialised client of `kind` (`KVClient`, `StreamClient`) of the worker at host:port."""
    client = getattr(_datasystem(), kind)(host, port)
    try:
        client.init()
    except RuntimeError as e:
        raise BenchError(f"openYuanrong {kind} could not connect to {host}:{port}: {e}") from e
    return client


class _Peer:
    """One KVClient's timed turns over the batches of `src`/`dst`: puts by mcreate (its zero-copy
    put: the caller's bytes are copied once, into its shared memory) and by mset (values under
    500 KiB), gets by get_buffers (copied from its shared memory into `dst`) and by get (bytes)."""

    def __init__(self, client: Any, name: str, src: np.ndarray, dst: np.ndarray, batch: int) -> None:
        self.client, self.name, self.src, self.dst = client, name, src, dst
        n, self.block = src.shape
        self.spans = [slice(i, min(i + batch, n)) for i in range(0, n, batch)]
        self.keys: list[str] = []
        self.rounds = 0

    def _fresh_keys(self) -> list[str]:
        """Keys for a new round of puts, the previous round's deleted first (untimed): a key is written once."""
        if self.keys:
            self.client.delete(self.keys)
        self.rounds += 1
        self.keys = [f"{self.name}-{self.rounds}-{i}" for i in range(len(self.src))]
        return self.keys

    def put_mcreate(self) -> float:
        keys = self._fresh_keys()
        t = time.perf_counter()
        for s in self.spans:
            bufs = self.client.mcreate(keys[s], [self.block] * (s.stop - s.start))
            for row, buf in zip(self.src[s], bufs):
                np.frombuffer(buf.MutableData(), dtype=np.uint8)[:] = row
            self.client.mset_buffer(bufs)
        return time.perf_counter() - t

    def put_mset(self) -> float:
        keys = self._fresh_keys()
        t = time.perf_counter()
        for s in self.spans:
            failed = self.client.mset(keys[s], [row.data for row in self.src[s]])
            if failed:
                raise BenchError(f"openYuanrong mset of {self.block}-byte values failed for {len(failed)} keys")
        return time.perf_counter() - t

    def get_buffers(self) -> float:
        t = time.perf_counter()
        for s in self.spans:
            for row, buf in zip(self.dst[s], self.client.get_buffers(self.keys[s])):
                row[:] = np.frombuffer(buf, dtype=np.uint8)
        elapsed = time.perf_counter() - t
        self._check("get_buffers")
        return elapsed

    def get(self) -> float:
        t = time.perf_counter()
        for s in self.spans:
            for row, value in zip(self.dst[s], self.client.get(self.keys[s])):
                row[:] = np.frombuffer(value, dtype=np.uint8)
        elapsed = time.perf_counter() - t
        self._check("get")
        return elapsed

    def _check(self, method: str) -> None:
        """After the clock stops: the bytes read back are those written; `dst` is zeroed again."""
        if not np.array_equal(self.src, self.dst):
            raise BenchError(f"openYuanrong {method} of {self.block}-byte blocks read back other bytes")
        self.dst.fill(0)

    def close(self) -> None:
        if self.keys:
            self.client.delete(self.keys)
            self.keys = []


def _ours(client: Any, src: np.ndarray, dst: np.ndarray, batch: int, tag: str) -> tuple[Callable[[], float],
                                                                                         Callable[[], float]]:
    """kvpool's same-node turns: batch_put and batch_get_into of the same batches (bytes checked)."""
    n = len(src)
    batches = [([f"yrcmp{tag}-{j}" for j in range(i, min(i + batch, n))], list(src[i:i + batch]),
                list(dst[i:i + batch])) for i in range(0, n, batch)]

    def put() -> float:
        for keys, _, _ in batches:  # untimed, as for the peer: each round writes keys that are not there
            client.batch_remove(keys)
        t = time.perf_counter()
        for keys, rows, _ in batches:
            client.batch_put(keys, rows)
        return time.perf_counter() - t

    def get() -> float:
        t = time.perf_counter()
        for keys, _, rows in batches:
            client.batch_get_into(keys, rows)
        elapsed = time.perf_counter() - t
        if not np.array_equal(src, dst):
            raise BenchError(f"kvpool: {src.shape[1]}-byte blocks read back differ from blocks written")
        dst.fill(0)
        return elapsed

    return put, get


def _in_turns(turns: dict[str, Callable[[], float]], repeat: int, op: str, block: int) -> dict[str, float]:
    """`best_in_turns`, a failure of its client (a RuntimeError: how the datasystem client reports
    any) a BenchError."""
    try:
        return best_in_turns(turns, repeat)
    except BenchError:
        raise
    except RuntimeError as e:
        raise BenchError(f"openYuanrong {op} of {block}-byte blocks failed: {e}") from e


def _one_key_gets(pool: Any, prefix: str, peers: dict[str, _Peer], tag: str, n: int) -> dict[str, float]:
    """p50/p99 microseconds of `n` one-key gets into the caller's buffer: ours (`batch_get_into`) and
    its `get_buffers` (plus the copy out) on each of its workers, taking turns get by get."""
    out = np.zeros(next(iter(peers.values())).block, dtype=np.uint8)
    samples: dict[str, list[float]] = {"kvpool_shm": [], **{f"yuanrong{v}": [] for v in peers}}
    for i in range(n + 10):  # the first 10 of each: warm-up
        j = i % len(next(iter(peers.values())).keys)
        t = time.perf_counter()
        pool.batch_get_into([f"{prefix}-{j}"], [out])
        elapsed = {"kvpool_shm": time.perf_counter() - t}
        for v, p in peers.items():
            t = time.perf_counter()
            (buf,) = p.client.get_buffers([p.keys[j]])
            out[:] = np.frombuffer(buf, dtype=np.uint8)
            elapsed[f"yuanrong{v}"] = time.perf_counter() - t
        if i >= 10:
            for name, seconds in elapsed.items():
                samples[name].append(seconds)
    found: dict[str, float] = {}
    for name, taken in samples.items():
        pct = percentiles_us(taken, (50, 99))
        found.update({f"{name}_get_one{tag}_p50_us": pct["p50"], f"{name}_get_one{tag}_p99_us": pct["p99"]})
    return found


def same_node(total: int, batch: int, repeat: int) -> tuple[dict[str, Any], dict[str, float]]:
    """kvpool's same-node path (a PoolClient through shared memory to a `kvpool worker` of its own on
    this node) against openYuanrong's KVClient on its workers on this node, each holding only what is
    measured, `total` bytes per measurement in blocks of each of `SIZES`, `batch` blocks per call,
    best of `repeat` turns after one warm-up (the paths take turns).

    Metrics: `yuanrong_{put,get}_{method}{size}_gbps` per method and threshold (`_shm0`: threshold
    0), `yuanrong_{put,get}{size}_gbps` (its best), `kvpool_shm_{put,get}{size}_gbps` (ours, in the
    same turns), and one-key 64 KiB get latencies (`*_get_one_64k_p50_us`, `_p99_us`). Ratios:
    `shm_{put,get}_vs_yuanrong{size}`, ours over its best."""
    metrics: dict[str, Any] = {"yuanrong_batch": batch}
    ratios: dict[str, float] = {}
    with ExitStack() as stack:
        state = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-bench-"))
        ours = WorkerProcess(state, dram_bytes=str(2 * total + (256 << 20)))
        stack.callback(ours.stop)
        workers = {"": Worker(shared_memory_mb=max(1024, 4 * total >> 20)),
                   "_shm0": Worker(shm_threshold_kb=0, shared_memory_mb=max(1024, 4 * total >> 20))}
        for w in workers.values():
            stack.callback(w.stop)
            w.start()
        clients = {variant: w.wait_ready().kv_client() for variant, w in workers.items()}
        pool = stack.enter_context(PoolClient(mode="local", worker=ours.wait_ready().unix_path))
        for block in SIZES:
            tag = size_tag(block)
            n = total // block
            src = filled(n * block, 11).reshape(n, block)
            dst = np.zeros_like(src)
            peers = {v: _Peer(c, f"b{block}{v}", src, dst, batch) for v, c in clients.items()}
            our_put, our_get = _ours(pool, src, dst, batch, tag)
            puts: dict[str, Callable[[], float]] = {"kvpool": our_put}
            gets: dict[str, Callable[[], float]] = {"kvpool": our_get}
            for v, p in peers.items():
                puts[f"mcreate{v}"] = p.put_mcreate
                if block < _MSET_MAX:
                    puts[f"mset{v}"] = p.put_mset
                gets[f"get_buffers{v}"], gets[f"get{v}"] = p.get_buffers, p.get
            try:
                for op, turns in (("put", puts), ("get", gets)):
                    best = {name: gbps(src.nbytes, s) for name, s in _in_turns(turns, repeat, op, block).items()}
                    kvpool = best.pop("kvpool")
                    theirs = max(best.values())
                    metrics.update({f"yuanrong_{op}_{name}{tag}_gbps": round(v, 2) for name, v in best.items()})
                    metrics[f"yuanrong_{op}{tag}_gbps"] = round(theirs, 2)
                    metrics[f"yuanrong_{op}{tag}_best_method"] = max(best, key=lambda k: best[k])
                    metrics[f"kvpool_shm_{op}{tag}_gbps"] = round(kvpool, 2)
                    ratios[f"shm_{op}_vs_yuanrong{tag}"] = kvpool / theirs
                if block == _ONE_KEY_BLOCK:
                    metrics.update(_one_key_gets(pool, f"yrcmp{tag}", peers, tag, 100 * repeat))
            finally:
                for p in peers.values():
                    p.close()
                pool.batch_remove([f"yrcmp{tag}-{j}" for j in range(n)])
    return metrics, ratios

"""Mooncake Store as the transport suite's peer: the same batches of blocks put and read back over its TCP protocol.

mooncake_master and a process owning the only memory segment run on this machine; the measuring client
has no segment, so every byte crosses Mooncake's TCP transfer engine. Caveat: the master's HTTP metadata
server binds 0.0.0.0 whatever host it is given (and each client's transfer-engine listeners do too).
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

import numpy as np

from ..errors import BenchError, InvalidArgument
from ..nats_server import free_port
from .measure import gbps
from .peer_procs import spawn, stop, tail

__all__ = ["measure"]

_INSTALL = "apt-get install -y libibverbs1; pip install mooncake-transfer-engine-non-cuda"
_START_S = 30.0
_LOCAL_BUFFER = 16 << 20


def _store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore  # may be absent (no stubs: see pyproject)
    except ImportError as e:
        raise BenchError(f"the Mooncake peer needs the mooncake package in {sys.executable} ({e}); "
                           f"install it with: {_INSTALL}") from e
    return MooncakeDistributedStore


def _setup(store: Any, meta_url: str, master: str, segment_bytes: int) -> None:
    deadline = time.monotonic() + _START_S
    # The master reports itself not ready for its first moments, so a failed setup is retried.
    while (rc := store.setup("127.0.0.1", meta_url, segment_bytes, _LOCAL_BUFFER, "tcp", "", master)) != 0:
        if time.monotonic() > deadline:
            raise BenchError(f"Mooncake setup against master {master} returned {rc} for {_START_S} s")
        time.sleep(0.2)


def _own_segment(meta_url: str, master: str, segment_bytes: int) -> None:
    """The segment owner's process: holds `segment_bytes` of store memory until its stdin closes."""
    store = _store_class()()
    _setup(store, meta_url, master, segment_bytes)
    print("READY", flush=True)
    sys.stdin.read()
    store.close()


def _wait_port(port: int, proc: subprocess.Popen[Any], log: IO[bytes]) -> None:
    deadline = time.monotonic() + _START_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"mooncake_master did not open port {port} (exit code {proc.poll()}): {tail(log)}")


def _transfer(op: Any, name: str, keys: list[str], plan: list[tuple[slice, list[int], list[int]]], ok: int) -> None:
    for span, ptrs, sizes in plan:
        rcs = op(keys[span], ptrs, sizes)
        if any(rc != ok for rc in rcs):
            raise BenchError(f"Mooncake {name} of {sizes[0]}-byte blocks returned {sorted(set(rcs))}; expected {ok}")


def _plan(buf: np.ndarray, batch: int) -> list[tuple[slice, list[int], list[int]]]:
    """Per batch: its slice of the keys, the addresses of its blocks in `buf`, and their sizes."""
    n, block = buf.shape
    plan = []
    for i in range(0, n, batch):
        rows = range(i, min(i + batch, n))
        plan.append((slice(i, rows.stop), [buf.ctypes.data + j * block for j in rows], [block] * len(rows)))
    return plan


def _time(store: Any, src: np.ndarray, dst: np.ndarray, batch: int, repeat: int) -> tuple[float, float]:
    n, block = src.shape
    put_plan, get_plan = _plan(src, batch), _plan(dst, batch)
    # Touch the owner's segment (3x the data) before timing: 2/3 of it, short of the 90% that starts eviction.
    for r in range(2):
        _transfer(store.batch_put_from, "batch_put_from", [f"warm{r}-{i}" for i in range(n)], put_plan, 0)
    store.remove_all(True)
    keys: list[str] = []
    t_put = t_get = float("inf")
    for r in range(repeat + 1):  # round 0 is the warm-up
        if keys:
            store.batch_remove(keys, True)  # a put to an existing key leaves the old object
        keys = [f"{r}-{i}" for i in range(n)]
        t = time.perf_counter()
        _transfer(store.batch_put_from, "batch_put_from", keys, put_plan, 0)
        t_put = min(t_put, time.perf_counter() - t) if r else t_put
    dst[:] = 0
    for r in range(repeat + 1):
        t = time.perf_counter()
        _transfer(store.batch_get_into, "batch_get_into", keys, get_plan, block)
        t_get = min(t_get, time.perf_counter() - t) if r else t_get
    if not np.array_equal(src, dst):
        raise BenchError(f"Mooncake: {block}-byte blocks read back differ from blocks written")
    return gbps(src.nbytes, t_put), gbps(src.nbytes, t_get)


def measure(src: np.ndarray, dst: np.ndarray, batch: int, repeat: int) -> tuple[float, float]:
    """Put GB/s and get GB/s (1e9 bytes/s, best of `repeat` after one warm-up) of Mooncake Store moving
    the rows of `src` (n, block) uint8 in batches of `batch` blocks, then reading them into `dst`.

    Raises RuntimeError when mooncake is not installed or its processes fail, AssertionError when the
    bytes read back differ from those written.
    """
    if src.shape != dst.shape or not (src.flags.c_contiguous and dst.flags.c_contiguous):
        raise InvalidArgument(f"src {src.shape} and dst {dst.shape} must be C-contiguous arrays of one shape")
    store_class = _store_class()
    import mooncake  # may be absent (no stubs: see pyproject)

    master_bin = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.access(master_bin, os.X_OK):  # e.g. kvpool's own mooncake shim found first on sys.path
        raise BenchError(f"{mooncake.__file__} is not Mooncake's package (no {master_bin}); "
                           f"install it with: {_INSTALL}")
    rpc, http, metrics = free_port(), free_port(), free_port()
    meta_url, master_addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
    segment = max(3 * src.nbytes, 64 << 20)  # Mooncake refuses segments under 16 MiB
    procs: list[subprocess.Popen[Any]] = []
    store = None
    with tempfile.TemporaryFile() as master_log, tempfile.TemporaryFile() as owner_log:
        try:
            master_args = [master_bin, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                           "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                           f"--http_metadata_server_port={http}",
                           "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"]
            procs.append(spawn(master_args, master_log, stdout=master_log, stdin=subprocess.DEVNULL))
            _wait_port(rpc, procs[0], master_log)
            _wait_port(http, procs[0], master_log)
            owner = spawn([sys.executable, "-m", __name__, meta_url, master_addr, str(segment)], owner_log,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            procs.append(owner)
            out = owner.stdout
            if out is None or not select.select([out], [], [], _START_S)[0] or out.readline() != b"READY\n":
                raise BenchError(f"Mooncake segment owner did not start: {tail(owner_log)}")
            store = store_class()
            _setup(store, meta_url, master_addr, 0)
            for buf in (src, dst):
                if (rc := store.register_buffer(buf.ctypes.data, buf.nbytes)) != 0:
                    raise BenchError(f"Mooncake register_buffer of {buf.nbytes} bytes returned {rc}")
            return _time(store, src, dst, batch, repeat)
        finally:
            try:
                if store is not None:
                    store.close()
            finally:
                for proc in reversed(procs):
                    stop(proc)


if __name__ == "__main__":
    _own_segment(sys.argv[1], sys.argv[2], int(sys.argv[3]))

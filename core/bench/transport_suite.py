"""Transport: same-node shared memory vs memcpy; remote TCP batches vs a raw socket stream.

A `kvpool worker` runs in its own process. Batches of 64 blocks of 1 MiB, 256 KiB, 64 KiB and 16 KiB:
put and get through the Unix-socket/shared-memory path against numpy copies of the same bytes, and
through TCP frames against a raw Python socket process doing sendall/recv_into of the same bytes, all
in turns round by round. Also the p50/p99 latency of one 64 KiB remote get. `--peer mooncake` adds
Mooncake Store on the same work (1 MiB and 64 KiB);
`--peer yuanrong` sets the same-node path against openYuanrong datasystem at 64 KiB, 256 KiB and 1 MiB.
"""
from __future__ import annotations

import argparse
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..client import PoolClient
from ..errors import BenchError
from ..procs import WorkerProcess
from . import raw_socket
from .measure import best_in_turns, emit, filled, gbps

__all__ = ["add_arguments", "run"]

_BATCH = 64
_SIZES = ((1 << 20, ""), (256 << 10, "_256k"), (64 << 10, "_64k"), (16 << 10, "_16k"))
"""Block sizes and the suffix of their figures' names (none for 1 MiB, the first figures this suite had)."""
_PEER_TAGS = ("", "_64k")
"""The sizes a peer store is also measured at."""
_ALIASES = {"": "_1m"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", choices=["mooncake", "yuanrong"], default=None,
                   help="also run the work on a peer store (mooncake: over TCP; yuanrong: openYuanrong "
                        "datasystem on this node, against our same-node path)")


def _memcpy(src: np.ndarray, dst: np.ndarray) -> Callable[[], float]:
    def turn() -> float:
        t = time.perf_counter()
        for a, b in zip(src, dst):
            np.copyto(b, a)
        return time.perf_counter() - t
    return turn


def _pool(client: PoolClient, src: np.ndarray, dst: np.ndarray, tag: str) -> tuple[Callable[[], float], ...]:
    """Turns that put and get the blocks through `client` in batches; then one that checks the bytes."""
    keys = [f"{tag}-{i}" for i in range(len(src))]
    batches = [(keys[i:i + _BATCH], list(src[i:i + _BATCH]), list(dst[i:i + _BATCH]))
               for i in range(0, len(src), _BATCH)]

    def put() -> float:
        t = time.perf_counter()
        for k, s, _ in batches:
            client.batch_put(k, s)
        return time.perf_counter() - t

    def get() -> float:
        t = time.perf_counter()
        for k, _, d in batches:
            client.batch_get_into(k, d)
        return time.perf_counter() - t

    def check() -> float:
        dst[:] = 0
        get()
        if not np.array_equal(src, dst):
            raise BenchError(f"{tag}: blocks read back differ from blocks written")
        return 0.0
    return put, get, check


def _raw(sock: socket.socket, src: np.ndarray, dst: np.ndarray) -> tuple[Callable[[], float], Callable[[], float]]:
    sv = [src[i:i + _BATCH].data.cast("B") for i in range(0, len(src), _BATCH)]
    dv = [dst[i:i + _BATCH].data.cast("B") for i in range(0, len(dst), _BATCH)]

    def put() -> float:
        t = time.perf_counter()
        for v in sv:
            raw_socket.put(sock, [v])
        return time.perf_counter() - t

    def get() -> float:
        t = time.perf_counter()
        for v in dv:
            raw_socket.get(sock, [v])
        return time.perf_counter() - t
    return put, get


def _latency(client: PoolClient, tag: str, n: int) -> list[float]:
    """Seconds of each of `n` single-block gets of the 64 KiB blocks `_pool` put under `tag`."""
    one = np.zeros(64 << 10, dtype=np.uint8)
    lat = []
    for i in range(n):
        t = time.perf_counter()
        client.batch_get_into([f"{tag}-{i % 64}"], [one])
        lat.append(time.perf_counter() - t)
    return lat


def run(args: argparse.Namespace) -> int:
    repeat = 3 if args.quick else 5
    total = 64 << 20 if args.quick else 256 << 20
    metrics: dict[str, Any] = {"batch": _BATCH, "bytes_per_measurement": total}
    ratios: dict[str, float] = {}
    lat: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as state, raw_socket.server() as raw_port:
        worker = WorkerProcess(state, dram_bytes=str(3 * total + (256 << 20)))
        try:
            worker.wait_ready()
            shm = PoolClient(mode="local", worker=worker.unix_path)
            tcp = PoolClient(mode="local", worker=worker.address)
            raw = socket.create_connection(("127.0.0.1", raw_port), timeout=30)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with raw:
                for block, tag in _SIZES:
                    n = total // block
                    src = filled(n * block, 5).reshape(n, block)
                    dst = np.zeros_like(src)
                    shm_put, shm_get, shm_check = _pool(shm, src, dst, f"shm{tag}")
                    tcp_put, tcp_get, tcp_check = _pool(tcp, src, dst, f"tcp{tag}")
                    raw_put, raw_get = _raw(raw, src, dst)
                    # in turns, round by round: load from elsewhere falls on all of them alike
                    best = best_in_turns({"memcpy": _memcpy(src, dst), "shm_put": shm_put, "shm_get": shm_get,
                                          "tcp_put": tcp_put, "tcp_get": tcp_get, "raw_socket_put": raw_put,
                                          "raw_socket_get": raw_get}, repeat)
                    shm_check()
                    tcp_check()
                    gb = {name: gbps(src.nbytes, s) for name, s in best.items()}
                    metrics.update({f"{name}{tag}_gbps": round(v, 2) for name, v in gb.items()})
                    ratios.update({f"shm_get_vs_memcpy{tag}": gb["shm_get"] / gb["memcpy"],
                                   f"shm_put_vs_memcpy{tag}": gb["shm_put"] / gb["memcpy"],
                                   f"tcp_get_vs_raw_socket{tag}": gb["tcp_get"] / gb["raw_socket_get"],
                                   f"tcp_put_vs_raw_socket{tag}": gb["tcp_put"] / gb["raw_socket_put"]})
                    if args.peer == "mooncake" and tag in _PEER_TAGS:
                        from .mooncake_peer import measure

                        mk_put, mk_get = measure(src, dst, _BATCH, repeat)
                        metrics.update({f"mooncake_put{tag}_gbps": round(mk_put, 2),
                                        f"mooncake_get{tag}_gbps": round(mk_get, 2)})
                        ratios.update({f"tcp_get_vs_mooncake{tag}": gb["tcp_get"] / mk_get,
                                       f"tcp_put_vs_mooncake{tag}": gb["tcp_put"] / mk_put})
                    if tag in _ALIASES:  # the 1 MiB figures also under the names that carry the size
                        ratios.update({f"{k}{_ALIASES[tag]}": v for k, v in list(ratios.items())
                                       if k.endswith(("memcpy", "raw_socket", "mooncake"))})
                    if tag == "_64k":
                        lat = _latency(tcp, f"tcp{tag}", 300 if args.quick else 2000)
                    shm.clear()  # the next size starts with an empty arena: no eviction while timed
            if args.peer == "yuanrong":
                from .yuanrong_peer import same_node

                yr_metrics, yr_ratios = same_node(total, _BATCH, repeat)  # fresh workers, ours included
                metrics.update(yr_metrics)
                ratios.update(yr_ratios)
            shm.close()
            tcp.close()
        finally:
            worker.stop()
    emit("transport", metrics, ratios, args.json, notes="ratios without a size suffix are for 1 MiB blocks; batches "
         "of 64; each figure the best of its rounds, taken in turns", latencies={"tcp_get_64k": lat})
    return 0

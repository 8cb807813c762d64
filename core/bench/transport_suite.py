"""Transport: same-node shared memory vs memcpy; remote TCP batches vs a raw socket stream.

A `kvpool worker` runs in its own process. Batches of 64 blocks of 1 MiB and 64 KiB: put and get
through the Unix-socket/shared-memory path against numpy copies of the same bytes, and through TCP
frames against a raw Python socket process doing sendall/recv_into of the same bytes. Also the
p50/p99 latency of one 64 KiB remote get. `--peer mooncake` adds Mooncake Store on the same work.
"""
from __future__ import annotations

import argparse
import socket
import tempfile
import time
from typing import Any

import numpy as np

from ..client import PoolClient
from ..errors import BenchError
from ..procs import WorkerProcess
from . import raw_socket
from .measure import best_seconds, emit, filled, gbps

__all__ = ["add_arguments", "run"]

_BATCH = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", choices=["mooncake"], default=None, help="also run the work on a peer store")


def _memcpy(src: np.ndarray, dst: np.ndarray, repeat: int) -> float:
    def run() -> None:
        for a, b in zip(src, dst):
            np.copyto(b, a)
    run()
    return gbps(src.nbytes, best_seconds(run, repeat))


def _pool(client: PoolClient, src: np.ndarray, dst: np.ndarray, tag: str, repeat: int) -> tuple[float, float]:
    keys = [f"{tag}-{i}" for i in range(len(src))]
    batches = [(keys[i:i + _BATCH], list(src[i:i + _BATCH]), list(dst[i:i + _BATCH]))
               for i in range(0, len(src), _BATCH)]

    def put() -> None:
        for k, s, _ in batches:
            client.batch_put(k, s)

    def get() -> None:
        for k, _, d in batches:
            client.batch_get_into(k, d)

    put()
    get()
    t_put = best_seconds(put, repeat)
    dst[:] = 0
    t_get = best_seconds(get, repeat)
    if not np.array_equal(src, dst):
        raise BenchError(f"{tag}: blocks read back differ from blocks written")
    return gbps(src.nbytes, t_put), gbps(src.nbytes, t_get)


def _raw(port: int, src: np.ndarray, dst: np.ndarray, repeat: int, host: str = "127.0.0.1") -> tuple[float, float]:
    sock = socket.create_connection((host, port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock:
        sv = [src[i:i + _BATCH].data.cast("B") for i in range(0, len(src), _BATCH)]
        dv = [dst[i:i + _BATCH].data.cast("B") for i in range(0, len(dst), _BATCH)]

        def put() -> None:
            for v in sv:
                raw_socket.put(sock, [v])

        def get() -> None:
            for v in dv:
                raw_socket.get(sock, [v])

        put()
        get()
        return gbps(src.nbytes, best_seconds(put, repeat)), gbps(src.nbytes, best_seconds(get, repeat))


def run(args: argparse.Namespace) -> int:
    repeat = 3 if args.quick else 5
    total = 64 << 20 if args.quick else 256 << 20
    metrics: dict[str, Any] = {"batch": _BATCH, "bytes_per_measurement": total}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as state, raw_socket.server() as raw_port:
        worker = WorkerProcess(state, dram_bytes=str(4 * total + (256 << 20)))
        try:
            worker.wait_ready()
            shm = PoolClient(mode="local", worker=worker.unix_path)
            tcp = PoolClient(mode="local", worker=worker.address)
            for block, tag in ((1 << 20, ""), (64 << 10, "_64k")):
                n = total // block
                src = filled(n * block, 5).reshape(n, block)
                dst = np.zeros_like(src)
                mc = _memcpy(src, dst, repeat)
                shm_put, shm_get = _pool(shm, src, dst, f"shm{tag}", repeat)
                tcp_put, tcp_get = _pool(tcp, src, dst, f"tcp{tag}", repeat)
                raw_put, raw_get = _raw(raw_port, src, dst, repeat)
                metrics.update({f"memcpy{tag}_gbps": round(mc, 2), f"shm_put{tag}_gbps": round(shm_put, 2),
                                f"shm_get{tag}_gbps": round(shm_get, 2), f"raw_socket_put{tag}_gbps": round(raw_put, 2),
                                f"raw_socket_get{tag}_gbps": round(raw_get, 2), f"tcp_put{tag}_gbps": round(tcp_put, 2),
                                f"tcp_get{tag}_gbps": round(tcp_get, 2)})
                ratios.update({f"shm_get_vs_memcpy{tag}": shm_get / mc, f"shm_put_vs_memcpy{tag}": shm_put / mc,
                               f"tcp_get_vs_raw_socket{tag}": tcp_get / raw_get,
                               f"tcp_put_vs_raw_socket{tag}": tcp_put / raw_put})
                if args.peer == "mooncake":
                    from .mooncake_peer import measure

                    mk_put, mk_get = measure(src, dst, _BATCH, repeat)
                    metrics.update({f"mooncake_put{tag}_gbps": round(mk_put, 2),
                                    f"mooncake_get{tag}_gbps": round(mk_get, 2)})
                    ratios.update({f"tcp_get_vs_mooncake{tag}": tcp_get / mk_get,
                                   f"tcp_put_vs_mooncake{tag}": tcp_put / mk_put})
            one = np.zeros(64 << 10, dtype=np.uint8)
            lat = []
            for i in range(300 if args.quick else 2000):
                t = time.perf_counter()
                tcp.batch_get_into([f"tcp_64k-{i % 64}"], [one])
                lat.append(time.perf_counter() - t)
            shm.close()
            tcp.close()
        finally:
            worker.stop()
    emit("transport", metrics, ratios, args.json, notes="ratios without a suffix are for 1 MiB blocks, batches of 64",
         latencies={"tcp_get_64k": lat})
    return 0

"""Streams: notification latency, and a 32 x 1 MiB KV handoff vs a raw socket and vs NATS inline.

One nats-server, one `kvpool worker` and a raw-socket process, all on loopback. Latency: publish to
receive of one small JSON notification (p50/p99, microseconds). Handoff: the prefill side puts 32
layers of one 1 MiB block each and publishes a reference per layer; the decode side (another thread)
receives every layer with its bytes checked. Baselines move the same bytes through a raw socket server
(put then get back) and inline through NATS JetStream in 512 KiB messages.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from ..client import PoolClient
from ..nats_server import NatsServer, free_port
from ..procs import WorkerProcess
from . import raw_socket
from .measure import emit, filled, gbps, percentiles_us

_LAYERS, _BLOCK, _INLINE_CHUNK = 32, 1 << 20, 512 << 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=None, help="handoff requests to time (best is kept)")


def _latency(url: str, stream: str, n: int) -> dict[str, float]:
    from kvpool.streams import Consumer, Producer

    samples = []
    with Producer(stream, url) as p, Consumer(stream, url, start="new") as c:
        for i in range(n + 10):
            t = time.perf_counter()
            p.publish({"op": "commit", "i": i})
            m = c.receive(5)
            samples.append(time.perf_counter() - t)
            if m is None or m.json()["i"] != i:
                raise AssertionError(f"notification {i} did not arrive in order")
            m.ack()
    return percentiles_us(samples[10:])


def _timed(produce: Any, consume: Any) -> float:
    """Seconds from the producer's start until the consumer has everything (producer in a thread)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            produce()
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    t = time.perf_counter()
    th = threading.Thread(target=run)
    th.start()
    consume()
    elapsed = time.perf_counter() - t
    th.join()
    if errors:
        raise errors[0]
    return elapsed


def _handoff(url: str, stream: str, pool: PoolClient, layers: np.ndarray, requests: int) -> float:
    from kvpool.streams import HandoffReceiver, Producer

    best = float("inf")
    with Producer(stream, url, pool=pool) as p, HandoffReceiver(stream, url, pool) as rx:
        for r in range(requests + 1):
            rid = f"r{r}"
            keys = [[f"bench/{rid}/L{i}"] for i in range(_LAYERS)]

            def produce() -> None:
                for i in range(_LAYERS):
                    p.publish_kv(rid, i, keys[i], [layers[i]])
                p.end_request(rid, _LAYERS)

            def consume() -> None:
                n = 0
                for layer, _, bufs in rx.iter_layers(rid, timeout=30):
                    if bytes(bufs[0]) != layers[layer].tobytes():
                        raise AssertionError(f"request {rid} layer {layer}: bytes differ")
                    n += 1
                if n != _LAYERS:
                    raise AssertionError(f"request {rid}: {n} of {_LAYERS} layers")

            elapsed = _timed(produce, consume)
            best = min(best, elapsed) if r else best  # the first request warms up
            pool.remove([k for ks in keys for k in ks])
    return gbps(layers.nbytes, best)


def _nats_inline(url: str, stream: str, layers: np.ndarray, requests: int) -> float:
    from kvpool.streams import Consumer, Producer

    chunks = layers.reshape(-1, _INLINE_CHUNK)
    best = float("inf")
    with Producer(stream, url, inline_max=_INLINE_CHUNK) as p, Consumer(stream, url, start="new") as c:
        for r in range(requests + 1):
            def produce() -> None:
                for ch in chunks:
                    p.publish(ch)

            def consume() -> None:
                for i in range(len(chunks)):
                    m = c.receive(30)
                    if m is None or bytes(m.data) != chunks[i].tobytes():
                        raise AssertionError(f"inline chunk {i} missing or different")
                    m.ack()

            elapsed = _timed(produce, consume)
            best = min(best, elapsed) if r else best
    return gbps(layers.nbytes, best)


def _raw(port: int, layers: np.ndarray, requests: int) -> float:
    import socket

    out = np.zeros_like(layers)
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    best = float("inf")
    with sock:
        for r in range(requests + 1):
            t = time.perf_counter()
            raw_socket.put(sock, [memoryview(layers).cast("B")])
            raw_socket.get(sock, [memoryview(out).cast("B")])
            best = min(best, time.perf_counter() - t) if r else best
    if not np.array_equal(out, layers):
        raise AssertionError("raw socket bytes differ")
    return gbps(layers.nbytes, best)


def _wait_port(port: int, timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"baseline server on port {port} did not start")


def run(args: argparse.Namespace) -> int:
    from kvpool.streams import StreamConfig, create_stream

    requests = args.requests or (3 if args.quick else 10)
    layers = filled(_LAYERS * _BLOCK, 7).reshape(_LAYERS, _BLOCK)
    metrics: dict[str, Any] = {"layers": _LAYERS, "block_bytes": _BLOCK, "inline_chunk_bytes": _INLINE_CHUNK,
                               "requests": requests}
    raw_port = free_port()
    raw_proc = subprocess.Popen([sys.executable, "-m", "kvpool.core.bench.raw_socket", str(raw_port)])
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-streams-") as state:
        nats = NatsServer(f"{state}/nats", port=0).start()
        worker = WorkerProcess(f"{state}/w0", nats_url=nats.url, dram_bytes="512MiB")
        try:
            worker.wait_ready()
            _wait_port(raw_port)
            for name in ("notes", "handoff", "inline"):  # in memory: the bench measures the path, not the disk
                create_stream(nats.url, name, StreamConfig(memory=True))
            metrics.update({f"notify_{k}_us": v for k, v in _latency(nats.url, "notes", 300 if args.quick else 3000).items()})
            with PoolClient(mode="cluster", nats_url=nats.url) as pool:
                if not pool._cluster or not pool._cluster.membership.wait_for(lambda m: len(m) == 1, 15):
                    raise RuntimeError("the bench worker did not join the cluster")
                handoff = _handoff(nats.url, "handoff", pool, layers, requests)
            inline = _nats_inline(nats.url, "inline", layers, requests)
            raw = _raw(raw_port, layers, requests)
        finally:
            worker.stop()
            nats.stop()
            raw_proc.kill()
            raw_proc.wait()
    metrics.update({"handoff_gbps": round(handoff, 3), "nats_inline_gbps": round(inline, 3),
                    "raw_socket_gbps": round(raw, 3)})
    emit("streams", metrics, {"handoff_vs_raw_socket": handoff / raw, "handoff_vs_nats_inline": handoff / inline},
         args.json, notes="handoff: 32 layers x 1 MiB per request, bytes checked; raw socket: put + get back")
    return 0

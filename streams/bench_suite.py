"""Streams: notification latency, and a 32 x 1 MiB KV handoff vs a raw socket and vs NATS inline.

One nats-server, one `kvpool worker`, a raw-socket server and a prefill process, all on loopback.
Latency: publish to receive of one small JSON notification (p50/p99, microseconds). Handoff: the
prefill process (its own PoolClient, as a prefill instance would have) puts 32 layers of one 1 MiB
block each and publishes a reference per layer; this process, the decode side, receives every layer
into its own buffer, each block checksum-verified, in the timed path. Both processes are on the
worker's node, so the pool moves the bytes through its shared memory, as it would for any same-node
pair. Baselines move the same bytes through a raw socket server (put then get back) and inline through
JetStream in 512 KiB messages from the same prefill process. Every path compares the bytes it
received with the source after its clock stops, and the three take turns request by request.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import subprocess
import sys
import time
from collections.abc import Generator
from typing import IO, Any, cast

import numpy as np

from kvpool.core import BenchError, PoolClient
from kvpool.core.bench import BenchPool, best_in_turns, emit, filled, gbps, raw_socket, wait_members

from . import Consumer, HandoffReceiver, Producer, StreamConfig, create_stream

_LAYERS, _BLOCK, _INLINE_CHUNK = 32, 1 << 20, 512 << 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=None,
                   help="requests timed per path, the paths taking turns (the best of each is kept)")


def _latency(url: str, stream: str, n: int) -> list[float]:
    samples = []
    with Producer(stream, url) as p, Consumer(stream, url, start="new") as c:
        for i in range(n + 10):
            t = time.perf_counter()
            p.publish({"op": "commit", "i": i})
            m = c.receive(5)
            samples.append(time.perf_counter() - t)
            if m is None or m.json()["i"] != i:
                raise BenchError(f"notification {i} did not arrive in order")
            m.ack()
    return samples[10:]


class _Prefill:
    """The producing side in a process of its own, as a prefill instance would be: it hands off one
    request (or publishes the inline chunks) per command line on its stdin and answers on stdout."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._in, self._out = cast(IO[str], self.proc.stdin), cast(IO[str], self.proc.stdout)
        self._expect("ready")

    def start(self, command: str) -> None:
        """Begin `kv STREAM REQUEST` or `inline STREAM`; returns at once (the caller times the receive)."""
        self._in.write(command + "\n")
        self._in.flush()

    def done(self) -> None:
        self._expect("done")

    def _expect(self, word: str) -> None:
        if self._out.readline().strip() != word:
            raise BenchError(f"the bench's prefill process failed (exit status {self.proc.poll()})")

    def close(self) -> None:
        self._in.close()
        try:
            self.proc.wait(10)
        finally:
            self.proc.kill()
            self._out.close()


def _prefill_main(url: str) -> None:
    """Body of the prefill process: the same `layers` bytes as the parent (same seed). Its producers
    connect on their first command (the untimed warm-up) and stay connected."""
    layers = filled(_LAYERS * _BLOCK, 7).reshape(_LAYERS, _BLOCK)
    producers: dict[str, Producer] = {}
    with PoolClient(mode="cluster", nats_url=url) as pool:
        wait_members(pool, 1)
        print("ready", flush=True)
        try:
            for line in sys.stdin:
                what, stream, *rest = line.split()
                if stream not in producers:
                    producers[stream] = Producer(stream, url, pool=pool, inline_max=_INLINE_CHUNK)
                p = producers[stream]
                if what == "kv":
                    for i in range(_LAYERS):
                        p.publish_kv(rest[0], i, [f"bench/{rest[0]}/L{i}"], [layers[i]])
                    p.end_request(rest[0], _LAYERS)
                else:
                    for ch in layers.reshape(-1, _INLINE_CHUNK):
                        p.publish(ch)
                print("done", flush=True)
        finally:
            for p in producers.values():
                p.close()


def _handoff_runs(url: str, pool: PoolClient, prefill: _Prefill, layers: np.ndarray) -> Generator[float, None, None]:
    """Seconds per request, from asking the prefill process until every layer is here and verified
    (checksums, in the timed path); the bytes are compared with the source after the clock stops."""
    out = np.zeros_like(layers)
    with HandoffReceiver("handoff", url, pool) as rx:
        for r in itertools.count():
            rid = f"r{r}"
            t = time.perf_counter()
            prefill.start(f"kv handoff {rid}")
            n = sum(1 for _ in rx.iter_layers(rid, timeout=30, into=lambda layer, nbytes: out[layer]))
            elapsed = time.perf_counter() - t
            prefill.done()
            if n != _LAYERS or not np.array_equal(out, layers):
                raise BenchError(f"request {rid}: {n} of {_LAYERS} layers, or bytes differ")
            out.fill(0)
            pool.batch_remove([f"bench/{rid}/L{i}" for i in range(_LAYERS)])
            yield elapsed


def _inline_runs(url: str, prefill: _Prefill, layers: np.ndarray) -> Generator[float, None, None]:
    """The same bytes inline through JetStream in 512 KiB messages, from the same prefill process."""
    out = np.zeros_like(layers).reshape(-1, _INLINE_CHUNK)
    with Consumer("inline", url, start="new") as c:
        while True:
            t = time.perf_counter()
            prefill.start("inline inline")
            for i in range(len(out)):
                m = c.receive(30)
                if m is None:
                    raise BenchError(f"inline chunk {i} missing")
                out[i] = np.frombuffer(m.data, dtype=np.uint8)
                m.ack()
            elapsed = time.perf_counter() - t
            prefill.done()
            if not np.array_equal(out.reshape(layers.shape), layers):
                raise BenchError("inline bytes differ")
            out.fill(0)
            yield elapsed


def _raw_runs(port: int, layers: np.ndarray) -> Generator[float, None, None]:
    """The same bytes put to the raw socket server and got back."""
    import socket

    out = np.zeros_like(layers)
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock:
        while True:
            t = time.perf_counter()
            raw_socket.put(sock, [layers.data.cast("B")])
            raw_socket.get(sock, [out.data.cast("B")])
            elapsed = time.perf_counter() - t
            if not np.array_equal(out, layers):
                raise BenchError("raw socket bytes differ")
            out.fill(0)
            yield elapsed


def run(args: argparse.Namespace) -> int:
    requests = args.requests or (8 if args.quick else 20)
    layers = filled(_LAYERS * _BLOCK, 7).reshape(_LAYERS, _BLOCK)
    metrics: dict[str, Any] = {"layers": _LAYERS, "block_bytes": _BLOCK, "inline_chunk_bytes": _INLINE_CHUNK,
                               "requests": requests}
    with raw_socket.server() as raw_port, BenchPool(block_size=_BLOCK, dram_bytes=512 << 20, workers=1) as bench, \
            contextlib.ExitStack() as stack:
        url, pool = bench.url, bench.client
        assert url is not None
        for name in ("notes", "handoff", "inline"):  # in memory: the bench measures the path, not the disk
            create_stream(url, name, StreamConfig(memory=True))
        notify = _latency(url, "notes", 300 if args.quick else 3000)
        prefill = _Prefill(url)
        stack.callback(prefill.close)
        runs = {"handoff": _handoff_runs(url, pool, prefill, layers), "nats_inline": _inline_runs(url, prefill, layers),
                "raw_socket": _raw_runs(raw_port, layers)}
        for gen in runs.values():
            stack.callback(gen.close)
        best = best_in_turns({name: functools.partial(next, gen) for name, gen in runs.items()}, requests)
    gb = {name: gbps(layers.nbytes, s) for name, s in best.items()}
    metrics.update({f"{name}_gbps": round(v, 3) for name, v in gb.items()})
    emit("streams", metrics, {"handoff_vs_raw_socket": gb["handoff"] / gb["raw_socket"],
                              "handoff_vs_nats_inline": gb["handoff"] / gb["nats_inline"]},
         args.json, notes="handoff: 32 layers x 1 MiB per request, bytes checked; raw socket: put + get back",
         latencies={"notify": notify})
    return 0

if __name__ == "__main__":
    _prefill_main(sys.argv[1])

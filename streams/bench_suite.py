"""Streams: the prefill->decode KV handoff against the physical limits, and notification latency.

One nats-server, one `kvpool worker`, a raw-socket server and a prefill process, all on loopback. The
prefill process (its own PoolClient on the worker's node, placing locally as a prefill instance would:
`ClientConfig.placement`) puts 32 layers of one 1 MiB block each and publishes a reference per layer;
this process, the decode side, receives every layer into its own buffer, each block checksum-verified,
in the timed path. Paths, taking turns request by
request, every one comparing the bytes it received with the source after its clock stops:
- `handoff`: same node (both sides reach the worker through its shared memory; the decode side copies
  each block from its own mapping of it, where the announcement says the producer committed it);
- `handoff_tcp`: the decode side reaches the worker over TCP, as a decode instance on another node than
  the prefill's would (it reads each block from the worker the announcement names, over one connection);
- `pool_puts`: the prefill process only putting the layers in the pool, as `publish_kv` does (staged:
  `kvpool.core.shm_stage`), one after the other, until the worker committed the last
  (`handoff_vs_pool_puts`: how close the handoff comes to the pool's own put rate);
- `memcpy`: numpy copying the same 32 MiB once (`handoff_vs_memcpy`; the producer's copy into the pool
  and the decode side's copy out make 0.5 its limit where nothing overlaps);
- `raw_socket` (the same bytes put to a raw socket server and got back) and `raw_socket_oneway` (only
  sent: `handoff_vs_raw_socket_oneway`, over `handoff_tcp`);
- `nats_inline`: the same bytes inline through JetStream in 512 KiB messages.
Latencies (the decode side already waiting, clocks of one machine): `first_layer`, from the prefill
calling `publish_kv` for layer 0 (1 MiB) to that layer verified in the decode side's buffer;
`tiny_layer`, the same for a 64-byte layer (the per-layer cost with no bytes to speak of: a small put,
the announcement and the decode side's read of it; timed from the call, as `first_layer`: from its
return it came out negative when the decode side had the layer before the producer's thread ran again);
`notify`, from the prefill calling `end_request` (a request of no layers: one sealed announcement) to
that announcement handed out by the decode side's live subscription (`live.Feed`, as `iter_layers`
takes it); `nats_hop`, their baseline: the prefill process publishing an empty core-NATS message after
the same pause, from the call to its arrival at a bare subscription in this process (no stream, no
checks: what the machine and NATS take to wake two processes and route one message; `*_vs_nats_hop`
ratios are multiples of it, p50 over p50); `js_notify`, a JSON notification through `Producer.publish`
(which waits for JetStream's ack) and a pulling `Consumer`.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Generator
from typing import IO, Any, cast

import numpy as np

from kvpool.core import BenchError, PoolClient, Stagers
from kvpool.core.bench import BenchPool, best_in_turns, emit, filled, gbps, raw_socket, wait_members

from . import Consumer, HandoffReceiver, Producer, StreamConfig, bench_yuanrong, create_stream
from ._link import Link
from .admin import subject
from .live import Feed
from .payload import put_blocks
from .wire import Wire

_LAYERS, _BLOCK, _INLINE_CHUNK, _TINY = 32, 1 << 20, 512 << 10, 64
_REMOTE = "kvpool-bench-remote-node"
"""The node id the TCP path's decode side claims, so that it reaches the (local) worker over TCP."""
_SETTLE_S = 0.005
"""How long the prefill waits before a latency sample's layer 0, so that the decode side is waiting."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=None,
                   help="requests timed per path, the paths taking turns (the best of each is kept)")
    bench_yuanrong.add_arguments(p)


def _now() -> float:
    """CLOCK_MONOTONIC seconds: one clock for every process of the machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _js_latency(url: str, stream: str, n: int) -> list[float]:
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
    """The producing side in a process of its own, as a prefill instance would be: it runs one command
    per line on its stdin and answers `done` (and what it timed) on stdout."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._in, self._out = cast(IO[str], self.proc.stdin), cast(IO[str], self.proc.stdout)
        self._expect("ready")

    def start(self, command: str) -> None:
        """Begin `kv|puts|first|tiny|note STREAM REQUEST` or `inline STREAM`;
        returns at once (the caller times the receive)."""
        self._in.write(command + "\n")
        self._in.flush()

    def done(self) -> list[float]:
        """The times the command reported (CLOCK_MONOTONIC seconds)."""
        return [float(t) for t in self._expect("done")]

    def _expect(self, word: str) -> list[str]:
        got = self._out.readline().split()
        if not got or got[0] != word:
            raise BenchError(f"the bench's prefill process failed (exit status {self.proc.poll()})")
        return got[1:]

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
    hop_wire: Wire | None = None  # (the `nats_hop` baseline's publisher, made at its first command)
    with PoolClient(mode="cluster", nats_url=url, placement="local") as pool, \
            contextlib.closing(Stagers(pool)) as stagers:
        wait_members(pool, 1)
        print("ready", flush=True)
        try:
            for line in sys.stdin:
                what, stream, *rest = line.split()
                if what == "hop":  # `stream`: the subject
                    hop_wire = hop_wire or Wire(url)
                    time.sleep(_SETTLE_S)
                    called = _now()
                    hop_wire.publish(stream, b"")
                    print("done", called, flush=True)
                    continue
                if stream not in producers:
                    producers[stream] = Producer(stream, url, pool=pool, inline_max=_INLINE_CHUNK)
                p, times = producers[stream], []
                if what == "kv":
                    for i in range(_LAYERS):
                        p.publish_kv(rest[0], i, [f"bench/{stream}/{rest[0]}/L{i}"], [layers[i]])
                    p.end_request(rest[0], _LAYERS)
                elif what == "puts":
                    for i in range(_LAYERS):
                        put_blocks(pool, [f"bench/puts/{rest[0]}/L{i}"], [layers[i]], pin_s=p.pin_ttl_s,
                                   stagers=stagers)
                    stagers.settle()
                elif what == "note":  # the decode side subscribed before it asked
                    times.append(_now())
                    p.end_request(rest[0], 0)
                elif what in ("first", "tiny"):
                    time.sleep(_SETTLE_S)
                    times.append(_now())
                    block = layers[0] if what == "first" else layers[0, :_TINY]
                    p.publish_kv(rest[0], 0, [f"bench/{stream}/{rest[0]}/L0"], [block])
                    p.end_request(rest[0], 1)
                else:
                    for ch in layers.reshape(-1, _INLINE_CHUNK):
                        p.publish(ch)
                print("done", *times, flush=True)
        finally:
            for p in producers.values():
                p.close()
            if hop_wire is not None:
                hop_wire.close()


def _handoff_runs(url: str, stream: str, pool: PoolClient, prefill: _Prefill,
                  layers: np.ndarray) -> Generator[float, None, None]:
    """Seconds per request, from asking the prefill process until every layer is here and verified
    (checksums, in the timed path); the bytes are compared with the source after the clock stops."""
    out = np.zeros_like(layers)
    with HandoffReceiver(stream, url, pool) as rx:
        for r in itertools.count():
            rid = f"r{r}"
            t = time.perf_counter()
            prefill.start(f"kv {stream} {rid}")
            n = sum(1 for _ in rx.iter_layers(rid, timeout=30, into=lambda layer, nbytes: out[layer]))
            elapsed = time.perf_counter() - t
            prefill.done()
            if n != _LAYERS or not np.array_equal(out, layers):
                raise BenchError(f"{stream} request {rid}: {n} of {_LAYERS} layers, or bytes differ")
            out.fill(0)
            pool.batch_remove([f"bench/{stream}/{rid}/L{i}" for i in range(_LAYERS)])
            yield elapsed


def _puts_runs(pool: PoolClient, prefill: _Prefill) -> Generator[float, None, None]:
    """Seconds for the prefill process to put the request's layers in the pool as `publish_kv` does,
    one after the other, with nothing announced or read: the floor a same-node handoff stands on."""
    for r in itertools.count():
        rid = f"p{r}"
        t = time.perf_counter()
        prefill.start(f"puts handoff {rid}")
        prefill.done()
        elapsed = time.perf_counter() - t
        pool.batch_remove([f"bench/puts/{rid}/L{i}" for i in range(_LAYERS)])
        yield elapsed


def _latencies(url: str, pool: PoolClient, prefill: _Prefill, layers: np.ndarray,
               n: int) -> dict[str, list[float]]:
    """Samples in seconds of `first_layer`, `tiny_layer` and `notify`, taking turns, the decode side
    waiting before each starts: the prefill process sleeps `_SETTLE_S` before it times a layer (the
    receiver subscribes meanwhile); a notification's receiver subscribed before it asked. The 1 MiB and
    the 64-byte layers come from producers of their own (a producer's layers are of one shape, as a
    model's are)."""
    out = np.zeros(_BLOCK, dtype=np.uint8)
    samples: dict[str, list[float]] = {"first_layer": [], "tiny_layer": [], "notify": [], "nats_hop": []}
    with HandoffReceiver("first", url, pool) as first, HandoffReceiver("tiny", url, pool) as tiny, \
            contextlib.closing(Link(url)) as link, contextlib.closing(Wire(url)) as wire:
        hop_subject = f"_INBOX.kvpool-bench-hop.{uuid.uuid4().hex}"
        hop_sid = wire.subscribe(hop_subject)
        wire.flush()  # (the subscription in place before the first hop)
        for r in range(n + 5):
            for what, want, rx in (("first", layers[0], first), ("tiny", layers[0, :_TINY], tiny)):
                rid = f"{what}{r}"
                prefill.start(f"{what} {what} {rid}")  # each on a stream (and producer) of its own
                got = []
                for _ in rx.iter_layers(rid, timeout=30, into=lambda layer, nbytes: out[:nbytes]):
                    got.append(_now())
                (called,) = prefill.done()
                if len(got) != 1 or not np.array_equal(out[:want.size], want):
                    raise BenchError(f"latency request {rid}: {len(got)} layers, or bytes differ")
                if r >= 5:  # the first few warm up
                    samples[f"{what}_layer"].append(got[0] - called)
                out.fill(0)
                pool.batch_remove([f"bench/{what}/{rid}/L0"])
            rid = f"note{r}"
            feed = Feed(link, wire, "first", subject("first", "req", rid))
            try:
                prefill.start(f"note first {rid}")
                burst = feed.live(30)
                arrived = _now()
                (called,) = prefill.done()
            finally:
                feed.close()
            kinds = [m.headers.get("Kvpool-Kind") for m in burst]
            if kinds != ["end"]:
                raise BenchError(f"notification {rid}: expected one live 'end' within 30 s, got {kinds}")
            if r >= 5:
                samples["notify"].append(arrived - called)
            prefill.start(f"hop {hop_subject}")
            msg = wire.next(hop_sid, 30)
            arrived = _now()
            (called,) = prefill.done()
            if msg is None:
                raise BenchError("the nats_hop baseline's message did not arrive within 30 s")
            if r >= 5:
                samples["nats_hop"].append(arrived - called)
    return samples


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


def _raw_runs(sock: socket.socket, layers: np.ndarray, back: bool) -> Generator[float, None, None]:
    """The same bytes sent to the raw socket server, and (`back`) got back. The server takes one
    connection at a time: both turns share `sock`."""
    out = np.zeros_like(layers)
    while True:
        t = time.perf_counter()
        raw_socket.put(sock, [layers.data.cast("B")])
        if back:
            raw_socket.get(sock, [out.data.cast("B")])
        elapsed = time.perf_counter() - t
        if back and not np.array_equal(out, layers):
            raise BenchError("raw socket bytes differ")
        out.fill(0)
        yield elapsed


def _memcpy_runs(layers: np.ndarray) -> Generator[float, None, None]:
    """numpy copying the same bytes once, into a buffer of its own (touched before the clock starts)."""
    out = np.zeros_like(layers)
    while True:
        t = time.perf_counter()
        np.copyto(out, layers)
        elapsed = time.perf_counter() - t
        if not np.array_equal(out, layers):
            raise BenchError("memcpy bytes differ")
        out.fill(0)
        yield elapsed


def run(args: argparse.Namespace) -> int:
    requests = args.requests or (8 if args.quick else 20)
    samples = 100 if args.quick else 300
    layers = filled(_LAYERS * _BLOCK, 7).reshape(_LAYERS, _BLOCK)
    metrics: dict[str, Any] = {"layers": _LAYERS, "block_bytes": _BLOCK, "inline_chunk_bytes": _INLINE_CHUNK,
                               "requests": requests}
    with raw_socket.server() as raw_port, BenchPool(block_size=_BLOCK, dram_bytes=512 << 20, workers=1) as bench, \
            contextlib.ExitStack() as stack:
        url, pool = bench.url, bench.client
        assert url is not None
        tcp_pool = stack.enter_context(PoolClient(mode="cluster", nats_url=url, node_id=_REMOTE))
        wait_members(tcp_pool, 1)
        for name in ("notes", "handoff", "handoff_tcp", "first", "tiny", "inline"):  # in memory: the path, not the disk
            create_stream(url, name, StreamConfig(memory=True))
        js_notify = _js_latency(url, "notes", samples)
        prefill = _Prefill(url)
        stack.callback(prefill.close)
        sock = stack.enter_context(socket.create_connection(("127.0.0.1", raw_port), timeout=30))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        latencies = _latencies(url, pool, prefill, layers, samples)
        runs = {"handoff": _handoff_runs(url, "handoff", pool, prefill, layers),
                "handoff_tcp": _handoff_runs(url, "handoff_tcp", tcp_pool, prefill, layers),
                "memcpy": _memcpy_runs(layers),
                "pool_puts": _puts_runs(pool, prefill),
                "nats_inline": _inline_runs(url, prefill, layers),
                "raw_socket": _raw_runs(sock, layers, back=True),
                "raw_socket_oneway": _raw_runs(sock, layers, back=False),
                **bench_yuanrong.runs(args, stack, layers)}
        for gen in runs.values():
            stack.callback(gen.close)
        best = best_in_turns({name: functools.partial(next, gen) for name, gen in runs.items()}, requests)
    gb = {name: gbps(layers.nbytes, s) for name, s in best.items()}
    metrics.update({f"{name}_gbps": round(v, 3) for name, v in gb.items()})
    hop_p50 = float(np.median(latencies["nats_hop"]))
    emit("streams", metrics, {"handoff_vs_memcpy": gb["handoff"] / gb["memcpy"],
                              "first_layer_vs_nats_hop": float(np.median(latencies["first_layer"])) / hop_p50,
                              "notify_vs_nats_hop": float(np.median(latencies["notify"])) / hop_p50,
                              "handoff_vs_raw_socket_oneway": gb["handoff_tcp"] / gb["raw_socket_oneway"],
                              "handoff_vs_pool_puts": gb["handoff"] / gb["pool_puts"],
                              "handoff_vs_raw_socket": gb["handoff"] / gb["raw_socket"],
                              "handoff_vs_nats_inline": gb["handoff"] / gb["nats_inline"], **bench_yuanrong.ratios(gb)},
         args.json, notes="handoff: 32 layers x 1 MiB per request, bytes checked; raw socket: put + get back; "
                          "handoff_tcp vs raw_socket_oneway: the decode side on TCP vs bytes only sent; "
                          "*_vs_nats_hop: p50 latency over a bare NATS message's after the same pause (lower: better)",
         latencies={**latencies, "js_notify": js_notify})
    return 0

if __name__ == "__main__":
    _prefill_main(sys.argv[1])

"""`kvpool bench streams --peer yuanrong`: the same handoff through openYuanrong datasystem's stream API.

A producer process of its own (as the prefill side is) sends the request's 32 layers of 1 MiB as 32
elements of one stream on an openYuanrong worker on this node; this process, subscribed before the
first request, receives each element, copies it into its own buffer and acks it, all in the timed
path (its stream frees a page only once every subscription has acked past it). The bytes are
compared with the source after the clock stops. It takes turns with the suite's other paths.
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Generator
from typing import IO, Any, cast

import numpy as np

from kvpool.core import BenchError
from kvpool.core.bench import filled, yuanrong_peer

__all__ = ["add_arguments", "ratios", "runs"]

_STREAM, _PAGE, _TIMEOUT_MS = "kvpool-bench-handoff", 4 << 20, 30_000
_SEED = 7
"""Seed of the layers' bytes (`filled`), which the producer process makes too."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", choices=["yuanrong"], default=None,
                   help="also hand the layers off through a peer's stream API (yuanrong: openYuanrong "
                        f"datasystem's producer/consumer with ack; {yuanrong_peer.INSTALL})")


def runs(args: argparse.Namespace, stack: contextlib.ExitStack,
         layers: np.ndarray) -> dict[str, Generator[float, None, None]]:
    """The peer's timed runs (seconds per request), its worker and producer closed by `stack`; none
    without `--peer`."""
    if getattr(args, "peer", None) != "yuanrong":
        return {}
    worker = yuanrong_peer.Worker()
    stack.callback(worker.stop)
    worker.start().wait_ready()
    return {"yuanrong_stream": _stream_runs(worker, stack, layers)}


def ratios(gbps: dict[str, float]) -> dict[str, float]:
    """`handoff_vs_yuanrong_stream` when the peer ran."""
    if "yuanrong_stream" not in gbps:
        return {}
    return {"handoff_vs_yuanrong_stream": gbps["handoff"] / gbps["yuanrong_stream"]}


class _Producer:
    """The sending side in its own process: one request (every layer, one element each) per line on
    its stdin, answered with `done` on its stdout."""

    def __init__(self, worker: yuanrong_peer.Worker, nlayers: int, block: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, worker.host, str(worker.port),
                                      str(nlayers), str(block)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._in, self._out = cast(IO[str], self.proc.stdin), cast(IO[str], self.proc.stdout)
        self._expect("ready")

    def send(self) -> None:
        self._in.write("send\n")
        self._in.flush()

    def done(self) -> None:
        self._expect("done")

    def _expect(self, word: str) -> None:
        if self._out.readline().strip() != word:
            raise BenchError(f"the openYuanrong producer process failed (exit status {self.proc.poll()})")

    def close(self) -> None:
        self._in.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            self._out.close()


def _stream_runs(worker: yuanrong_peer.Worker, stack: contextlib.ExitStack,
                 layers: np.ndarray) -> Generator[float, None, None]:
    client = worker.stream_client()
    consumer = _call("subscribe", client.subscribe, _STREAM, "decode", 0)  # 0: SubconfigType.STREAM
    stack.callback(consumer.close)
    producer = _Producer(worker, len(layers), layers.shape[1])
    stack.callback(producer.close)
    layers = filled(layers.nbytes, _SEED).reshape(layers.shape)  # the producer's bytes, of the suite's shape
    out = np.zeros_like(layers)
    while True:
        t = time.perf_counter()
        producer.send()
        got = 0
        while got < len(layers):
            for element in _call("receive", consumer.receive, len(layers) - got, _TIMEOUT_MS):
                out[got] = np.frombuffer(element, dtype=np.uint8)
                consumer.ack(element.get_id())
                got += 1
        elapsed = time.perf_counter() - t
        producer.done()
        if not np.array_equal(out, layers):
            raise BenchError("openYuanrong stream: the layers received differ from those sent")
        out.fill(0)
        yield elapsed


def _call(what: str, fn: Any, *args: Any) -> Any:
    """`fn(*args)`, its RuntimeError (how the datasystem client reports any failure) a BenchError."""
    try:
        return fn(*args)
    except RuntimeError as e:
        raise BenchError(f"openYuanrong stream {what} failed: {e}") from e


def _producer_main(host: str, port: int, nlayers: int, block: int) -> None:
    layers = filled(nlayers * block, _SEED).reshape(nlayers, block)
    client = yuanrong_peer.connect("StreamClient", host, port)
    producer = _call("create_producer", client.create_producer, _STREAM, 0, _PAGE, 64 * _PAGE)
    try:
        print("ready", flush=True)
        for _ in sys.stdin:
            for layer in layers:
                producer.send(layer.data, _TIMEOUT_MS)
            print("done", flush=True)
    finally:
        producer.close()


if __name__ == "__main__":
    _producer_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))

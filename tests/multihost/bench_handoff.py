"""A prefill->decode handoff between hosts: the prefill placing by hash (its layers spread over the three
hosts' workers, most of them crossing the network twice) or locally (every layer on its own host's
worker, read from there by the decode host), against a raw socket stream between the same two hosts.

    python tests/multihost/bench_handoff.py [--quick]          (root: it builds network namespaces)

h1..h3 run a worker each; h1 also nats-server (JetStream), the raw-socket baseline and the prefill
processes (one placing by hash, one locally); h4, the decode side, times each path from asking for a
request to its 32 x 1 MiB layers verified in its buffer (the baseline: the same bytes read from h1's
raw socket), the paths taking turns, and prints as its last line
`{"suite": "handoff-multihost", "metrics": {...}, "ratios": {...}}`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, cast

TOKEN = "multihost-bench-token"
LAYERS, BLOCK = 32, 1 << 20
PLACEMENTS = ("hash", "local")


def prefill(url: str, placement: str) -> None:
    """On h1: one request per line on stdin (its id), published through stream `handoff`; `done` after each."""
    from kvpool.core import PoolClient
    from kvpool.core.bench.measure import filled
    from kvpool.streams import Producer

    layers = filled(LAYERS * BLOCK, 7).reshape(LAYERS, BLOCK)
    with PoolClient(mode="cluster", nats_url=url, token=TOKEN, placement=placement, timeout_s=30) as pool, \
            Producer("handoff", url, pool=pool) as p:
        if not pool.wait_for_members(lambda m: len(m) == 3, 60):
            raise SystemExit("prefill: the three workers did not join")
        print("ready", flush=True)
        for line in sys.stdin:
            rid = line.strip()
            for i in range(LAYERS):
                p.publish_kv(rid, i, [f"{rid}/L{i}"], [layers[i]])
            p.end_request(rid, LAYERS)
            print("done", flush=True)


class _Prefill:
    """A prefill process on h1, driven from h4 through its standard input and output."""

    def __init__(self, ns: str, url: str, placement: str) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, __file__, "--prefill", url, placement],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._in, self._out = cast(IO[str], self.proc.stdin), cast(IO[str], self.proc.stdout)
        self._expect("ready")

    def request(self, rid: str) -> None:
        self._in.write(rid + "\n")
        self._in.flush()

    def _expect(self, word: str) -> None:
        got = self._out.readline().strip()
        if got != word:
            raise RuntimeError(f"prefill process: expected {word!r}, got {got!r} (exit {self.proc.poll()})")

    def done(self) -> None:
        self._expect("done")

    def close(self) -> None:
        self._in.close()
        self.proc.wait(30)


def measure(url: str, raw: str, h1_ns: str, quick: bool) -> dict[str, Any]:
    """On h4: the handoff from each prefill, and the raw stream, taking turns; the best of each."""
    import contextlib
    import itertools
    import socket

    import numpy as np

    from kvpool.core import PoolClient
    from kvpool.core.bench import raw_socket
    from kvpool.core.bench.measure import best_in_turns, filled, gbps
    from kvpool.streams import HandoffReceiver, StreamConfig, create_stream

    layers = filled(LAYERS * BLOCK, 7).reshape(LAYERS, BLOCK)
    out = np.zeros_like(layers)
    create_stream(url, "handoff", StreamConfig(memory=True))
    host, port = raw.rsplit(":", 1)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(PoolClient(mode="cluster", nats_url=url, token=TOKEN, timeout_s=30))
        if not pool.wait_for_members(lambda m: len(m) == 3, 60):
            raise SystemExit("decode: the three workers did not join")
        rx = stack.enter_context(HandoffReceiver("handoff", url, pool, timeout_s=30))
        prefills = {p: _Prefill(h1_ns, url, p) for p in PLACEMENTS}
        for p in prefills.values():
            stack.callback(p.close)
        sock = stack.enter_context(socket.create_connection((host, int(port)), timeout=30))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ids = itertools.count()

        def handoff(placement: str) -> float:
            rid = f"{placement}{next(ids)}"
            t = time.perf_counter()
            prefills[placement].request(rid)
            n = sum(1 for _ in rx.iter_layers(rid, timeout=30, into=lambda layer, nbytes: out[layer]))
            elapsed = time.perf_counter() - t
            prefills[placement].done()
            if n != LAYERS or not np.array_equal(out, layers):
                raise RuntimeError(f"{rid}: {n} of {LAYERS} layers, or bytes differ")
            out.fill(0)
            pool.batch_remove([f"{rid}/L{i}" for i in range(LAYERS)])
            return elapsed

        def oneway() -> float:
            t = time.perf_counter()
            raw_socket.get(sock, [out.data.cast("B")])
            return time.perf_counter() - t

        best = best_in_turns({"handoff_by_hash": lambda: handoff("hash"), "handoff_local": lambda: handoff("local"),
                              "raw_socket_oneway": oneway}, 3 if quick else 8)
    gb = {name: gbps(layers.nbytes, s) for name, s in best.items()}
    return {"suite": "handoff-multihost",
            "metrics": {"layers": LAYERS, "block_bytes": BLOCK, **{f"{k}_gbps": round(v, 3) for k, v in gb.items()}},
            "ratios": {f"{k}_vs_raw_socket_oneway": round(gb[k] / gb["raw_socket_oneway"], 3)
                       for k in ("handoff_by_hash", "handoff_local")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prefill", nargs=2, metavar=("NATS_URL", "PLACEMENT"), help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=3, metavar=("NATS_URL", "RAW", "H1_NS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prefill:
        prefill(*args.prefill)
        return 0
    if args.measure:
        print(json.dumps(measure(*args.measure, args.quick)), flush=True)
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from labbench import bench_main, start_workers

    from kvpool.core.nats_server import binary

    def setup(lab: Any, work: str) -> list[str] | None:  # no NATS users: this lab's server takes anyone
        a = lab.addr("h1")
        url = f"nats://{a}:4222"
        lab.spawn("h1", [binary(), "-a", a, "-p", "4222", "-js", "-sd", f"{work}/js"], log="nats.log")
        lab.spawn("h1", [sys.executable, "-m", "kvpool.core.bench.raw_socket", "7470", a], log="raw.log")
        if not start_workers(lab, ["h1", "h2", "h3"], work, TOKEN, "--nats-url", url, "--dram-bytes", "512MiB"):
            return None
        return ["ip", "netns", "exec", lab.ns("h4"), sys.executable, __file__, "--measure", url, f"{a}:7470",
                lab.ns("h1"), *(["--quick"] if args.quick else [])]

    return bench_main("bench_handoff", 4, setup)

if __name__ == "__main__":
    sys.exit(main())

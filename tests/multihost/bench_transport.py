"""TCP between hosts: kvpool's worker protocol against a raw socket stream between the same two network
namespaces (issue 16's `kvpool bench transport --multihost`, as a script: it needs root to build them).

    python tests/multihost/bench_transport.py [--quick]

h1 runs a worker and the raw-socket baseline; h2 measures both with the same blocks and prints, as its
last line, `{"suite": "transport-multihost", "metrics": {...}, "ratios": {...}}`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TOKEN = "multihost-bench-token"


def measure(worker: str, raw: str, quick: bool) -> dict[str, object]:
    """On the client host: the same batches through the worker and through the raw socket."""
    import socket

    import numpy as np

    from kvpool.core import PoolClient
    from kvpool.core.bench.measure import best_in_turns, filled, gbps
    from kvpool.core.bench.transport_suite import _pool, _raw

    repeat, total = (3, 64 << 20) if quick else (5, 256 << 20)
    metrics: dict[str, object] = {"bytes_per_measurement": total}
    ratios: dict[str, float] = {}
    host, port = raw.rsplit(":", 1)
    with PoolClient(mode="local", worker=worker, token=TOKEN, timeout_s=30) as tcp, \
            socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for block, tag in ((1 << 20, ""), (64 << 10, "_64k")):
            n = total // block
            src = filled(n * block, 5).reshape(n, block)
            dst = np.zeros_like(src)
            tcp_put, tcp_get, tcp_check = _pool(tcp, src, dst, f"mh{tag}")
            raw_put, raw_get = _raw(sock, src, dst)
            best = best_in_turns({"tcp_put": tcp_put, "tcp_get": tcp_get, "raw_socket_put": raw_put,
                                  "raw_socket_get": raw_get}, repeat)
            tcp_check()
            gb = {name: gbps(src.nbytes, sec) for name, sec in best.items()}
            metrics.update({f"{name}{tag}_gbps": round(v, 2) for name, v in gb.items()})
            ratios.update({f"tcp_get_vs_raw_socket{tag}": round(gb["tcp_get"] / gb["raw_socket_get"], 3),
                           f"tcp_put_vs_raw_socket{tag}": round(gb["tcp_put"] / gb["raw_socket_put"], 3)})
            tcp.clear()
    return {"suite": "transport-multihost", "metrics": metrics, "ratios": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--measure", nargs=2, metavar=("WORKER", "RAW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.quick)), flush=True)
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from labbench import bench_main, start_workers

    def setup(lab: Any, work: str) -> list[str] | None:
        a = lab.addr("h1")
        lab.spawn("h1", [sys.executable, "-m", "kvpool.core.bench.raw_socket", "7470", a], log="raw.log")
        if not start_workers(lab, ["h1"], work, TOKEN, "--dram-bytes", "512MiB" if args.quick else "1200MiB"):
            return None
        return ["ip", "netns", "exec", lab.ns("h2"), sys.executable, __file__, "--measure", f"{a}:7461",
                f"{a}:7470", *(["--quick"] if args.quick else [])]

    return bench_main("bench_transport", 2, setup)

if __name__ == "__main__":
    sys.exit(main())

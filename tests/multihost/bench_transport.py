"""TCP between hosts: kvpool's worker protocol against a raw socket stream between the same two network
namespaces (issue 16's `kvpool bench transport --multihost`, as a script: it needs root to build them).

    python tests/multihost/bench_transport.py [--quick]

h1 runs a worker and the raw-socket baseline; h2 measures both with the same blocks and prints, as its
last line, `{"suite": "transport-multihost", "metrics": {...}, "ratios": {...}}`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKEN = "multihost-bench-token"


def measure(worker: str, raw: str, quick: bool) -> dict[str, object]:
    """On the client host: the same batches through the worker and through the raw socket."""
    import numpy as np

    from kvpool.core import PoolClient
    from kvpool.core.bench.measure import filled
    from kvpool.core.bench.transport_suite import _pool, _raw

    repeat, total = (3, 64 << 20) if quick else (5, 256 << 20)
    metrics: dict[str, object] = {"bytes_per_measurement": total}
    ratios: dict[str, float] = {}
    host, port = raw.rsplit(":", 1)
    with PoolClient(mode="local", worker=worker, token=TOKEN, timeout_s=30) as tcp:
        for block, tag in ((1 << 20, ""), (64 << 10, "_64k")):
            n = total // block
            src = filled(n * block, 5).reshape(n, block)
            dst = np.zeros_like(src)
            tcp_put, tcp_get = _pool(tcp, src, dst, f"mh{tag}", repeat)
            raw_put, raw_get = _raw(int(port), src, dst, repeat, host=host)
            metrics.update({f"tcp_put{tag}_gbps": round(tcp_put, 2), f"tcp_get{tag}_gbps": round(tcp_get, 2),
                            f"raw_socket_put{tag}_gbps": round(raw_put, 2),
                            f"raw_socket_get{tag}_gbps": round(raw_get, 2)})
            ratios.update({f"tcp_get_vs_raw_socket{tag}": round(tcp_get / raw_get, 3),
                           f"tcp_put_vs_raw_socket{tag}": round(tcp_put / raw_put, 3)})
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
    from netlab import Lab, can_build

    why_not = can_build()
    if why_not:
        print(f"bench_transport: {why_not}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvpool-mh-bench-") as work:
        lab = Lab(2, Path(work))
        try:
            a = lab.addr("h1")
            lab.spawn("h1", [sys.executable, "-m", "kvpool.core.bench.raw_socket", "7470", a], log="raw.log")
            lab.spawn("h1", [sys.executable, "-m", "kvpool.core.cli", "worker", "--host", a, "--port", "7461",
                             "--token", TOKEN, "--dram-bytes", "1200MiB" if not args.quick else "512MiB"],
                      log="worker.log", env={"KVPOOL_STATE_DIR": f"{work}/state"})
            deadline = time.monotonic() + 60
            while "kvpool worker " not in lab.log("worker.log"):
                if time.monotonic() > deadline:
                    print(lab.log("worker.log"), file=sys.stderr)
                    return 1
                time.sleep(0.2)
            cmd = ["ip", "netns", "exec", lab.ns("h2"), sys.executable, __file__, "--measure", f"{a}:7461",
                   f"{a}:7470", *(["--quick"] if args.quick else [])]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            sys.stderr.write(out.stderr)
            print(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "", flush=True)
            return out.returncode
        finally:
            lab.close()


if __name__ == "__main__":
    sys.exit(main())

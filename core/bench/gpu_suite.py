"""GPU tier: GPU tensors to and from the pool (D2H, H2D) vs torch's own pinned-memory copy of the same bytes.

A `kvpool worker` runs in its own process; this process reaches it through shared memory, as an
engine on its node does. Blocks of 1 MiB and 64 KiB are uint8 tensors on the GPU, moved in batches
of 64: D2H is `batch_put` of the device tensors, H2D is `batch_get_into` device tensors, each ended
by a device synchronise and the bytes checked after the clock stops. The baseline copies the same
tensors to and from one pinned host buffer with torch (`copy_(non_blocking=True)`, then synchronise).
The paths take turns. Without a CUDA device (or without torch) nothing is measured: it says why (with
`--json`, a JSON line whose `skipped` gives the reason) and exits with status 77. `--device cpu` runs
the same path on CPU tensors against a plain torch copy (what the tests run on CPU-only machines).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ..client import PoolClient
from ..errors import BenchError, ConfigError
from ..procs import WorkerProcess
from .measure import best_in_turns, emit, gbps

__all__ = ["EXIT_SKIPPED", "add_arguments", "run"]

EXIT_SKIPPED = 77
"""Exit status when there is nothing to measure here (no CUDA device, or no torch): the convention of
automake and meson for a skipped test."""

_BATCH = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="torch device of the tensors: auto (cuda when present, else skip), cuda, cuda:N, "
                        "or cpu (the same path on CPU tensors, vs a plain torch copy)")


def _device(name: str) -> tuple[Any, str]:
    """(torch module, device name), or (None, why nothing can be measured here). ConfigError for a
    device that is none of auto, cpu, cuda, cuda:N."""
    if name not in ("auto", "cpu", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ConfigError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N")
    try:
        import torch
    except ImportError as e:
        return None, f"torch is not installed ({e}); pip install -e '.[torch]'"
    if name == "cpu":
        return torch, "cpu"
    if not torch.cuda.is_available():
        return None, (f"no CUDA device here (torch {torch.__version__}, cuda.is_available() is False): "
                      "nothing to measure; `--device cpu` runs the same path on CPU tensors")
    return torch, "cuda" if name == "auto" else name


def _skip(reason: str, as_json: bool) -> int:
    print(f"kvpool bench gpu: skipped: {reason}")
    if as_json:
        print(json.dumps({"suite": "gpu", "skipped": reason, "metrics": {"measured": False}, "ratios": {}}))
    return EXIT_SKIPPED


def _turns(torch: Any, pool: PoolClient, device: str, block: int, total: int,
           tag: str) -> tuple[dict[str, Callable[[], float]], Callable[[], None]]:
    """The four timed turns (seconds each) over `total` bytes of `block`-byte tensors, and the check
    that the pool's last H2D brought back the bytes put."""
    n = total // block
    gen = torch.Generator().manual_seed(block)
    src = [torch.randint(0, 256, (block,), dtype=torch.uint8, generator=gen).to(device) for _ in range(n)]
    dst = [torch.zeros(block, dtype=torch.uint8, device=device) for _ in range(n)]
    host = torch.empty((n, block), dtype=torch.uint8, pin_memory=device != "cpu")
    keys = [f"gpu{tag}-{i}" for i in range(n)]
    spans = [slice(i, min(i + _BATCH, n)) for i in range(0, n, _BATCH)]
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def timed(body: Callable[[], None]) -> Callable[[], float]:
        def turn() -> float:
            sync()
            t = time.perf_counter()
            body()
            sync()
            return time.perf_counter() - t
        return turn

    def pool_d2h() -> None:
        for s in spans:
            pool.batch_put(keys[s], src[s])

    def pool_h2d() -> None:
        for s in spans:
            pool.batch_get_into(keys[s], dst[s])

    def torch_d2h() -> None:
        for i, t in enumerate(src):
            host[i].copy_(t, non_blocking=True)

    def torch_h2d() -> None:
        for i, t in enumerate(dst):
            t.copy_(host[i], non_blocking=True)

    def check() -> None:
        pool_h2d()
        sync()
        if not all(torch.equal(a, b) for a, b in zip(src, dst)):
            raise BenchError(f"{block}-byte tensors read back from the pool differ from those put")

    pool_d2h()  # the keys exist before the first H2D turn
    return {"pool_d2h": timed(pool_d2h), "torch_d2h": timed(torch_d2h), "pool_h2d": timed(pool_h2d),
            "torch_h2d": timed(torch_h2d)}, check


def run(args: argparse.Namespace) -> int:
    torch, device = _device(args.device)
    if torch is None:
        return _skip(device, args.json)
    repeat = 3 if args.quick else 5
    total = 64 << 20 if args.quick else 256 << 20
    metrics: dict[str, Any] = {"measured": True, "device": device, "batch": _BATCH, "bytes_per_measurement": total}
    if device != "cpu":
        metrics["device_name"] = torch.cuda.get_device_name(torch.device(device))
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as state:
        worker = WorkerProcess(state, dram_bytes=str(2 * total + (256 << 20)))
        try:
            worker.wait_ready()
            with PoolClient(mode="local", worker=worker.unix_path) as pool:
                for block, tag in ((1 << 20, ""), (64 << 10, "_64k")):
                    turns, check = _turns(torch, pool, device, block, total, tag)
                    best = {k: gbps(total // block * block, s) for k, s in best_in_turns(turns, repeat).items()}
                    check()
                    metrics.update({f"{k}{tag}_gbps": round(v, 2) for k, v in best.items()})
                    ratios[f"gpu_h2d_vs_torch{tag}"] = best["pool_h2d"] / best["torch_h2d"]
                    ratios[f"gpu_d2h_vs_torch{tag}"] = best["pool_d2h"] / best["torch_d2h"]
                    pool.batch_remove([f"gpu{tag}-{i}" for i in range(total // block)])
        finally:
            worker.stop()
    emit("gpu", metrics, ratios, args.json,
         notes=f"tensors on {device}; ratios without a suffix are for 1 MiB blocks, batches of {_BATCH}; "
               "torch: copy_ to/from pinned host memory" + (" (not pinned on cpu)" if device == "cpu" else ""))
    return 0

"""What the tests of staged puts (`kvpool.core.shm_stage`) share: blocks, a stager on a worker, what the
worker holds reserved and has served, whether blocks are stored, and a `copy_into` that lies."""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvpool.core.fastcopy import copy_into
from kvpool.core.server import Worker
from kvpool.core.shm_stage import Stager
from kvpool.core.transport import ShmTransport, TcpTransport


def make_blocks(seed: int, *sizes: int) -> list[np.ndarray]:
    return [np.random.default_rng([seed, i]).integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)]


def stager_for(worker: Worker, timeout_s: float = 5.0) -> Stager:
    t = ShmTransport(worker.unix_path, timeout_s=timeout_s)
    return Stager(t, t.hello().arena)


def reserved_bytes(worker: Worker) -> int:
    return sum(sum(c.reserved.values()) for c in worker._conns)


def requests_of(worker: Worker, op: str) -> int:
    """Requests of `op` the worker has served (counted just after each answer)."""
    return int(worker.metrics.registry.get_sample_value("kvpool_ops_total", {"op": op}) or 0)


def protocol_errors(worker: Worker) -> float:
    return worker.metrics.registry.get_sample_value("kvpool_protocol_errors_total") or 0


def stored(reader: ShmTransport | TcpTransport, keys: list[bytes], blocks: list[np.ndarray]) -> bool:
    out = [np.zeros_like(b) for b in blocks]
    return reader.batch_get_into(keys, out) == [b.nbytes for b in blocks] and all(map(np.array_equal, out, blocks))


def wait_for(done: Callable[[], bool], seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f"not within {seconds} s"
        time.sleep(0.01)


def all_given_back(worker: Worker) -> None:
    """Once the stagers are closed: the worker holds no slot reserved any more (within 5 s), and its
    cache is consistent."""
    wait_for(lambda: reserved_bytes(worker) == 0)
    assert worker.cache.check() == []


def lying_about(block: np.ndarray) -> Callable[[memoryview, np.ndarray, list[memoryview]], np.ndarray]:
    """A `copy_into` whose checksum is wrong for `block` (known by its first 64 bytes) only."""
    head = block.tobytes()[:64]

    def copy_lying(dst: memoryview, offsets: np.ndarray, srcs: list[memoryview]) -> np.ndarray:
        lies = np.array([bytes(memoryview(s).cast("B")[:64]) == head for s in srcs], dtype="<u8")
        return copy_into(dst, offsets, srcs) ^ lies
    return copy_lying

"""A small same-node put goes as a TCP one does, its bytes through the Unix socket (one request, where
the arena's way takes two: `transport.SOCKET_PUT_BYTES`); a large one, or a put whose places someone
records, through the arena. Either way the same bytes come back (read from the arena)."""
from __future__ import annotations

import numpy as np
from stagehelp import requests_of, wait_for

from kvpool.core.client import PoolClient
from kvpool.core.server import Worker
from kvpool.core.shm_read import put_placed
from kvpool.core.transport import SOCKET_PUT_BYTES, ShmTransport


def _ops(worker: Worker) -> dict[str, int]:
    return {op: requests_of(worker, op) for op in ("put", "get", "alloc", "commit", "lease")}


def _blocks(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def _round_trip(worker: Worker, t: ShmTransport, name: str, blocks: list[np.ndarray]) -> dict[str, int]:
    """Put `blocks` and read them back through `t`; the requests of each kind the worker served for it."""
    keys = [f"{name}{i}".encode() for i in range(len(blocks))]
    before = _ops(worker)
    t.batch_put(keys, blocks)
    out = [np.zeros_like(b) for b in blocks]
    assert t.batch_get_into(keys, out) == [b.nbytes for b in blocks]
    assert all(np.array_equal(a, b) for a, b in zip(out, blocks))
    wait_for(lambda: requests_of(worker, "lease") > before["lease"])  # (counted just after the answer)
    return {op: n - before[op] for op, n in _ops(worker).items()}


def test_a_small_put_goes_through_the_socket_and_a_large_one_through_the_arena(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        small = _blocks(4, 16 << 10, 1)
        assert sum(b.nbytes for b in small) <= SOCKET_PUT_BYTES
        assert _round_trip(worker, t, "small", small) == {"put": 1, "get": 0, "alloc": 0, "commit": 0, "lease": 1}
        used = _round_trip(worker, t, "large", _blocks(8, 256 << 10, 2))  # 2 MiB: the arena's way
        assert used["put"] == used["get"] == 0 and used["commit"] >= 1 and used["lease"] >= 1
    finally:
        t.close()


def test_a_small_put_whose_places_are_recorded_goes_through_the_arena(worker: Worker) -> None:
    with PoolClient(mode="local", worker=worker.unix_path) as pool:
        blocks = _blocks(2, 4 << 10, 3)
        before = requests_of(worker, "put")
        places = put_placed(pool, ["p0", "p1"], blocks)
        assert requests_of(worker, "put") == before  # (committed in the arena: a place to tell)
        assert [p is not None and p.size == b.nbytes for p, b in zip(places, blocks)] == [True, True]
        out = [np.zeros_like(b) for b in blocks]
        assert pool.batch_get_into(["p0", "p1"], out) == [4 << 10, 4 << 10]
        assert all(np.array_equal(a, b) for a, b in zip(out, blocks))

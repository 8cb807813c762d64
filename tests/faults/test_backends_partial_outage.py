"""Cluster mode behind the engine adapters' HostIO: one of two workers paused (SIGSTOP). Reads are
bounded by the client's timeout and exact; but a put whose keys are partly owned by the paused worker
raises PoolUnavailable from the cluster client, and HostIO takes that for "the pool is unreachable":
for `retry_s` every call, reads from the healthy worker included, is answered RPC_FAIL without asking.
One sick worker of N should cost its own 1/N of the hits, not all of them."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np

from kvpool.backends.fastdeploy import KVPoolStore

sys.path.insert(0, str(Path(__file__).parent.parent / "backends"))
from bkhelp import HostBuffer
from sigstop import freeze

N, S = 64, 4096
TIMEOUT_S = 1.0


def test_a_put_partly_lost_to_a_paused_worker_does_not_blind_reads_of_the_healthy_one(nats, spawn) -> None:
    workers = [spawn(nats_url=nats.url, node_id=f"n{i}") for i in range(2)]
    store = KVPoolStore("m", mode="cluster", nats_url=nats.url, timeout_s=TIMEOUT_S, node_id="client", retry_s=30)
    src, dst = HostBuffer(N * S), HostBuffer(N * S)
    src.array[:] = (np.arange(N * S) % 251).astype(np.uint8)
    store.register_buffer(src.ptr, src.nbytes)
    store.register_buffer(dst.ptr, dst.nbytes)
    try:
        assert store._io.call(lambda c: c.wait_for_members(lambda m: len(m) == 2, 10), lambda st: False)
        keys = [f"a{i}" for i in range(N)]
        assert store.batch_set(keys, [src.ptr + i * S for i in range(N)], [S] * N) == [0] * N
        freeze(workers[1].proc.pid)
        try:
            got = store.batch_get(keys, [dst.ptr + i * S for i in range(N)], [S] * N)
            healthy = [i for i, n in enumerate(got) if n == S]
            assert 0 < len(healthy) < N  # the paused worker's keys miss, the other's hit
            for i in healthy:
                assert np.array_equal(dst.at(i * S, S), src.at(i * S, S))
            more = [f"b{i}" for i in range(N)]
            store.batch_set(more, [src.ptr + i * S for i in range(N)], [S] * N)  # partly to the paused worker
            dst.array[:] = 0
            again = store.batch_get([keys[i] for i in healthy], [dst.ptr + i * S for i in healthy],
                                    [S] * len(healthy))
            assert again == [S] * len(healthy), sorted(set(again))
        finally:
            os.kill(workers[1].proc.pid, signal.SIGCONT)
    finally:
        store.close()

"""A worker in a cluster that stalls (SIGSTOP) for more than `STALL_S` fences its reads and catches up
from its peers as it resumes (`kvpool.core.stall_watch`), counted in `kvpool_catch_ups_total{cause="stall"}`;
one that runs, busy or idle, never does."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from kvpool.core.client import PoolClient
from kvpool.core.nats_server import free_port
from kvpool.core.stall_watch import STALL_S

from faulthelp import metric, poll, wait_members
from sigstop import freeze


def _catch_ups(port: int, cause: str) -> float:
    return metric(port, f'kvpool_catch_ups_total{{cause="{cause}"}}')


def test_a_stall_is_caught_up_after_and_a_busy_worker_is_never_taken_for_stalled(nats, spawn):
    port = free_port()
    w = spawn(nats_url=nats.url, node_id="node0", extra=["--metrics-port", str(port)])
    block = np.arange(64 << 10, dtype=np.uint8)
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="node0", timeout_s=5) as c:
        wait_members(c, 1)
        deadline = time.monotonic() + 3 * STALL_S  # busy: puts and gets back to back
        while time.monotonic() < deadline:
            c.batch_put([f"k{i}" for i in range(64)], [block] * 64)
            assert all(n == block.size for n in c.batch_get_into([f"k{i}" for i in range(64)],
                                                                 [bytearray(block.size) for _ in range(64)]))
        assert _catch_ups(port, "stall") == 0
        freeze(w.proc.pid)
        time.sleep(1.5 * STALL_S)
        os.kill(w.proc.pid, signal.SIGCONT)
        assert poll(lambda: _catch_ups(port, "stall") == 1, 10)
        assert poll(lambda: c.get("k0") is not None, 10)  # caught up (no peer to ask): it reads again

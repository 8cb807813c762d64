"""Soak (opt-in: `python -m pytest -m soak`): mixed load across three workers with SSD tiers and R=2
while workers are killed (-9 or SIGTERM) and restarted at random, then a full verification pass.

SOAK_SECONDS sets the length (default 600) for a quick manual try, e.g. SOAK_SECONDS=60.
"""
from __future__ import annotations

import os
import random
import time

import pytest

from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from faulthelp import Load, bounded, poll, read_all, worker_id

SECONDS = float(os.environ.get("SOAK_SECONDS", "600"))
WORKER = dict(ssd=True, dram_bytes="64MiB", extra=["--ssd-map-size", "256MiB"])


def _client(nats_url: str) -> PoolClient:
    return PoolClient(mode="cluster", nats_url=nats_url, replication=2, node_id="client-node", timeout_s=3)


def _start(state, nats_url: str, node: str) -> WorkerProcess:
    return WorkerProcess(state, nats_url=nats_url, node_id=node, **WORKER).wait_ready()  # type: ignore[arg-type]


@pytest.mark.soak
@pytest.mark.timeout(SECONDS + 600)
def test_soak_mixed_load_with_random_worker_kills(nats, tmp_path):
    rng = random.Random(int(os.environ.get("SOAK_SEED", "0")))
    nodes = ["client-node", "node1", "node2"]  # one reached through shared memory, two over TCP
    workers = [_start(tmp_path / n, nats.url, n) for n in nodes]
    kills = 0
    try:
        with _client(nats.url) as c, \
                Load(c, "a", batch=16, size=64 << 10, rewrite=0.2, seed=1) as a, \
                Load(c, "b", batch=4, size=512 << 10, rewrite=0.1, seed=2) as b:  # two threads, one client
            deadline = time.monotonic() + SECONDS
            while time.monotonic() < deadline:
                a.wait_ops(20, timeout=60)  # the pool keeps serving
                b.wait_ops(5, timeout=60)
                assert not a.report.wrong and not b.report.wrong
                i = rng.randrange(3)
                if rng.random() < 0.7:
                    workers[i].kill()
                else:
                    assert workers[i].stop() == 0, workers[i].log_tail()
                kills += 1
                a.wait_ops(10, timeout=60)  # load while it is down
                workers[i] = _start(tmp_path / nodes[i], nats.url, nodes[i])
                time.sleep(rng.uniform(1, 10))  # pacing of the faults, not synchronization
            reports = [a.stop(), b.stop()]
            live = {worker_id(w) for w in workers}
            assert c.wait_for_members(lambda m: set(m) == live, 30), sorted(c.members())
            assert poll(lambda: set(c.stats().workers) == live, 10)
            for r in reports:
                assert not r.wrong, f"wrong bytes for {r.wrong[:5]}"
                assert all("PoolUnavailable" in e for e in r.errors), r.errors[:5]
                assert r.slowest_s < 10
                with bounded(max(60.0, len(r.committed) / 200), "the verification pass"):
                    hits, _ = read_all(c, r.committed, versions=r.versions, unsure=r.unsure)
                print(f"soak: {SECONDS:.0f} s, {kills} kills, {r.ops} ops, {len(r.errors)} typed errors, "
                      f"{len(hits)} of {len(r.committed)} committed blocks readable")
                assert hits
            c.batch_put(["soak-done"], [b"ok"])
            assert c.get("soak-done") == b"ok"
    finally:
        for w in workers:
            w.stop(timeout=10)

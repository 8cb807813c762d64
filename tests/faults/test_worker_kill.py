"""kill -9 (or freeze) a worker in the middle of a batch put or get, with R=1 and R=2.

The cluster has three workers; one is on the client's node (reached through shared memory), two are
remote (TCP). Whatever dies mid-batch: no read returns wrong bytes, no operation outlives its bound,
failures are typed (or misses), and the pool keeps serving.
"""
from __future__ import annotations

import gc
import os
import signal

import pytest

from kvpool.core import PoolUnavailable
from kvpool.core.client import PoolClient
from kvpool.core.cluster import rank

from faulthelp import Load, block, bounded, read_all, wait_members, worker_id
from sigstop import freeze

TIMEOUT_S = 2.0
BOUND_S = 2 * TIMEOUT_S + 2  # a batch may wait out one dead worker, then its replica


def _evictions(c: PoolClient) -> int:
    return c.stats().total.evictions  # a dead one has none


def _cluster(nats, spawn):
    nodes = ["client-node", "node1", "node2"]
    return [spawn(nats_url=nats.url, node_id=n) for n in nodes]


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("replication", [1, 2])
def test_kill_9_mid_batch(nats, spawn, op, replication):
    workers = _cluster(nats, spawn)
    ids = [worker_id(w) for w in workers]
    victim = 0 if op == "put" else 1  # the same-node worker mid-put, a remote one mid-get
    with PoolClient(mode="cluster", nats_url=nats.url, replication=replication, node_id="client-node",
                    timeout_s=TIMEOUT_S) as c:
        wait_members(c, 3)
        with Load(c, f"{op}{replication}", batch=32, size=128 << 10, bound_s=BOUND_S) as load:
            load.wait_ops(8)
            flag = load.putting if op == "put" else load.getting
            assert flag.wait(10), f"no batch {op} started"
            workers[victim].kill()
            load.wait_ops(8)  # the pool keeps serving
        report = load.report
        assert not report.wrong, f"wrong bytes for {report.wrong[:5]}"
        assert report.slowest_s <= BOUND_S
        assert all("PoolUnavailable" in e for e in report.errors), report.errors
        if replication == 2:
            assert not report.errors, "with R=2 one dead worker must cost neither a put nor a read"
        with bounded(BOUND_S * 4, "the verification pass"):
            hits, misses = read_all(c, report.committed)
        owner = {k: rank(k.encode(), ids)[0] for k in report.committed}
        if replication == 2:
            assert _evictions(c) == 0  # so a miss would be a lost block
            assert not misses, f"{len(misses)} committed blocks lost with R=2"
        else:
            assert misses, "the victim's blocks cannot still be served with R=1"
            assert all(owner[k] == ids[victim] for k in misses), "a block of a live worker was lost"
            assert any(owner[k] != ids[victim] for k in hits)
        # and new work lands (R=1: on the keys the survivors own)
        fresh = [f"after-{i}" for i in range(24)]
        live = [k for k in fresh if replication == 2 or rank(k.encode(), ids)[0] != ids[victim]]
        c.batch_put(live, [b"x" * 100] * len(live))
        assert c.batch_exists(live) == [True] * len(live)


def test_kill_9_under_threads_sharing_one_client(nats, spawn):
    """An engine's threads share one PoolClient: a worker dying under all of them at once costs
    nothing with R=2, and leaves no connection behind (unclosed sockets fail the run as warnings)."""
    workers = _cluster(nats, spawn)
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, node_id="client-node",
                    timeout_s=TIMEOUT_S) as c:
        wait_members(c, 3)
        loads = [Load(c, f"t{i}", batch=8, size=4 << 10, bound_s=BOUND_S, seed=i) for i in range(4)]
        for load in loads:
            load.__enter__()
        try:
            for load in loads:
                load.wait_ops(6)
            workers[0].kill()
            for load in loads:
                load.wait_ops(6)
        finally:
            reports = [load.stop() for load in loads]
        assert _evictions(c) == 0  # so a miss would be a lost block
        for r in reports:
            assert not r.wrong and not r.errors, (r.wrong[:3], r.errors[:3])
            assert read_all(c, r.committed)[1] == []
    gc.collect()


def test_a_frozen_worker_costs_a_bounded_wait_not_a_hang(nats, spawn):
    """SIGSTOP: the worker's sockets stay open but nothing answers (a hung machine, not a dead one)."""
    workers = _cluster(nats, spawn)
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, node_id="client-node",
                    timeout_s=TIMEOUT_S) as c:
        wait_members(c, 3)
        keys = [f"f{i}" for i in range(48)]
        c.batch_put(keys, [block(k, 64 << 10) for k in keys])
        freeze(workers[2].proc.pid)
        try:
            with bounded(BOUND_S, "a read with a frozen owner"):
                _, misses = read_all(c, dict.fromkeys(keys, 64 << 10))
            assert not misses  # the replicas answered
            with bounded(BOUND_S, "a put with a frozen owner"):
                c.batch_put(["g0", "g1"], [b"a", b"b"])
        finally:
            os.kill(workers[2].proc.pid, signal.SIGCONT)
    # in local mode the same freeze is a typed timeout
    freeze(workers[1].proc.pid)
    try:
        with PoolClient(mode="local", worker=workers[1].address, timeout_s=1.0) as one, \
                bounded(3.0, "a local-mode call to a frozen worker"), pytest.raises(PoolUnavailable):
            one.get("f0")
    finally:
        os.kill(workers[1].proc.pid, signal.SIGCONT)
    with PoolClient(mode="local", worker=workers[1].address, timeout_s=5) as one:
        assert one.batch_exists(["f0"]) in ([True], [False])  # it serves again

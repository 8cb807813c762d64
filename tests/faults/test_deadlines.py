"""One deadline per call: a cluster call asks the owners in parallel and returns within `timeout_s`
however many of them hang (it used to wait `timeout_s` for each hung owner in turn)."""
from __future__ import annotations

import os
import signal
import time

from kvpool.core.client import PoolClient
from kvpool.core.cluster import rank

from faulthelp import block, wait_members, worker_id
from sigstop import freeze

TIMEOUT_S = 2.0
SLACK_S = 0.2 * TIMEOUT_S + 0.5  # the 20% the issue allows, plus thread hand-off on a busy 2-core box


def test_hung_owners_cost_one_deadline_not_one_each(nats, spawn) -> None:
    workers = [spawn(nats_url=nats.url) for _ in range(3)]
    ids = [worker_id(w) for w in workers]
    keys = [f"d{i}" for i in range(60)]
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=TIMEOUT_S) as c:
        wait_members(c, 3)
        c.batch_put(keys, [block(k, 4096) for k in keys])
        owner = {k: rank(k.encode(), ids)[0] for k in keys}
        alive = ids[0]
        assert {owner[k] for k in keys} == set(ids), "the keys must span every worker"
        for w in workers[1:]:
            freeze(w.proc.pid)
        try:
            for call in ("get", "lease", "exists", "stats"):
                t0 = time.monotonic()
                if call == "get":
                    sizes = c.batch_get_into(keys, [bytearray(4096) for _ in keys])
                    assert [k for k, n in zip(keys, sizes) if n > 0] == [k for k in keys if owner[k] == alive]
                elif call == "lease":
                    c.backend.fanout._suspect.clear()  # type: ignore[attr-defined]
                    with c.batch_lease(keys) as views:
                        hits = [k for k, v in zip(keys, views) if v is not None]
                    assert hits == [k for k in keys if owner[k] == alive]
                elif call == "exists":
                    c.backend.fanout._suspect.clear()  # type: ignore[attr-defined]  # ask the hung workers again, as after their 2 s
                    assert c.batch_exists(keys) == [owner[k] == alive for k in keys]
                else:
                    c.backend.fanout._suspect.clear()  # type: ignore[attr-defined]
                    assert c.stats().workers[alive].error is None
                elapsed = time.monotonic() - t0
                assert elapsed <= TIMEOUT_S + SLACK_S, f"{call} took {elapsed:.1f} s with two hung owners"
        finally:
            for w in workers[1:]:
                os.kill(w.proc.pid, signal.SIGCONT)


def test_a_hung_primary_leaves_its_replica_time_within_the_same_deadline(nats, spawn) -> None:
    workers = [spawn(nats_url=nats.url) for _ in range(2)]
    ids = [worker_id(w) for w in workers]
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=TIMEOUT_S, replication=2) as c:
        wait_members(c, 2)
        keys = [k for k in (f"p{i}" for i in range(80)) if rank(k.encode(), ids)[0] == ids[1]][:20]
        c.batch_put(keys, [block(k, 4096) for k in keys])
        freeze(workers[1].proc.pid)  # every key's primary
        try:
            t0 = time.monotonic()
            sizes = c.batch_get_into(keys, [bytearray(4096) for _ in keys])
            elapsed = time.monotonic() - t0
        finally:
            os.kill(workers[1].proc.pid, signal.SIGCONT)
    assert sizes == [4096] * len(keys), "the replica must answer"
    assert elapsed <= TIMEOUT_S + SLACK_S, f"the read took {elapsed:.1f} s"

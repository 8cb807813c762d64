"""nats-server stops and comes back under load. The control plane is not on the data path: clients
keep using the last member list they saw (data keeps flowing to the workers), reconnect when NATS
returns, and converge on the new membership (a worker that joins, one that leaves)."""
from __future__ import annotations

import time

from kvpool.core.client import PoolClient

from faulthelp import Load, read_all, wait_members

RECOVER_S = 20.0
OUTAGE_S = 11.0  # past the clients' 10 s member TTL: silence from NATS must not empty the member list


def test_nats_restart_under_load(nats, spawn):
    workers = [spawn(nats_url=nats.url, node_id=f"node{i}") for i in range(2)]
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="client", timeout_s=3) as c:
        wait_members(c, 2)
        with Load(c, "n", batch=8, size=32 << 10) as load:
            load.wait_ops(10)
            nats.stop()
            down_at = time.monotonic()
            before = load.ops_done()
            while time.monotonic() - down_at < OUTAGE_S:
                load.wait_ops(4)
            assert len(c.members()) == 2
            errors_while_down = list(load.report.errors)
            nats.start()
            load.wait_ops(10)
            joined = spawn(nats_url=nats.url, node_id="node2")
            wait_members(c, 3, timeout=5)
            load.wait_ops(10)
            assert workers[0].stop() == 0, workers[0].log_tail()  # a worker that leaves is dropped
            wait_members(c, 2, timeout=5)
            load.wait_ops(10)
        report = load.report
        assert load.ops_done() - before > 0
        assert not errors_while_down, errors_while_down[:3]
        assert not report.wrong
        assert all("PoolUnavailable" in e for e in report.errors), report.errors[:3]
        assert report.slowest_s < 8
        hits, _ = read_all(c, report.committed)  # exact or miss
        assert hits
        # Workers that could not heartbeat past their TTL serve misses until they have caught up from
        # their peers (they may hold blocks written elsewhere meanwhile); then the pool serves again.
        deadline = time.monotonic() + RECOVER_S
        while True:
            c.batch_put(["after"], [b"restart"])
            if c.get("after") == b"restart":
                break
            assert time.monotonic() < deadline, f"no hit {RECOVER_S} s after NATS came back"
            time.sleep(0.2)
        assert joined.proc.poll() is None

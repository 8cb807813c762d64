"""A worker whose NATS node is cut off (no FIN, no answer: a pulled cable) fails over to another node of
the cluster and is heard through it before its member entry lapses: the clients never drop it."""
from __future__ import annotations

import time

from nats_nodes import HOSTS, Relay, ThreeNodes

from kvpool.core.cluster import Membership

TTL_S = 10.0  # the default member TTL
HEARTBEAT_S = 2.0  # the default heartbeat


def test_a_worker_cut_off_from_its_nats_node_is_heard_through_another_within_the_ttl(nodes: ThreeNodes) -> None:
    for i in range(3):
        nodes.start(i)
    for i in range(3):
        nodes.wait_listening(i)
    relays = [Relay((h, nodes.port)) for h in HOSTS]  # the worker reaches every node through a cable we can cut
    watcher = worker = None
    try:
        worker = Membership(",".join(r.url for r in relays), ttl_s=TTL_S, connect_timeout_s=20, role="worker")
        worker.register("w-cut", lambda: {"tcp": "127.0.0.1:1"}, heartbeat_s=HEARTBEAT_S)
        watcher = Membership(nodes.url, ttl_s=TTL_S, connect_timeout_s=20)  # straight to the nodes
        watcher.watch()
        assert watcher.wait_for(lambda m: "w-cut" in m, 10)
        (carrying,) = [r for r in relays if r.carried]
        time.sleep(HEARTBEAT_S * 1.5)  # the cut comes at any phase of the beat
        cut_at, cut_wall = time.monotonic(), time.time()
        carrying.cut()
        heard = False  # a heartbeat stamped after the cut: it came through another node
        while time.monotonic() < cut_at + TTL_S + HEARTBEAT_S:
            members = watcher.members()
            assert "w-cut" in members, f"the worker was dropped {time.monotonic() - cut_at:.1f} s after the cut"
            heard = heard or members["w-cut"].ts > cut_wall
            time.sleep(0.1)
        assert heard, "no heartbeat came through another node after the cut"
        assert sum(r.carried for r in relays if r is not carrying) == 1, "it failed over to another node"
    finally:
        for m in (watcher, worker):
            if m is not None:
                m.close()
        for r in relays:
            r.close()

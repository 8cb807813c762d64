"""Membership against a real nats-server: who is live, and who was heard from (what a worker back from
an absence asks for the changes it missed)."""
from __future__ import annotations

import time

from kvpool.core.cluster import Membership


def test_a_worker_that_left_is_still_heard_since_before_it_left(nats):
    watcher = Membership(nats.url, ttl_s=3.0, role="worker")
    try:
        watcher.watch()
        before = time.monotonic()
        peer = Membership(nats.url, ttl_s=3.0, role="worker")
        try:
            peer.register("w-peer", lambda: {"tcp": "127.0.0.1:1"}, heartbeat_s=0.5)
            assert watcher.wait_for(lambda m: "w-peer" in m, 5)
        finally:
            peer.close()  # deletes its entry: no longer a member
        assert watcher.wait_for(lambda m: "w-peer" not in m, 5)
        heard = watcher.heard_since(before)
        assert list(heard) == ["w-peer"] and heard["w-peer"].tcp == "127.0.0.1:1"  # it may have taken writes
        assert watcher.heard_since(time.monotonic()) == {}  # nothing heard since it left
        peer.close()  # a second close does nothing
    finally:
        watcher.close()

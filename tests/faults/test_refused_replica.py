"""A replica that refuses a newer block (no room: every slot of its arena pinned) keeps the older one; the
put, stored by the key's other owner, tells it to drop that, so it is never served once the newer block
is gone from the other owner (evicted)."""
from __future__ import annotations

import time

from kvpool.core.client import PoolClient

from faulthelp import SMALL_DRAM, block, is_block_of, poll, wait_members, worker_id

SIZE = 64 << 10


def test_a_replica_that_refused_a_newer_block_never_serves_the_older_one(nats, spawn) -> None:
    roomy = spawn(nats_url=nats.url, node_id="n0", dram_bytes="4MiB", env=SMALL_DRAM)
    full = spawn(nats_url=nats.url, node_id="n1", dram_bytes="4MiB", env=SMALL_DRAM)
    key = "k"
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, timeout_s=5, node_id="client") as c:
        wait_members(c, 2)
        c.put(key, block(key, SIZE, 1), pin_s=2.0)  # on both owners, held there for 2 s
        with PoolClient(mode="local", worker=full.address, timeout_s=5) as direct:
            for i in range(200):  # every other slot of `full` pinned for long: no room for a newer block
                try:
                    direct.put(f"pin{i}", block(f"pin{i}", SIZE), pin_s=600.0)
                except Exception:
                    break
        c.put(key, block(key, SIZE, 2))  # stored by `roomy` (`full` has no room for it): acknowledged
        poll(lambda: c.backend.missed.pending() == 0, 3.0)
    time.sleep(2.5)  # the first block's pin ends: nothing holds it but `full`'s own LRU order
    with PoolClient(mode="local", worker=roomy.address, timeout_s=5) as direct:
        for i in range(0, 120, 20):  # the newer block is evicted from `roomy`'s 4 MiB
            direct.batch_put([f"e{i + j}" for j in range(20)], [block(f"e{i + j}", SIZE) for j in range(20)])
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, timeout_s=5, node_id="reader") as r:
        wait_members(r, 2)
        assert worker_id(full) in r.members()
        got = r.get(key)
    assert got is None or is_block_of(key, got, 2), "a reader was served the block's older version"

"""Adversarial checks of cluster mode (R=2) against stale reads: replicas paused, restarted on their state,
left out of writes, with ordinary eviction on the other replica. Real processes: nats-server and workers."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "faults"))

from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from faulthelp import block, wait_members, worker_id
from sigstop import freeze

SIZE = 64 << 10
FAST = {"KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "0", "KVPOOL_MEMBER_TTL_S": "3",
        "KVPOOL_HEARTBEAT_S": "0.5"}


def _cluster_client(nats, node_id: str = "client", timeout_s: float = 1.0) -> PoolClient:
    return PoolClient(mode="cluster", nats_url=nats.url, replication=2, node_id=node_id, timeout_s=timeout_s)


def test_a_replica_stopped_right_after_a_stall_serves_nothing_it_missed_after_its_restart(nats, spawn, arena_only):
    """R=2. The second replica is paused (SIGSTOP) while a key is overwritten: the client leaves it out and
    the put is acknowledged by the first replica alone. The writer then closes (what it owed the paused
    replica is dropped, as documented: the worker's own stall watch is meant to catch up instead). The
    paused replica is stopped cleanly as it resumes (SIGTERM, e.g. a rolling restart) and comes back on its
    SSD state: its catch-up asks its peers only for what changed since its *stop*, not since its stall, so
    it keeps and serves the old version. Once the first replica evicts the newer block (ordinary eviction
    of its small DRAM), a cluster read returns the overwritten bytes. Expected: the new version or a miss."""
    spawn(nats_url=nats.url, node_id="node1", dram_bytes="4MiB", env=FAST)  # DRAM only, small
    second = spawn(nats_url=nats.url, node_id="node2", dram_bytes="16MiB", ssd=True, env=FAST)
    key = "k"
    # the writer is on the second replica's node, its puts through shared memory (`arena_only`): the put the
    # paused replica misses is not left whole in its socket for it to take as it resumes
    with _cluster_client(nats, node_id="node2") as writer:
        wait_members(writer, 2)
        writer.put(key, block(key, SIZE, 1))
        freeze(second.proc.pid)
        put_at = time.monotonic()
        writer.put(key, block(key, SIZE, 2))  # acknowledged by the first replica; the paused one left out
    # paused 5.5 s, under the clients' member TTL (10 s); longer than a catch-up at its restart reaches back
    time.sleep(max(0.0, put_at + 5.5 - time.monotonic()))
    os.kill(second.proc.pid, signal.SIGTERM)  # stopped as it resumes
    os.kill(second.proc.pid, signal.SIGCONT)
    assert second.stop(timeout=15) == 0, second.log_tail()
    back = WorkerProcess(second.state_dir, nats_url=nats.url, node_id="node2", ssd=True, dram_bytes="16MiB",
                         env=FAST).wait_ready()
    try:
        with _cluster_client(nats) as reader:
            wait_members(reader, 2)
            assert worker_id(back) in reader.members()
            time.sleep(3.0 + 1.0)  # its settle fence (member TTL) and second catch-up
            # ordinary load evicts the newer block from the first replica's 4 MiB of DRAM
            filler = [f"fill{i}" for i in range(160)]
            for i in range(0, len(filler), 16):
                reader.batch_put(filler[i:i + 16], [block(k, SIZE) for k in filler[i:i + 16]])
            got = reader.get(key)
            assert got is None or got == block(key, SIZE, 2), "the cluster served the overwritten version"
    finally:
        back.stop(timeout=5)

"""d51ecd8: a cluster's connection for a member refuses another worker answering at the member's address
(`Connection.expect_id`), so that no put placed by a lingering member entry lands on a worker that does
not own its key. The fan-out's connections set it; a producer's same-node stager (`Stagers.for_keys`,
the streams handoff's put) makes its own connection to the owner's Unix socket and must refuse such a
worker too."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.core.client import PoolClient
from kvpool.core.cluster_backend import ClusterBackend
from kvpool.core.errors import PoolUnavailable
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.core.shm_stage import Stagers
from kvpool.core.transport import connect

SMALL = {"KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "0"}


def test_a_stager_never_puts_into_another_worker_at_a_lingering_members_address(nats, tmp_path: Path) -> None:
    procs = [WorkerProcess(tmp_path / "w", nats_url=nats.url, dram_bytes="16MiB", env=SMALL).wait_ready()]
    try:
        _check(nats, procs)
    finally:
        for p in procs:
            p.stop(timeout=5)


def _check(nats: NatsServer, procs: list[WorkerProcess]) -> None:
    first = procs[0]
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as pool:
        backend = pool.backend
        assert isinstance(backend, ClusterBackend)
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        (old_id,) = pool.members()
        first.kill()  # kill -9: its member entry lingers for the member TTL (10 s)
        again = WorkerProcess(first.state_dir, nats_url=nats.url, dram_bytes="16MiB", env=SMALL, port=first.port)
        procs.append(again)
        again.wait_ready()
        assert again.unix_path == first.unix_path
        assert pool.wait_for_members(lambda m: len(m) == 2 and old_id in m, 15)
        new_id = next(w for w in pool.members() if w != old_id)
        live = pool.members()
        # a key the lingering entry still owns
        key = next(k for k in (f"k{i}".encode() for i in range(1000))
                   if backend._owners([k], live)[0] == [old_id])
        with pytest.raises(PoolUnavailable):  # the ordinary put is refused there (d51ecd8) ...
            pool.batch_put([key], [b"o" * 4096])
        stagers = Stagers(pool)  # ... and the stager's must be too
        try:
            try:
                stager = stagers.for_keys([key], [4096])
                assert stager is not None  # the sole owner is the (dead) old worker, on this node
                places, _ = stager.put([key], [memoryview(b"s" * 4096)])
                stagers.settle()
            except PoolUnavailable as e:  # refused, as the ordinary put is
                assert "that member entry is stale" in str(e)
                places = []
            assert old_id in pool.members(), "the test's window (the old entry's TTL) ran out"
            landed = [p.worker for p in places]
            probe = connect(again.unix_path)
            try:
                held = probe.batch_exists([key])
            finally:
                probe.close()
            assert new_id not in landed and held == [False], (
                f"the put of {key!r}, placed on {old_id} by its lingering entry, landed on {new_id}, "
                "the worker restarted at its address, which does not own the key")
        finally:
            stagers.close()


def test_a_local_stager_follows_its_worker_through_a_restart(tmp_path: Path) -> None:
    """Local mode names one worker, whatever its id: after it restarts (a DRAM-only worker takes a new id),
    staged puts reach the new one, and read back as put (the old arena is never written)."""
    w = WorkerProcess(tmp_path / "w", dram_bytes="16MiB", env=SMALL).wait_ready()
    again: WorkerProcess | None = None
    try:
        with PoolClient(mode="local", worker=w.unix_path, timeout_s=5) as pool:
            stagers = Stagers(pool)
            try:
                stager = stagers.for_keys([b"a"], [4096])
                assert stager is not None
                stager.put([b"a"], [memoryview(b"1" * 4096)])
                stagers.settle()
                w.kill()
                again = WorkerProcess(w.state_dir, dram_bytes="16MiB", env=SMALL, port=w.port).wait_ready()
                for attempt in range(3):  # the first may fail on the dead connection
                    try:
                        stager = stagers.for_keys([b"b"], [4096])
                        assert stager is not None
                        stager.put([b"b"], [memoryview(b"2" * 4096)])
                        stagers.settle()
                        break
                    except PoolUnavailable:
                        assert attempt < 2
                for attempt in range(3):  # (the pool's own connection, too, may find the old worker gone)
                    try:
                        assert pool.get("b") == b"2" * 4096
                        break
                    except PoolUnavailable:
                        assert attempt < 2
            finally:
                stagers.close()
    finally:
        for p in (w, again):
            if p is not None:
                p.stop(timeout=5)

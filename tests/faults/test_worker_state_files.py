"""What a worker keeps in the state dir. One without an SSD tier kept its id and its alive and
held-since stamps there per TCP port, and nothing removed them: tests and benches start workers on random
ports, so the user's state dir held 2,950 such files. Now such a worker keeps none (a restart holds no
block: nothing needs to outlive it), a start removes what dead workers left there and never a live
one's, and a worker with an SSD tier keeps its id beside its SSD tier."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvpool.core.cache import TieredCache
from kvpool.core.catch_up import catch_up
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.procs import WorkerProcess
from kvpool.core.records import WorkerInfo
from kvpool.core.server import Worker
from kvpool.core.transport import connect

from faulthelp import worker_id

SMALL = {"KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "0"}
_PER_PORT = re.compile(r"worker-\d+\.(sock|id|alive|held)")


def _per_port(folder: Path) -> set[str]:
    """The files in `folder` that a worker names by its TCP port (not the test's worker logs)."""
    return {n for n in os.listdir(folder) if _PER_PORT.fullmatch(n)}


def _small_worker(**cfg: object) -> Worker:
    return Worker(WorkerConfig(port=0, heartbeat_s=0.2, **cfg),  # type: ignore[arg-type]
                  CacheConfig(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False))


def test_a_worker_without_an_ssd_tier_leaves_no_file_by_its_port(nats, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """In process and as `kvpool worker` (SIGTERM), in a cluster and holding a block: its socket while it
    runs, nothing once it has stopped."""
    state = tmp_path / "state"
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(state))
    w = _small_worker(nats_url=nats.url).start()
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=5) as c:
            c.put("held", b"x" * 1000)
        assert w.info()["held_since"] > 0  # told while it holds a block (that time was kept per port)
        assert _per_port(state) == {f"worker-{w.port}.sock"}
    finally:
        w.stop()
    assert _per_port(state) == set()

    p = WorkerProcess(tmp_path / "p", nats_url=nats.url, dram_bytes="16MiB", env=SMALL).wait_ready()
    try:
        with PoolClient(mode="local", worker=p.address, timeout_s=5) as c:
            c.put("held", b"x" * 1000)
            assert c.members()  # a HELLO: its held-since told
    finally:
        assert p.stop() == 0, p.log_tail()
    assert _per_port(p.state_dir) == set()


def test_a_start_removes_what_dead_workers_left_and_keeps_a_live_ones(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed worker's socket, and the per-port files of earlier releases by a port nothing listens on,
    go at the next start; those by a live worker's port, an SSD tier's id and other files stay."""
    state = tmp_path / "state"
    live = WorkerProcess(state, dram_bytes="16MiB", env=SMALL).wait_ready()
    ssd = WorkerProcess(state, dram_bytes="16MiB", ssd=True, env=SMALL).wait_ready()
    killed = WorkerProcess(state, dram_bytes="16MiB", env=SMALL).wait_ready()
    try:
        ssd_id = worker_id(ssd)
        killed.kill()
        assert (state / f"worker-{killed.port}.sock").exists()  # a kill -9 leaves it
        for port in (live.port, killed.port):  # as a worker of an earlier release left them
            for suffix in ("id", "alive", "held"):
                (state / f"worker-{port}.{suffix}").write_text("1\n")
        monkeypatch.setenv("KVPOOL_STATE_DIR", str(state))
        w = _small_worker().start()
        w.stop()
        assert _per_port(state) == {f"worker-{live.port}.{s}" for s in ("sock", "id", "alive", "held")} | \
            {f"worker-{ssd.port}.sock"}
        assert (state / "ssd" / "kvpool-worker-id").read_text().strip() == ssd_id
        assert (state / f"worker-{killed.port}.log").exists()  # not a worker's own: the test's
        with PoolClient(mode="local", worker=live.address, timeout_s=5) as c:
            assert c.batch_exists(["k"]) == [False]  # still serving, at its socket too
        with PoolClient(mode="local", worker=live.unix_path, timeout_s=5) as c:
            assert c.batch_exists(["k"]) == [False]
    finally:
        for p in (live, ssd, killed):
            p.stop()


def test_a_worker_with_an_ssd_tier_keeps_its_id_and_one_without_takes_a_new_one(tmp_path: Path) -> None:
    """The id follows the SSD tier's blocks (placement sends it their keys again); a worker without one
    holds nothing after a restart, on the same port too, and keeps no id."""
    first = WorkerProcess(tmp_path / "s", dram_bytes="16MiB", ssd=True, env=SMALL).wait_ready()
    try:
        wid = worker_id(first)
    finally:
        assert first.stop() == 0
    again = WorkerProcess(tmp_path / "s", dram_bytes="16MiB", ssd=True, env=SMALL).wait_ready()
    try:
        assert worker_id(again) == wid
        assert (tmp_path / "s" / "ssd" / "kvpool-worker-id").read_text().strip() == wid
    finally:
        assert again.stop() == 0

    dram = WorkerProcess(tmp_path / "d", dram_bytes="16MiB", env=SMALL).wait_ready()
    try:
        wid = worker_id(dram)
    finally:
        assert dram.stop() == 0
    same_port = WorkerProcess(tmp_path / "d", dram_bytes="16MiB", env=SMALL, port=dram.port).wait_ready()
    try:
        assert worker_id(same_port) != wid
    finally:
        assert same_port.stop() == 0
    assert _per_port(tmp_path / "d") == set()


def test_a_named_worker_without_an_ssd_tier_vouches_only_for_what_came_after_its_last_run(
        nats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--worker-id` with no SSD tier: a restart under the name does not claim to know what its last run
    accepted (a peer catching up from it would keep what that run replaced), on any port. Its stamp is
    kept by name, one file, not by port."""
    state = tmp_path / "state"
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(state))
    token = None
    for run in range(2):
        w = _small_worker(nats_url=nats.url, worker_id="rack1-w7").start()
        token = w.token
        try:
            conn = connect(w.address, token)
            try:
                _, _, covered = conn.changes(0)
            finally:
                conn.close()
            assert (covered > 0) == (run == 1), covered  # the first run under the name: no earlier one
        finally:
            w.stop()
        assert _per_port(state) == set()
        assert {n for n in os.listdir(state) if n.startswith("worker-")} == {"worker-id-rack1-w7.alive"}


def test_a_catch_up_takes_another_worker_at_a_peers_address_as_no_answer(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that left, its port now another worker's (a restart without an SSD tier takes a new id):
    that one cannot tell what the peer accepted, so the catch-up fails (its caller drops its blocks)."""
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "state"))
    w = _small_worker().start()
    cache = TieredCache(CacheConfig(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False))
    try:
        def peer(wid: str) -> dict[str, WorkerInfo]:
            return {wid: WorkerInfo(worker_id=wid, node_id="elsewhere", tcp=w.address)}

        assert catch_up(cache, peer(w.worker_id), 0, token=w.token, node_id="here")
        assert not catch_up(cache, peer("gone"), 0, token=w.token, node_id="here")
    finally:
        cache.close()
        w.stop()


def test_a_client_never_takes_another_worker_at_a_members_address_for_it(tmp_path: Path) -> None:
    """A worker killed and restarted at its address under a new id while its old member entry lingers:
    a cluster's connection for the old entry is refused there (PoolUnavailable, nothing sent), so no put
    the old entry's ranking placed lands on a worker that does not own its key."""
    from kvpool.core.errors import PoolUnavailable

    w = _small_worker(unix_path=str(tmp_path / "w.sock")).start()
    try:
        for address in (w.unix_path, w.address):
            stale = connect(address)
            stale.expect_id = "the-worker-that-was-here"
            with pytest.raises(PoolUnavailable, match="stale"):
                stale.batch_put([b"k"], [b"v" * 64])
            stale.close()
            right = connect(address)
            right.expect_id = w.worker_id
            right.batch_put([b"k"], [b"v" * 64])
            right.close()
        assert w.cache.stats().dram_blocks == 1  # the right one's put only
    finally:
        w.stop()

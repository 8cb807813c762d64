"""Block events on NATS: replayable from JetStream, they rebuild what every worker holds; a worker
asked for events it cannot publish fails to start with a clear error."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np

from kvpool.core import PoolClient

from evhelp import replay


def test_replayed_events_rebuild_what_the_pool_holds(nats, spawn) -> None:
    for _ in range(2):
        spawn(nats_url=nats.url, extra=["--events"])
    keys = [f"r/{i}" for i in range(40)]
    with PoolClient(mode="cluster", nats_url=nats.url) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 2, 15)
        pool.batch_put(keys, [np.full(4096, i, dtype=np.uint8) for i in range(len(keys))])
        pool.batch_remove(keys[:10])
        workers = set(pool.members())
        expected = {k.encode() for k in keys[10:]}  # events are ordered per worker: wait for both
        index = replay(nats.url, {k.encode() for k in keys}, lambda ix: ix.keys() == expected)
        assert all(tiers == {"dram"} for tiers in index.held.values())
        assert {w for (w, _) in index.held} == workers  # both workers published
        assert all(len(index.workers(k.encode())) == 1 for k in keys[10:])
        assert all(pool.batch_exists([k.decode() for k in index.keys()]))
        pool.clear()
        index = replay(nats.url, {k.encode() for k in keys} | {b"*"}, lambda ix: not ix.keys())
        assert sum(1 for (w, _) in index.held) == 0  # each worker's clear emptied its part


def test_events_need_a_cluster(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvpool.core.cli", "worker", "--port", "0", "--dram-bytes", "16MiB",
                           "--events"], env={**os.environ, "KVPOOL_STATE_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "ConfigError: events on NATS (--events) need the worker in a cluster (--nats-url)" in done.stderr


def test_kvpool_events_prints_batches_as_json_lines(nats, spawn) -> None:
    spawn(nats_url=nats.url, extra=["--events"])
    with PoolClient(mode="cluster", nats_url=nats.url) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        pool.put("printed/1", b"x")
        tail = subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "events", "--nats-url", nats.url, "--replay"],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert tail.stdout is not None
            # the worker's boot starts with `cleared` (forget what an earlier boot of it announced); the
            # put comes in a later batch
            lines = [json.loads(tail.stdout.readline())]
            while ["stored", "dram", "", "printed/1"] not in lines[-1]["events"] and len(lines) < 10:
                lines.append(json.loads(tail.stdout.readline()))
        finally:
            tail.send_signal(signal.SIGTERM)
            rc = tail.wait(10)
            tail.stdout.close()  # type: ignore[union-attr]
    assert rc == 0
    assert lines[0]["seq"] == 0 and lines[0]["events"][0] == ["cleared", "", "", "*"]
    assert ["stored", "dram", "", "printed/1"] in lines[-1]["events"]
    assert [line["seq"] for line in lines] == list(range(len(lines))) and lines[-1]["lost"] == 0


def test_a_restarted_worker_announces_what_its_ssd_tier_kept(nats, tmp_path) -> None:
    from kvpool.core.events import EventFeed
    from kvpool.core.procs import WorkerProcess

    keys = [f"kept/{i}" for i in range(20)]
    first = WorkerProcess(tmp_path / "w", nats_url=nats.url, ssd=True, dram_bytes="64MiB", extra=["--events"])
    try:
        first.wait_ready()
        with PoolClient(mode="cluster", nats_url=nats.url) as pool:
            assert pool.wait_for_members(lambda m: len(m) == 1, 15)
            pool.batch_put(keys, [np.full(4096, i, dtype=np.uint8) for i in range(len(keys))])
    finally:
        assert first.stop() == 0  # SIGTERM: DRAM flushed to the SSD tier
    with EventFeed(nats.url) as feed:  # from now on: only the restarted worker's announcements
        second = WorkerProcess(tmp_path / "w", nats_url=nats.url, ssd=True, dram_bytes="64MiB", extra=["--events"])
        try:
            second.wait_ready()
            announced: set[bytes] = set()
            while not {k.encode() for k in keys} <= announced:
                batch = feed.next_batch(15)
                assert batch is not None, "the restarted worker did not announce its SSD blocks"
                announced |= {e.key for e in batch.events if (e.kind, e.tier) == ("stored", "ssd")}
        finally:
            second.stop()


def test_a_small_jetstream_store_gets_a_smaller_events_stream(tmp_path, spawn) -> None:
    """JetStream's file store defaults to what nats-server finds free on its disk: on a nearly full
    disk it could not reserve the stream's 1 GiB, and every worker asked for events refused to start."""
    import nats as nats_py

    from kvpool.core.aio import LoopThread
    from kvpool.core.events import STREAM
    from kvpool.core.nats_server import NatsServer

    server = NatsServer(tmp_path / "small", port=0, max_file_store=300 << 20).start()
    try:
        w = spawn(nats_url=server.url, extra=["--events"])
        assert "it keeps the last 256 MiB of events" in w.log_tail(4000)
        with PoolClient(mode="cluster", nats_url=server.url) as pool:
            assert pool.wait_for_members(lambda m: len(m) == 1, 15)
            pool.put("small/1", b"x")
        index = replay(server.url, {b"small/1"}, lambda ix: ix.keys() == {b"small/1"})
        assert index.keys() == {b"small/1"}

        async def stream_bytes() -> int:
            nc = await nats_py.connect(server.url)
            try:
                return int((await nc.jetstream().stream_info(STREAM)).config.max_bytes)
            finally:
                await nc.close()

        io = LoopThread("t")
        try:
            assert io.run(stream_bytes(), timeout=10) == 256 << 20
        finally:
            io.stop()
    finally:
        server.stop()

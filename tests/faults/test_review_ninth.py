"""Ninth adversarial review: the fixes of 924acec (full-disk handling: stale_among, a refused clear drops
all, STORAGE / ITEM_STORAGE answers) and b11fbfa (PUT runs and quotas, BUSY, displacement, worker ids)."""
from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path

import pytest

from kvpool.core.client import PoolClient
from kvpool.core.errors import StorageError
from kvpool.core.procs import WorkerProcess

from faulthelp import SMALL_DRAM, block, is_block_of

SIZE = 64 << 10


def _full_disk_worker(state: Path) -> tuple[WorkerProcess, list[str]]:
    """A worker whose SSD tier holds blocks and whose disk is then full (RLIMIT_FSIZE at data.mdb's size);
    the keys put before it filled."""
    w = WorkerProcess(state, ssd=True, dram_bytes="4MiB", env=SMALL_DRAM).wait_ready()  # type: ignore[arg-type]
    keys = [f"d{i}" for i in range(300)]
    with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
        for i in range(0, 120, 20):  # 7.5 MiB through a 4 MiB arena: most go to SSD
            c.batch_put(keys[i:i + 20], [block(k, SIZE) for k in keys[i:i + 20]])
        time.sleep(0.5)
        full = (state / "ssd" / "data.mdb").stat().st_size
        resource.prlimit(w.proc.pid, resource.RLIMIT_FSIZE, (full, full))
        for i in range(120, 300, 20):
            c.batch_put(keys[i:i + 20], [block(k, SIZE) for k in keys[i:i + 20]])
    return w, keys


# Bug: a remove of a block that never had an SSD copy marks it stale all the same (TierStack.remove:
# ssd.mark_stale(gone) for DRAM-only keys too); on a full disk the key stays queued, and from then on
# every put of that key (TierStack.commit: ssd.stale_among) is refused with StorageError ("a full disk
# kept the older SSD copy it replaces") though no SSD copy of it exists: the README promises
# StorageError only for an overwriting put "whose older SSD copies the full disk will not let go".
def test_a_put_of_a_key_that_never_reached_ssd_is_not_refused_on_a_full_disk(tmp_path: Path) -> None:
    state = tmp_path / "w"
    w, keys = _full_disk_worker(state)
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            with pytest.raises(StorageError):  # a backlog of SSD copies the full disk will not delete
                c.clear()
            c.put("fresh", block("fresh", SIZE))  # a new key: DRAM only (demotions do not fit)
            try:
                c.remove("fresh")
            except StorageError:
                pass  # (refused for the other keys' backlog: not this bug)
            refused = []
            for v in (1, 2, 3):
                try:
                    c.put("fresh", block("fresh", SIZE, v))
                except StorageError as e:
                    refused.append(str(e))
            got = c.get("fresh")
    finally:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.kill()
    assert got is not None and is_block_of("fresh", got, 3)
    assert refused == [], f"{len(refused)} puts of a key with no SSD copy were refused: {refused[:1]}"


# Bug: SUPERSEDE is one-way (protocol.ONE_WAY: the client reads no reply), but a full disk makes its
# removal raise StorageError and ConnectionServing._dispatch answers it with a STORAGE reply all the same;
# the client takes that stray reply for the answer of its next request on the connection (a wrong
# request id: ProtocolError, the connection dropped, PoolUnavailable): an innocent call fails, and in
# cluster mode the worker is marked down (the README: a full disk's refusal keeps the connection).
def test_a_refused_supersede_leaves_no_stray_reply_on_the_connection(tmp_path: Path) -> None:
    from kvpool.core.connection import Connection
    from kvpool.core.versions import CLOCK

    state = tmp_path / "w"
    w, keys = _full_disk_worker(state)
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            with pytest.raises(StorageError):  # a backlog of SSD copies the full disk will not delete
                c.batch_remove(keys[:100])
            held = [k for k in keys[100:] if c.exists(k)]
        assert held, "no block left on the worker"
        conn = Connection(w.address, timeout_s=10)
        try:
            before = conn.stats()
            conn.supersede([k.encode() for k in held], CLOCK.batch(len(held)))  # (one way: no reply)
            after = conn.stats()  # the next request on that connection
        finally:
            conn.close()
    finally:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.kill()
    assert before is not None and after is not None


# Bug: a cluster worker that restarts on blocks it cannot vouch for (no alive stamp, or a catch-up that
# failed) drops them all (Worker._catch_up_at_start / _catch_up -> cache.drop_all); on a full disk that
# clear now drops every block all the same and then raises StorageError (924acec), which Worker.start
# does not catch: the worker does not start at all (a crash loop under a supervisor), where the drop
# alone left it safe to serve misses ("a worker that cannot catch up serves misses").
def test_a_worker_that_must_drop_its_blocks_at_start_on_a_full_disk_still_starts(tmp_path: Path, nats) -> None:
    state = tmp_path / "w"
    opts = dict(nats_url=nats.url, ssd=True, dram_bytes="4MiB", env=SMALL_DRAM)
    w = WorkerProcess(state, **opts).wait_ready()  # type: ignore[arg-type]
    keys = [f"s{i}" for i in range(160)]
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            for i in range(0, len(keys), 20):  # 10 MiB through a 4 MiB arena: most go to SSD
                c.batch_put(keys[i:i + 20], [block(k, SIZE) for k in keys[i:i + 20]])
            time.sleep(0.5)
    finally:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.kill()
    for stamp in (state / "ssd").glob("*.alive"):  # a run that left no alive stamp: its blocks' age unknown
        stamp.unlink()
    full = (state / "ssd" / "data.mdb").stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (full, hard))  # the restarted worker's disk is full
    try:
        w = WorkerProcess(state, **opts)  # type: ignore[arg-type]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        try:
            w.wait_ready(timeout=30)
        except Exception as e:
            log = w.log_path.read_text(errors="replace")[-600:]
            raise AssertionError(f"the worker did not start on a full disk ({e}): {log}") from None
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            hits = [k for k in keys if c.get(k) is not None]
    finally:
        w.kill()
    assert hits == [], f"{len(hits)} blocks of unknown age served"

"""The machine goes down under a worker (kill -9, its shared memory gone) and comes back with the
SSD tier on disk: every block that had reached SSD is served again, exactly; nothing else is wrong."""
from __future__ import annotations

from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from faulthelp import block, is_block_of, read_all

SIZE = 64 << 10
WORKER = dict(ssd=True, dram_bytes="4MiB", env={"KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "0"})


def _ssd_blocks(c: PoolClient) -> int:
    return c.stats().total.ssd_blocks


def test_kill_9_then_restart_from_the_ssd_tier(tmp_path):
    keys = {f"m{i}": SIZE for i in range(200)}  # 12.5 MiB through a 4 MiB arena: most are demoted
    w = WorkerProcess(tmp_path / "w", **WORKER).wait_ready()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            names = list(keys)
            for i in range(0, len(names), 20):
                c.batch_put(names[i:i + 20], [block(k, SIZE) for k in names[i:i + 20]])
            on_ssd = _ssd_blocks(c)
    finally:
        w.kill()  # no flush: what is only in DRAM is lost, as in a power cut
    assert on_ssd > 100
    w = WorkerProcess(tmp_path / "w", **WORKER).wait_ready()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            assert _ssd_blocks(c) >= on_ssd
            hits, _ = read_all(c, keys)  # exact or miss
            assert len(hits) >= on_ssd
            assert c.stats().total.checksum_failures == 0
    finally:
        w.stop()


def test_a_key_overwritten_just_before_a_kill_9_is_never_served_older_after_the_restart(tmp_path):
    """Its older copy on SSD is deleted before the overwrite returns: a kill -9 right after it, with the
    worker busy demoting other blocks to SSD, leaves a miss (the new block was in DRAM only), never the
    older version. (An adversarial check found 10 of 40 keys served old in 4 of 8 runs when the demoter
    deleted the older copies after the put had returned.)"""
    keys = [f"o{i}" for i in range(40)]
    filler = [f"f{i}" for i in range(120)]
    w = WorkerProcess(tmp_path / "w", **WORKER).wait_ready()  # type: ignore[arg-type]
    with PoolClient(mode="local", worker=w.address) as c:
        c.batch_put(keys, [block(k, SIZE, 0) for k in keys])
    w.stop()  # (SIGTERM: DRAM flushed, so each key's version 0 is on SSD)
    w = WorkerProcess(tmp_path / "w", **WORKER).wait_ready()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            for i in range(0, len(filler), 20):  # the demoter busy writing them to SSD
                c.batch_put(filler[i:i + 20], [block(k, SIZE) for k in filler[i:i + 20]])
            c.batch_put(keys, [block(k, SIZE, 1) for k in keys])
    finally:
        w.kill()
    w = WorkerProcess(tmp_path / "w", **WORKER).wait_ready()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            got = [c.get(k) for k in keys]
    finally:
        w.stop()
    old = [k for k, g in zip(keys, got) if g is not None and not is_block_of(k, g, 1)]
    assert old == [], f"{len(old)} of {len(keys)} keys served at the version they were overwritten from"

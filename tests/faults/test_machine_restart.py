"""The machine goes down under a worker (kill -9, its shared memory gone) and comes back with the
SSD tier on disk: every block that had reached SSD is served again, exactly; nothing else is wrong."""
from __future__ import annotations

from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from faulthelp import block, read_all

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

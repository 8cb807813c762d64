"""A worker restarted on its SSD tier with a smaller largest block (`dram_slab_size`, e.g. an
operator lowering KVPOOL_DRAM_SLAB_SIZE): the tier still holds blocks larger than any DRAM slot now.
Promoting one asks DRAM for a slot of a size class it does not have. The promise: a miss (or a
typed error), the worker serving every other block, never an untyped failure or a dead connection; and
lookups agree with reads (such blocks are dropped as the tier opens)."""
from __future__ import annotations

from kvpool.core import TieredCache
from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from faulthelp import block

MiB = 1 << 20


def test_an_ssd_block_larger_than_the_reopened_caches_max_block_is_a_miss(tmp_path):
    ssd = str(tmp_path / "ssd")
    with TieredCache(dram_bytes=32 * MiB, dram_slab_size=4 * MiB, prefault=False, ssd_path=ssd) as cache:
        cache.put("big", block("big", 3 * MiB))
        cache.put("small", block("small", 4096))
        cache.flush()
    with TieredCache(dram_bytes=8 * MiB, dram_slab_size=1 * MiB, prefault=False, ssd_path=ssd) as cache:
        assert cache.get("small") == block("small", 4096)
        assert cache.get("big") is None  # IndexError from DramArena._take once
        assert cache.batch_get_into(["big"], [bytearray(4 * MiB)]) == [-1]
        # and no lookup says present what every get misses (an engine would plan to load it)
        assert cache.batch_exists(["small", "big"]) == [True, False]
        assert cache.prefix_match(["small", "big"]) == 1
    with TieredCache(dram_bytes=32 * MiB, dram_slab_size=4 * MiB, prefault=False, ssd_path=ssd) as cache:
        assert cache.get("big") is None  # dropped from the tier, not kept unreadable
        assert cache.get("small") == block("small", 4096)


def test_a_worker_restarted_with_a_smaller_max_block_serves_the_rest(tmp_path):
    state = tmp_path / "w"
    big = WorkerProcess(state, ssd=True, dram_bytes="64MiB", env={"KVPOOL_DRAM_SLAB_SIZE": str(4 * MiB)}).wait_ready()
    try:
        with PoolClient(mode="local", worker=big.address) as c:
            c.batch_put(["big", "small"], [block("big", 3 * MiB), block("small", 4096)])
    finally:
        assert big.stop() == 0, big.log_tail()
    w = WorkerProcess(state, ssd=True, dram_bytes="64MiB", env={"KVPOOL_DRAM_SLAB_SIZE": str(1 * MiB)}).wait_ready()
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=5) as c:
            got = c.batch_get_into(["small", "big"], [bytearray(4096), bytearray(4 * MiB)])
            assert got[0] == 4096 and got[1] == -1, got
            assert c.get("small") == block("small", 4096)
        assert w.proc.poll() is None
    finally:
        w.stop()

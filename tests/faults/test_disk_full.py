"""The SSD tier runs out of room: a small LMDB map, or a disk quota that fails writes mid-file. Puts
keep working (DRAM evicts; blocks that cannot be demoted are dropped, counted), every read is exact
or a miss, blocks already on SSD stay readable, and a SIGTERM flush into the full disk exits cleanly."""
from __future__ import annotations

import resource

import pytest

from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from faulthelp import block, read_all

SIZE = 64 << 10
SMALL_DRAM = {"KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "0"}


def _stats(c: PoolClient) -> dict[str, int]:
    return c.stats().total.as_dict()


def _fill_and_check(w: WorkerProcess, n: int) -> dict[str, int]:
    """Put `n` blocks (several times the DRAM arena), then read each one that is present."""
    keys = {f"d{i}": SIZE for i in range(n)}
    with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
        names = list(keys)
        for i in range(0, n, 16):
            c.batch_put(names[i:i + 16], [block(k, SIZE) for k in names[i:i + 16]])
        newest = dict.fromkeys(names[-16:], SIZE)
        assert read_all(c, newest)[1] == []  # in DRAM
        # one key at a time (the single-key path): exact (from SSD, or promoted) or a miss; a block seen
        # present a moment before may be a miss by now (demotions still trim the SSD tier for room)
        older = [c.get(k) for k in names[:-16]]
        assert all(got is None or got == block(k, SIZE) for k, got in zip(names, older)), "wrong bytes"
        assert any(got is not None for got in older), "no block on SSD was readable"
        read_all(c, keys)  # exact or miss
        stats = _stats(c)
    assert w.proc.poll() is None
    return stats


@pytest.mark.parametrize("limit", ["map_size", "quota"])
def test_a_full_ssd_drops_blocks_cleanly(tmp_path, limit):
    state = tmp_path / "w"
    extra = ["--ssd-map-size", "2MiB"] if limit == "map_size" else []
    w = WorkerProcess(state, ssd=True, dram_bytes="4MiB", extra=extra, env=SMALL_DRAM).wait_ready()
    try:
        if limit == "quota":  # writes past 3 MiB into any file fail, as on a full disk
            resource.prlimit(w.proc.pid, resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))
        stats = _fill_and_check(w, 300)
        assert stats["ssd_blocks"] > 0 and stats["dropped"] + stats["ssd_evictions"] > 0, stats
        assert w.stop() == 0, w.log_tail()  # the flush into a full SSD is clean
    finally:
        w.kill()
    assert "Traceback" not in w.log_path.read_text(), w.log_tail()
    w = WorkerProcess(state, ssd=True, dram_bytes="4MiB", extra=extra, env=SMALL_DRAM).wait_ready()
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            hits, _ = read_all(c, {f"d{i}": SIZE for i in range(300)})  # exact or miss
            assert hits, "nothing committed to the SSD tier survived the restart"
            c.put("more", b"still serving")
            assert c.get("more") == b"still serving"
    finally:
        w.stop()

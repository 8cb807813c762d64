"""Core: DRAM put/get_into vs memcpy, SSD put/cold get vs raw file I/O, prefix_match over 4096 keys.

DRAM figures use a working set larger than the CPU caches, in a pre-faulted arena, against numpy
copies of the same bytes between pre-faulted buffers. SSD figures compare LMDB batches (one
transaction and one fsync per 64 blocks) with raw pwrite + fdatasync per 64 blocks; the cold read
drops both files from the page cache (posix_fadvise DONTNEED) and reads through a freshly opened
cache, so it includes checksum verification and promotion to DRAM.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import numpy as np

from ..cache import TieredCache
from .measure import best_seconds, emit, filled, gbps

__all__ = ["add_arguments", "run"]

_BATCH = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--working-set", default=None, help="bytes per DRAM measurement (default 256MiB, 128MiB quick)")
    p.add_argument("--dir", default=None, help="directory for the SSD files (default: a temp dir)")


def _dram(block: int, total: int, repeat: int) -> dict[str, float]:
    n = total // block
    src = filled(n * block, 1).reshape(n, block)
    dst = np.zeros_like(src)
    keys = [f"dram-{block}-{i}" for i in range(n)]
    with TieredCache(dram_bytes=2 * n * block + (64 << 20), dram_slab_size=max(4 << 20, block)) as cache:
        def copy_all() -> None:
            for i in range(n):
                np.copyto(dst[i], src[i])

        def put_all() -> None:
            for i in range(n):
                cache.put(keys[i], src[i])

        def get_all() -> None:
            for i in range(n):
                cache.get_into(keys[i], dst[i])

        put_all()  # warm: fault in the slots and the index
        get_all()
        copy_all()
        t_copy = best_seconds(copy_all, repeat)
        t_put = best_seconds(put_all, repeat)
        t_get = best_seconds(get_all, repeat)
        assert np.array_equal(dst, src), "DRAM round trip returned different bytes"
    return {"memcpy": gbps(total, t_copy), "put": gbps(total, t_put), "get": gbps(total, t_get)}


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _ssd(block: int, total: int, root: str) -> dict[str, float]:
    import time

    n = total // block
    src = filled(n * block, 2).reshape(n, block)
    raw_path = os.path.join(root, f"raw-{block}.bin")
    lmdb_dir = os.path.join(root, f"lmdb-{block}")

    t = time.perf_counter()
    fd = os.open(raw_path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    try:
        for i in range(n):
            os.pwrite(fd, src[i], i * block)
            if (i + 1) % _BATCH == 0 or i == n - 1:
                os.fdatasync(fd)
    finally:
        os.close(fd)
    t_file_put = time.perf_counter() - t

    cfg: dict[str, Any] = dict(dram_bytes=(n + 8) * block + (64 << 20), dram_slab_size=max(4 << 20, block),
                               ssd_path=lmdb_dir, ssd_map_size=4 * total + (256 << 20))
    keys = [f"ssd-{block}-{i}" for i in range(n)]
    with TieredCache(**cfg) as cache:
        assert cache.ssd is not None
        t = time.perf_counter()
        for i in range(0, n, _BATCH):
            cache.ssd.store.batch_put((keys[j].encode(), _meta(src[j]), memoryview(src[j]))
                                     for j in range(i, min(i + _BATCH, n)))
        t_ssd_put = time.perf_counter() - t
        data_file = str(cache.ssd.store.data_file())

    dst = np.zeros_like(src)
    _drop_page_cache(raw_path)
    t = time.perf_counter()
    fd = os.open(raw_path, os.O_RDONLY)
    try:
        for i in range(n):
            os.preadv(fd, [dst[i]], i * block)
    finally:
        os.close(fd)
    t_file_get = time.perf_counter() - t
    assert np.array_equal(dst, src)

    dst[:] = 0
    _drop_page_cache(data_file)
    with TieredCache(**cfg) as cache:  # a restart: every block is on SSD only
        t = time.perf_counter()
        for i in range(n):
            cache.get_into(keys[i], dst[i])
        t_ssd_get = time.perf_counter() - t
        assert cache.stats().hits_ssd == n
    assert np.array_equal(dst, src), "SSD round trip returned different bytes"
    return {"file_put": gbps(total, t_file_put), "put": gbps(total, t_ssd_put),
            "file_get": gbps(total, t_file_get), "get": gbps(total, t_ssd_get)}


def _meta(data: np.ndarray) -> Any:
    from ..blocks import BlockMeta, checksum

    return BlockMeta(data.nbytes, checksum(data.data))


def _prefix_match(repeat: int) -> float:
    from ..keys import block_keys

    keys = block_keys(np.arange(4096 * 16), 16, "bench")
    with TieredCache(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False) as cache:
        cache.batch_put(keys, [b"x"] * len(keys))
        assert cache.prefix_match(keys) == len(keys)
        return best_seconds(lambda: cache.prefix_match(keys), repeat) * 1e6


def run(args: argparse.Namespace) -> int:
    from ..config import parse_size

    total = parse_size(args.working_set) if args.working_set else (128 << 20 if args.quick else 256 << 20)
    ssd_total = 64 << 20 if args.quick else 256 << 20
    repeat = 3 if args.quick else 5
    metrics: dict[str, Any] = {"block_sizes": ["1MiB", "64KiB"], "dram_working_set_bytes": total,
                               "ssd_bytes": ssd_total}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvpool-bench-") as root:
        for block, tag in ((1 << 20, ""), (64 << 10, "_64k")):
            d = _dram(block, total, repeat)
            s = _ssd(block, ssd_total, root)
            metrics.update({f"memcpy{tag}_gbps": round(d["memcpy"], 2), f"dram_put{tag}_gbps": round(d["put"], 2),
                            f"dram_get{tag}_gbps": round(d["get"], 2), f"file_write{tag}_gbps": round(s["file_put"], 2),
                            f"ssd_put{tag}_gbps": round(s["put"], 2), f"file_read{tag}_gbps": round(s["file_get"], 2),
                            f"ssd_get{tag}_gbps": round(s["get"], 2)})
            ratios.update({f"dram_put_vs_memcpy{tag}": d["put"] / d["memcpy"],
                           f"dram_get_vs_memcpy{tag}": d["get"] / d["memcpy"],
                           f"ssd_put_vs_file{tag}": s["put"] / s["file_put"],
                           f"ssd_get_vs_file{tag}": s["get"] / s["file_get"]})
    metrics["prefix_match_4096_us"] = round(_prefix_match(repeat * 10), 1)
    emit("core", metrics, ratios, args.json, notes="ratios without a suffix are for 1 MiB blocks")
    return 0

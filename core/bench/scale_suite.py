"""Scale: 4 KiB puts, index bytes per key, SSD flush and reopen, prefix_match at 10^4-10^6 keys.

Puts of 4 KiB blocks are compared with copying the same blocks into a dict; prefix_match over a chain
of 4096 keys, with 10^4, 10^5 (and, without --quick, 10^6) keys present in DRAM, with a plain dict
lookup loop over the same keys. An SSD tier of N 4 KiB blocks (10^5 quick, 10^6 full: `--keys`) is
flushed from DRAM, closed (its index saved beside LMDB) and reopened; its reopen is compared with a
raw LMDB key-only scan of the same environment, and timed again with the saved index removed (the
scan after a crash). The close after the flush includes the fsync of what it wrote (ssd_sync off).
Index bytes per key are tracemalloc's growth over the index of 20 000 blocks. `full_gc_ms_at_*`: one
full collection of the cyclic garbage collector with that many blocks in DRAM. `class_shift_*`: puts of
256 KiB blocks into a DRAM tier full of the largest level's count of 64-byte blocks, each taking a slab
from their class, against the same puts into free room.
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import tempfile
import time
import tracemalloc
from typing import Any

import lmdb
import numpy as np

from ..cache import TieredCache
from ..keys import block_keys
from ..tiers import ssd_index
from ..tiers.ssd import SsdStore
from ..tiers.ssd_tier import SsdTier
from .measure import best_seconds, emit, filled, gbps

__all__ = ["add_arguments", "run"]

_CHAIN = 4096
_SMALL = 4 << 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", type=int, default=None, help="4 KiB blocks in the reopened SSD tier "
                   "(default 1000000, 100000 with --quick)")
    p.add_argument("--dir", default=None, help="directory for the SSD tier (default: a temp dir)")


def _chain() -> list[str]:
    return block_keys(np.arange(_CHAIN * 16), 16, "scale")


def _small_puts(n: int, repeat: int) -> dict[str, float]:
    """4 KiB puts in batches of 256: kvpool's rate and that of copying the blocks into a dict."""
    src = filled(n * _SMALL, 3).reshape(n, _SMALL)
    keys = [f"small-{i}" for i in range(n)]
    blocks = list(src)
    with TieredCache(dram_bytes=2 * n * _SMALL + (64 << 20), dram_slab_size=4 << 20) as cache:
        def put_all() -> None:
            for i in range(0, n, 256):
                cache.batch_put(keys[i:i + 256], blocks[i:i + 256])

        def dict_all() -> None:
            d = {}
            for k, b in zip(keys, blocks):
                d[k] = b.tobytes()

        put_all()
        t_put = best_seconds(put_all, repeat)
        t_dict = best_seconds(dict_all, repeat)
        assert cache.get(keys[-1]) == blocks[-1].tobytes()
    return {"put": n / t_put, "dict": n / t_dict, "put_gbps": gbps(n * _SMALL, t_put)}


def _index_bytes_per_key(root: str) -> dict[str, float]:
    """tracemalloc's growth per key over the DRAM index of 20 000 1-byte blocks, and over the SSD
    index of the same blocks reopened (keys as `block_keys` makes them: 64 hex characters)."""
    n = 20_000
    keys = block_keys(np.arange(n * 4), 4, "bytes-per-key")
    path = os.path.join(root, "per-key")
    cfg: dict[str, Any] = dict(dram_bytes=n * 256 + (16 << 20), dram_slab_size=1 << 20, prefault=False,
                               ssd_path=path, ssd_map_size=1 << 30, ssd_sync=False)
    def dram_index() -> float:
        with TieredCache(**cfg) as cache:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(0, n, 4096):
                cache.batch_put(keys[i:i + 4096], [b"x"] * len(keys[i:i + 4096]))
            grown = tracemalloc.get_traced_memory()[0] - before
            cache.flush()
        return grown / n

    def ssd_index() -> float:
        store = SsdStore(path, map_size=1 << 30, sync=False)
        try:
            before = tracemalloc.get_traced_memory()[0]
            tier = SsdTier(store, "lru")
            grown = tracemalloc.get_traced_memory()[0] - before
            assert len(tier) == n
        finally:
            store.close()
        return grown / n

    gc.collect()
    tracemalloc.start()
    try:
        dram = dram_index()
        gc.collect()
        ssd = ssd_index()
    finally:
        tracemalloc.stop()
    return {"dram": dram, "ssd": ssd}


def _prefix_match(present: int, repeat: int) -> dict[str, float]:
    """prefix_match over the chain with `present` 1-byte blocks in DRAM (the chain among them), against
    a dict lookup loop over the same keys, microseconds; and a full collection of the cyclic garbage
    collector with those blocks indexed (`gc_ms`: how long a worker of that many blocks stops for one)."""
    chain = _chain()
    others = [f"other-{i:09d}" for i in range(present - _CHAIN)]
    with TieredCache(dram_bytes=present * 256 + (64 << 20), dram_slab_size=1 << 20, prefault=False) as cache:
        for i in range(0, len(others), 4096):
            cache.batch_put(others[i:i + 4096], [b"x"] * len(others[i:i + 4096]))
        cache.batch_put(chain, [b"x"] * _CHAIN)
        assert cache.prefix_match(chain) == _CHAIN
        table = dict.fromkeys(k.encode() for k in others)
        table.update(dict.fromkeys(k.encode() for k in chain))

        def dict_loop() -> int:
            for i, k in enumerate(chain):
                if k.encode() not in table:
                    return i
            return len(chain)

        t_pm = best_seconds(lambda: cache.prefix_match(chain), repeat)
        t_dict = best_seconds(dict_loop, repeat)
        t_exists = best_seconds(lambda: cache.batch_exists(chain), repeat)
        t_gc = best_seconds(gc.collect, 3)
    return {"prefix_match": t_pm * 1e6, "dict": t_dict * 1e6, "exists": t_exists * 1e6, "gc_ms": t_gc * 1e3}


def _class_shift(present: int) -> dict[str, float]:
    """Puts of 256 KiB blocks, one at a time, into a DRAM tier full of `present` 64-byte blocks whose
    recency a read of half of them (at random) has shuffled: each takes a whole slab from the small
    blocks' class. Microseconds, the median and the worst of 64 such puts, and the median of the same
    puts into free room whose pages were touched before (the baseline)."""
    small = [f"small-{i:09d}" for i in range(present)]
    big = filled(256 << 10, 5)
    slab = 1 << 20
    with TieredCache(dram_bytes=-(-present * 64 // slab) * slab, dram_slab_size=slab, prefault=False,
                     high_watermark=1.0, low_watermark=0.99) as cache:
        for i in range(0, present, 4096):
            cache.batch_put(small[i:i + 4096], [b"s" * 64] * len(small[i:i + 4096]))
        for k in np.random.default_rng(3).choice(present, present // 2, replace=False).tolist():
            cache.get(small[k])
        shifted = []
        for j in range(64):
            t = time.perf_counter()
            cache.put(f"big-{j}", big)
            shifted.append(time.perf_counter() - t)
        assert cache.get("big-63") == big.tobytes()
    with TieredCache(dram_bytes=64 * slab, dram_slab_size=slab, prefault=False) as cache:
        for j in range(64):  # the pages touched once, as the shifted puts' are
            cache.put(f"big-{j}", big)
        cache.batch_remove([f"big-{j}" for j in range(64)])
        free = []
        for j in range(64):
            t = time.perf_counter()
            cache.put(f"big-{j}", big)
            free.append(time.perf_counter() - t)
    return {"p50": float(np.median(shifted)) * 1e6, "max": max(shifted) * 1e6, "free_p50": float(np.median(free)) * 1e6}


def _key_only_scan(path: str) -> float:
    """Seconds of a raw LMDB scan of every key (values not read) of the environment at `path`."""
    env = lmdb.open(path, subdir=True, readonly=True, lock=False, readahead=False)
    try:
        t = time.perf_counter()
        with env.begin() as txn:
            n = sum(1 for _ in txn.cursor().iternext(keys=True, values=False))
        elapsed = time.perf_counter() - t
    finally:
        env.close()
    assert n > 0
    return elapsed


def _ssd(n: int, root: str, repeat: int) -> dict[str, float]:
    """Flush n 4 KiB DRAM blocks to SSD, close, reopen from the saved index, reopen by a scan, and a
    raw key-only scan; prefix_match over the chain on the reopened (SSD-only) tier."""
    chain = _chain()
    keys = chain + [f"{i:064x}" for i in range(n - _CHAIN)]  # 64 hex characters, as block_keys makes
    block = filled(_SMALL, 4)
    path = os.path.join(root, "scale-ssd")
    cfg: dict[str, Any] = dict(dram_bytes=n * _SMALL + (256 << 20), dram_slab_size=4 << 20, prefault=False,
                               ssd_path=path, ssd_map_size=3 * n * _SMALL + (1 << 30), ssd_sync=False,
                               high_watermark=0.99, low_watermark=0.98)
    out: dict[str, float] = {}
    with TieredCache(**cfg) as cache:
        for i in range(0, n, 4096):
            cache.batch_put(keys[i:i + 4096], [block] * len(keys[i:i + 4096]))
        t = time.perf_counter()
        flushed = cache.flush()
        out["flush_s"] = time.perf_counter() - t
        assert flushed == n
        t = time.perf_counter()
    out["close_s"] = time.perf_counter() - t
    reopen_cfg = {**cfg, "dram_bytes": 64 << 20}  # time the SSD index, not the making of a large arena
    for source in ("index", "scan"):
        if source == "scan":
            os.unlink(os.path.join(path, ssd_index.FILE_NAME))
        gc.collect()
        t = time.perf_counter()
        cache = TieredCache(**reopen_cfg)
        out[f"reopen_{source}_s"] = time.perf_counter() - t
        try:
            assert cache.ssd is not None and cache.ssd.opened_from == source and len(cache.ssd) == n
            if source == "index":
                assert cache.prefix_match(chain) == _CHAIN  # SSD-only blocks: LMDB is not read for this
                out["prefix_match_ssd_us"] = best_seconds(functools.partial(cache.prefix_match, chain), repeat) * 1e6
                assert cache.get(chain[-1]) == block.tobytes()
        finally:
            cache.close()
    out["key_scan_s"] = _key_only_scan(path)
    return out


def _label(n: int) -> str:
    return f"{n // 1_000_000}m" if n >= 1_000_000 and n % 1_000_000 == 0 else f"{n // 1000}k"


def run(args: argparse.Namespace) -> int:
    n_ssd = args.keys or (100_000 if args.quick else 1_000_000)
    repeat = 20 if args.quick else 50
    levels = (10_000, 100_000) if args.quick else (10_000, 100_000, 1_000_000)
    metrics: dict[str, Any] = {"small_block_bytes": _SMALL, "chain_keys": _CHAIN, "ssd_keys": n_ssd,
                               "prefix_match_levels": [_label(n) for n in levels],
                               "prefix_match_at_1m_measured": 1_000_000 in levels}
    ratios: dict[str, float] = {}
    puts = _small_puts(20_000 if args.quick else 100_000, 3 if args.quick else 5)
    metrics.update({"put_4k_blocks_per_s": round(puts["put"]), "put_4k_gbps": round(puts["put_gbps"], 2),
                    "dict_copy_4k_blocks_per_s": round(puts["dict"])})
    ratios["put_4k_vs_dict_copy"] = puts["put"] / puts["dict"]
    for present in levels:
        pm = _prefix_match(present, repeat)
        tag = _label(present)
        metrics.update({f"prefix_match_4096_us_at_{tag}": round(pm["prefix_match"], 1),
                        f"batch_exists_4096_us_at_{tag}": round(pm["exists"], 1),
                        f"dict_loop_4096_us_at_{tag}": round(pm["dict"], 1),
                        f"full_gc_ms_at_{tag}": round(pm["gc_ms"], 1)})
        ratios[f"prefix_match_vs_dict_loop_at_{tag}"] = pm["dict"] / pm["prefix_match"]
    shift = _class_shift(levels[-1])
    tag = _label(levels[-1])
    metrics.update({f"class_shift_put_256k_p50_us_at_{tag}": round(shift["p50"], 1),
                    f"class_shift_put_256k_max_us_at_{tag}": round(shift["max"], 1),
                    "put_256k_into_free_room_p50_us": round(shift["free_p50"], 1)})
    ratios[f"class_shift_put_vs_free_room_at_{tag}"] = shift["free_p50"] / shift["p50"]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvpool-bench-scale-") as root:
        per_key = _index_bytes_per_key(root)
        s = _ssd(n_ssd, root, repeat)
    per_million = 1_000_000 / n_ssd
    metrics.update({"dram_index_bytes_per_key": round(per_key["dram"]),
                    "ssd_index_bytes_per_key": round(per_key["ssd"]),
                    "flush_4k_blocks_per_s": round(n_ssd / s["flush_s"]),
                    "flush_4k_gbps": round(gbps(n_ssd * _SMALL, s["flush_s"]), 2),
                    "close_with_fsync_s_per_million": round(s["close_s"] * per_million, 3),
                    "reopen_s_per_million": round(s["reopen_index_s"] * per_million, 3),
                    "reopen_scan_s_per_million": round(s["reopen_scan_s"] * per_million, 3),
                    "lmdb_key_scan_s_per_million": round(s["key_scan_s"] * per_million, 3),
                    f"prefix_match_4096_ssd_us_at_{_label(n_ssd)}": round(s["prefix_match_ssd_us"], 1)})
    ratios["reopen_vs_lmdb_key_scan"] = s["key_scan_s"] / s["reopen_index_s"]
    ratios["reopen_vs_header_scan"] = s["reopen_scan_s"] / s["reopen_index_s"]
    emit("scale", metrics, ratios, args.json,
         notes="reopen per million keys scaled from ssd_keys; prefix_match at 1m only without --quick")
    return 0

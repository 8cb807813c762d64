"""Cache: kvtest-style cache mode: get-or-create over a key pool at a target hit rate.

Each op draws a key: with probability `hit_rate` one already created (a hit while the pool still
holds it), otherwise a new one (a miss that "computes" for `--inference-delay-ms` and then puts).
Every hit's bytes are checked. Reports achieved hit rate, throughput, latency percentiles and the
tier breakdown; `get_vs_memcpy` compares hit throughput with numpy copies of the same blocks.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import numpy as np
import xxhash

from ..client import PoolClient
from ..config import parse_size
from .measure import Progress, best_seconds, emit, filled, gbps, percentiles_us

_QS = (50, 90, 99, 99.9)
_KVTEST_KEYS = {"key_pool_size": "key_pool_size", "target_hit_rate": "hit_rate", "hit_rate": "hit_rate",
                "inference_delay_ms": "inference_delay_ms", "batch_keys_count": "batch_size"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key-pool-size", type=int, default=512, help="distinct keys kept for hits")
    p.add_argument("--hit-rate", type=float, default=0.8, help="target fraction of gets that hit")
    p.add_argument("--inference-delay-ms", type=float, default=1.0, help="simulated compute per miss")
    p.add_argument("--block-size", default="1MiB", help="bytes per block")
    p.add_argument("--batch-size", type=int, default=1, help="keys per get/put call")
    p.add_argument("--ops", type=int, default=None, help="get-or-create operations to run")
    p.add_argument("--duration", type=float, default=None, help="seconds to run (default 20, 8 with --quick)")
    p.add_argument("--config", default=None, help="a kvtest-like JSON config (key_pool_size, hit_rate, ...)")


def _apply_kvtest_config(args: argparse.Namespace) -> None:
    with open(args.config) as f:
        cfg = json.load(f)
    for src, dest in _KVTEST_KEYS.items():
        if src in cfg:
            setattr(args, dest, type(getattr(args, dest))(cfg[src]))
    if "data_sizes" in cfg:
        sizes = cfg["data_sizes"]
        args.block_size = str(sizes[0] if isinstance(sizes, list) else sizes)


def _payload(pattern: np.ndarray, key: str) -> np.ndarray:
    block = pattern.copy()
    block[:8] = np.frombuffer(xxhash.xxh64_digest(key.encode()), dtype=np.uint8)
    return block


def run(args: argparse.Namespace) -> int:
    if args.config:
        _apply_kvtest_config(args)
    block = parse_size(args.block_size)
    duration = args.duration or (8.0 if args.quick else 20.0)
    batch = max(1, args.batch_size)
    rng = random.Random(7)
    pattern = filled(block, 3)
    bufs = [np.zeros(block, dtype=np.uint8) for _ in range(batch)]
    dram = max(256 << 20, 2 * args.key_pool_size * block)
    pool: list[str] = []
    lat: dict[str, list[float]] = {"get": [], "put": [], "get_or_create": []}
    hits = gets = wrong = 0
    moved = 0
    hit_time, hit_bytes = 0.0, 0  # gets whose whole batch hit
    serial = 0
    progress = Progress(args.ops or duration, "cache")
    with PoolClient(dram_bytes=dram, dram_slab_size=max(16 << 20, block)) as client:
        start = time.perf_counter()
        done = 0
        while (done < args.ops) if args.ops else (time.perf_counter() - start < duration):
            keys = []
            for _ in range(batch):
                if pool and rng.random() < args.hit_rate:
                    keys.append(rng.choice(pool))
                else:
                    serial += 1
                    keys.append(f"bench-{serial}")
            t0 = time.perf_counter()
            sizes = client.batch_get_into(keys, bufs)
            t1 = time.perf_counter()
            lat["get"].append(t1 - t0)
            missing = [k for k, n in zip(keys, sizes) if n < 0]
            if not missing:
                hit_time += t1 - t0
                hit_bytes += sum(sizes)
            for k, n, buf in zip(keys, sizes, bufs):
                if n >= 0:
                    moved += n
                    if not np.array_equal(buf, _payload(pattern, k)):
                        wrong += 1
            gets += len(keys)
            hits += len(keys) - len(missing)
            if missing:
                time.sleep(args.inference_delay_ms / 1e3)
                blocks = [_payload(pattern, k) for k in missing]
                t2 = time.perf_counter()
                client.batch_put(missing, blocks)
                lat["put"].append(time.perf_counter() - t2)
                moved += block * len(missing)
                for k in missing:
                    if len(pool) < args.key_pool_size:
                        pool.append(k)
                    else:
                        pool[rng.randrange(len(pool))] = k
            lat["get_or_create"].append(time.perf_counter() - t0)
            done += 1
            elapsed = time.perf_counter() - start
            progress.update(done if args.ops else elapsed,
                            f"ops {done} hit {hits / gets:.1%} {gbps(moved, elapsed):.2f} GB/s")
        elapsed = time.perf_counter() - start
        progress.close()
        stats = client.stats()
    # baseline: copies of distinct blocks (as many as the key pool, up to 256 MiB) into one buffer
    n = max(1, min(args.key_pool_size, (256 << 20) // block))
    src, dst = filled(n * block, 4).reshape(n, block), bufs[0]
    memcpy = gbps(n * block, best_seconds(lambda: [np.copyto(dst, row) for row in src], 3))
    metrics: dict[str, Any] = {
        "block_bytes": block, "batch_size": batch, "ops": done, "seconds": round(elapsed, 2),
        "target_hit_rate": args.hit_rate, "hit_rate": round(hits / max(gets, 1), 4),
        "wrong_blocks": wrong, "throughput_gbps": round(gbps(moved, elapsed), 3),
        "ops_per_s": round(done / elapsed, 1),
    }
    for name, samples in lat.items():
        metrics.update({f"{name}_{q}_us": v for q, v in percentiles_us(samples, _QS).items()})
    metrics.update({f"tier_{k}": stats[k] for k in ("hits_device", "hits_dram", "hits_ssd", "misses")})
    ratios = {"get_vs_memcpy": gbps(hit_bytes, hit_time) / memcpy if hit_time else 0.0}
    emit("cache", metrics, ratios, args.json)
    return 1 if wrong else 0

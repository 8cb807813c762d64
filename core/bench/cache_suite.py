"""Cache: kvtest's cache mode: get-or-create over a key pool at a target hit rate.

The writer draws keys (`KeyDraw` steers the draw to `--hit-rate`), gets them, and on a miss
"computes" for `--inference-delay-ms`, creates the block and puts it. A block's bytes are a function
of its key (a fixed pattern headed by the key's hash), so a reader in any process or host checks what
it got without talking to the writer; the writer publishes its key window in the pool itself, under
`{namespace}/window`, for `--role reader` processes to draw from. `--role both` (the default) ends
with a second client reading back the whole window. Reports the achieved hit rate, throughput,
p50/p90/p99/p999 of get, put and get-or-create, the tier hit breakdown (pool counters over the run),
and `get_vs_memcpy`: throughput of all-hit batches against numpy copies of the same blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import numpy as np
import xxhash

from ..client import PoolClient
from ..errors import PoolTimeout
from . import cache_options
from .bench_pool import BenchPool
from .key_draw import KeyDraw
from .measure import Progress, best_seconds, emit, filled, gbps

_TICK_S = 0.5
_WAIT_FOR_WRITER_S = 30.0
_TIERS = ("hits_device", "hits_dram", "hits_ssd", "misses", "evictions", "demotions", "promotions")


def add_arguments(p: argparse.ArgumentParser) -> None:
    cache_options.add_arguments(p)


def _digest(key: str) -> bytes:
    return xxhash.xxh64_digest(key.encode())


class _Blocks:
    """Every block's content: one fixed pattern whose first 8 bytes are replaced by the key's hash."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pattern = filled(size, 3)

    def make(self, key: str) -> np.ndarray:
        block = self.pattern.copy()
        block[:8] = np.frombuffer(_digest(key), dtype=np.uint8)
        return block

    def check(self, key: str, buf: np.ndarray, n: int) -> bool:
        return (n == self.size and buf[:8].tobytes() == _digest(key)
                and np.array_equal(buf[8:n], self.pattern[8:]))


class _Tally:
    """One loop's counters, latencies, timeline and progress line."""

    def __init__(self, label: str, pool: BenchPool, blocks: _Blocks, *, ops: int | None, duration: float | None) -> None:
        self.pool, self.blocks, self.ops, self.duration = pool, blocks, ops, duration
        self.calls = self.gets = self.hits = self.wrong = self.moved = self.hit_bytes = 0
        self.hit_time = 0.0
        self.lat: dict[str, list[float]] = {}
        self.timeline: list[dict[str, float]] = []
        self.progress = Progress(ops or duration or 0, label)
        self.before = pool.totals()
        self.start = self._last_tick = time.perf_counter()
        self._last = (0, 0, 0)  # gets, hits, moved at the last tick

    def running(self) -> bool:
        if self.ops is not None:
            return self.calls < self.ops
        return time.perf_counter() - self.start < (self.duration or 0)

    def timed(self, op: str, seconds: float) -> None:
        self.lat.setdefault(op, []).append(seconds)

    def read(self, client: PoolClient, keys: list[str], bufs: list[np.ndarray]) -> list[str]:
        """Get `keys`, check every hit's bytes; the keys that missed."""
        t = time.perf_counter()
        sizes = client.batch_get_into(keys, bufs)
        seconds = time.perf_counter() - t
        self.timed("get", seconds)
        missing = [k for k, n in zip(keys, sizes) if n < 0]
        got = sum(n for n in sizes if n > 0)
        if not missing:
            self.hit_time += seconds
            self.hit_bytes += got
        self.wrong += sum(1 for k, n, b in zip(keys, sizes, bufs) if n >= 0 and not self.blocks.check(k, b, n))
        self.gets += len(keys)
        self.hits += len(keys) - len(missing)
        self.moved += got
        return missing

    def tick(self) -> bool:
        """Count one call; every `_TICK_S` add a timeline row and redraw progress. True on a tick."""
        self.calls += 1
        now = time.perf_counter()
        if now - self._last_tick < _TICK_S:
            return False
        elapsed = now - self.start  # the progress line is built per tick, not per call
        self.progress.update(self.calls if self.ops else elapsed,
                             f"ops {self.calls} hit {self.hit_rate:.1%} {gbps(self.moved, elapsed):.2f} GB/s")
        self._row(now)
        return True

    def _row(self, now: float) -> None:
        gets, hits, moved = self.gets - self._last[0], self.hits - self._last[1], self.moved - self._last[2]
        fill = self.pool.totals()
        self.timeline.append({"t_s": round(now - self.start, 3), "gbps": round(gbps(moved, now - self._last_tick), 4),
                              "hit_rate": round(hits / gets, 4) if gets else 0.0,
                              "cum_hit_rate": round(self.hit_rate, 4),
                              **{k: fill[k] for k in ("dram_bytes", "ssd_bytes", "device_bytes")}})
        self._last, self._last_tick = (self.gets, self.hits, self.moved), now

    @property
    def hit_rate(self) -> float:
        return self.hits / self.gets if self.gets else 0.0

    def finish(self) -> dict[str, Any]:
        """Close the progress line; the loop's metrics, tier counters taken over the loop."""
        now = time.perf_counter()
        self._row(now)
        self.progress.close()
        elapsed = now - self.start
        after = self.pool.totals()
        return {"ops": self.calls, "seconds": round(elapsed, 2), "gets": self.gets,
                "hit_rate": round(self.hit_rate, 4), "wrong_blocks": self.wrong,
                "throughput_gbps": round(gbps(self.moved, elapsed), 3), "ops_per_s": round(self.calls / elapsed, 1),
                **{f"tier_{k}": after[k] - self.before[k] for k in _TIERS},
                **{k: after[k] for k in ("dram_bytes", "dram_capacity", "ssd_bytes")}}


def _window_key(namespace: str) -> str:
    return f"{namespace}/window"


def _publish_window(client: PoolClient, namespace: str, run_id: str, draw: KeyDraw, block: int) -> None:
    window = {"run": run_id, "lo": draw.lo, "hi": draw.hi, "block_size": block}
    client.put(_window_key(namespace), json.dumps(window).encode())


def _read_window(client: PoolClient, namespace: str, timeout: float) -> dict[str, Any]:
    """The writer's latest key window, waiting up to `timeout` s for a writer to publish one."""
    deadline = time.monotonic() + timeout
    while True:
        raw = client.get(_window_key(namespace))
        if raw is not None and json.loads(raw)["hi"] > 0:
            return dict(json.loads(raw))
        if time.monotonic() > deadline:
            raise PoolTimeout(f"no writer published keys under namespace {namespace!r} within {timeout:.0f} s "
                              "(start `kvpool bench cache --role writer` against the same --cluster)")
        time.sleep(0.1)


def _key(namespace: str, run_id: str, number: int) -> str:
    return f"{namespace}/{run_id}/{number}"


def _write(pool: BenchPool, opts: cache_options.CacheOptions, tally: _Tally) -> dict[str, Any]:
    run_id = os.urandom(4).hex()  # fresh keys stay fresh however often a namespace is reused
    draw = KeyDraw(opts.hit_rate, opts.key_pool_size, random.Random(7))
    bufs = [np.empty(opts.block_size, dtype=np.uint8) for _ in range(opts.batch_size)]
    client = pool.client
    while tally.running():
        t0 = time.perf_counter()
        keys = [_key(opts.namespace, run_id, n) for n in draw.draw(opts.batch_size)]
        missing = tally.read(client, keys, bufs)
        draw.record(len(keys), len(keys) - len(missing))
        if missing:
            time.sleep(opts.inference_delay_ms / 1e3)
            created = list(dict.fromkeys(missing))  # a batch may draw one window key twice
            blocks = [tally.blocks.make(k) for k in created]
            t = time.perf_counter()
            client.batch_put(created, blocks)
            tally.timed("put", time.perf_counter() - t)
            tally.moved += opts.block_size * len(created)
        tally.timed("get_or_create", time.perf_counter() - t0)
        if tally.tick() and pool.url:
            _publish_window(client, opts.namespace, run_id, draw, opts.block_size)
    metrics = tally.finish()
    if pool.url:
        _publish_window(client, opts.namespace, run_id, draw, opts.block_size)
    metrics.update(target_hit_rate=opts.hit_rate, keys_created=draw.hi, key_window=[draw.lo, draw.hi])
    if opts.role == "both":
        metrics.update(_read_back(pool, opts, run_id, (draw.lo, draw.hi), tally.blocks))
    return metrics


def _read_back(pool: BenchPool, opts: cache_options.CacheOptions, run_id: str, window: tuple[int, int],
               blocks: _Blocks) -> dict[str, Any]:
    """Every key of the final window read once through a second client: what another reader sees."""
    numbers = list(range(*window))
    bufs = [np.empty(opts.block_size, dtype=np.uint8) for _ in range(opts.batch_size)]
    tally = _Tally("read back", pool, blocks, ops=None, duration=None)
    with pool.other_client() as client:
        for i in range(0, len(numbers), opts.batch_size):
            keys = [_key(opts.namespace, run_id, n) for n in numbers[i:i + opts.batch_size]]
            tally.read(client, keys, bufs[:len(keys)])
    return {"readback_keys": tally.gets, "readback_hit_rate": round(tally.hit_rate, 4),
            "readback_wrong_blocks": tally.wrong}


def _read(pool: BenchPool, opts: cache_options.CacheOptions) -> tuple[dict[str, Any], _Tally]:
    """The reader role: random gets over the writer's published window, every hit's bytes checked."""
    window = _read_window(pool.client, opts.namespace, _WAIT_FOR_WRITER_S)
    blocks = _Blocks(int(window["block_size"]))
    bufs = [np.empty(blocks.size, dtype=np.uint8) for _ in range(opts.batch_size)]
    rng = random.Random(11)
    tally = _Tally("cache reader", pool, blocks, ops=opts.ops, duration=opts.duration)
    while tally.running():
        keys = [_key(opts.namespace, window["run"], rng.randrange(window["lo"], window["hi"]))
                for _ in range(opts.batch_size)]
        tally.read(pool.client, keys, bufs)
        if tally.tick():
            window = _read_window(pool.client, opts.namespace, _WAIT_FOR_WRITER_S)
    metrics = tally.finish()
    metrics.update(hits=tally.hits, writer_run=window["run"])
    return metrics, tally


def _memcpy_gbps(block: int, blocks: int, repeat: int) -> float:
    """numpy copies of `blocks` distinct blocks into one buffer: what a hit could cost at best."""
    src, dst = filled(blocks * block, 4).reshape(blocks, block), np.empty(block, dtype=np.uint8)

    def copy_all() -> None:
        for row in src:
            np.copyto(dst, row)
    return gbps(blocks * block, best_seconds(copy_all, repeat))


def run(args: argparse.Namespace) -> int:
    opts = cache_options.resolve(args)
    dram = opts.dram_bytes or max(256 << 20, 2 * opts.key_pool_size * opts.block_size // max(opts.workers, 1))
    with BenchPool(block_size=opts.block_size, dram_bytes=dram, workers=opts.workers, cluster=opts.cluster,
                   ssd=opts.ssd) as pool:
        if opts.role == "reader":
            metrics, tally = _read(pool, opts)
        else:
            tally = _Tally(f"cache {opts.role}", pool, _Blocks(opts.block_size), ops=opts.ops, duration=opts.duration)
            metrics = _write(pool, opts, tally)
        where = pool.where
    block = tally.blocks.size
    working_set = (64 << 20) if args.quick else (256 << 20)
    memcpy = _memcpy_gbps(block, max(1, min(opts.key_pool_size, working_set // block)), 3)
    metrics = {"role": opts.role, "pool": where, "block_bytes": block, "batch_size": opts.batch_size, **metrics}
    ratios = {"get_vs_memcpy": gbps(tally.hit_bytes, tally.hit_time) / memcpy if tally.hit_time else 0.0}
    emit("cache", metrics, ratios, args.json, notes=f"{opts.role} on the {where}",
         latencies=tally.lat, timeline=tally.timeline)
    return 1 if metrics["wrong_blocks"] or metrics.get("readback_wrong_blocks") else 0

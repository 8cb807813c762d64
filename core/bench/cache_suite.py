"""Cache: kvtest's cache mode: get-or-create over a key pool at a target hit rate.

The writer draws keys (`KeyDraw` steers the draw to `--hit-rate`), gets them, and on a miss
"computes" for `--inference-delay-ms`, creates the block and puts it. A block's bytes are a function
of its key (a fixed pattern headed by the key's hash), so a reader in any process or host checks what
it got without talking to the writer; the writer publishes its key window in the pool itself, under
`{namespace}/window`, for `--role reader` processes to draw from. `--role both` (the default) ends
with a second client reading back the whole window. Reports the achieved hit rate, throughput,
p50/p90/p99/p999 of get, put and get-or-create, the tier hit breakdown (pool counters over the run),
and `get_vs_memcpy`: throughput of all-hit batches against numpy copies of the same blocks.

kvtest's multi-node mode: with an instance config (`kvtest_instance`) the run starts or joins its
instance's worker and waits for `remote_worker`; hits are then split into local and cross-node (served
by the other instance's worker), and the writer announces every created batch on a stream that readers
follow (`notify`), reading announced blocks first. A run fails (exit status 1, after its report) on a
wrong block, on a reader that received no announcement while its writer announced, and on a pairing
whose other side failed. `--threads` and `--target-qps` run several threads held to a rate; several
`data_sizes` give each key one of them; `--csv` adds kvtest's CSV rows.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from ..client import PoolClient
from ..errors import BenchError, PoolTimeout
from . import cache_options, kvtest_csv
from .bench_pool import BenchPool
from .content import BlockContent, memcpy_gbps
from .key_draw import KeyDraw
from .measure import Progress, emit, gbps
from .notify import AnnouncedSince, Notifier, NotifyReader, announce, open_notifier, open_notify_reader
from .owners import Owners
from .pacing import Pacer

__all__ = ["add_arguments", "run"]

_TICK_S = 0.5
_DEFAULT_DRAM_CAP = 1 << 30
"""Largest pool DRAM a run sizes by itself (per worker), in bytes: kvtest's key pools of 10000 blocks
would otherwise ask for tens of GiB; a larger window spills to the SSD tier or is evicted."""
_WAIT_FOR_WRITER_S = 30.0
_NOTIFY_GRACE_S = 5.0
"""How long a reader that received no announcement waits for one at its end, in seconds, when its
writer's window says some were sent while it listened (the last may still be on the way)."""
_TIERS = ("hits_device", "hits_dram", "hits_ssd", "misses", "evictions", "demotions", "promotions")


def add_arguments(p: argparse.ArgumentParser) -> None:
    cache_options.add_arguments(p)


class _Tally:
    """One loop's counters, latencies, timeline and progress line."""

    def __init__(self, label: str, pool: BenchPool, blocks: BlockContent, *, ops: int | None, duration: float | None,
                 owners: Owners | None = None) -> None:
        self.pool, self.blocks, self.ops, self.duration, self.owners = pool, blocks, ops, duration, owners
        self.calls = self.gets = self.hits = self.wrong = self.moved = self.hit_bytes = self.cross_hits = 0
        self.hit_time = 0.0
        self.lock = threading.Lock()  # threads share one tally
        self.wrong_calls = 0
        self.op_bytes: dict[str, int] = {}
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

    def timed(self, op: str, seconds: float, nbytes: int = 0) -> None:
        with self.lock:
            self.lat.setdefault(op, []).append(seconds)
            self.op_bytes[op] = self.op_bytes.get(op, 0) + nbytes

    def read(self, client: PoolClient, keys: list[str], bufs: list[np.ndarray]) -> list[str]:
        """Get `keys`, check every hit's bytes; the keys that missed."""
        t = time.perf_counter()
        sizes = client.batch_get_into(keys, bufs)
        seconds = time.perf_counter() - t
        missing = [k for k, n in zip(keys, sizes) if n < 0]
        got = sum(n for n in sizes if n > 0)
        wrong = sum(1 for k, n, b in zip(keys, sizes, bufs) if n >= 0 and not self.blocks.check(k, b, n))
        cross = self.owners.cross_node([k for k, n in zip(keys, sizes) if n >= 0]) if self.owners else 0
        self.timed("get", seconds, got)
        with self.lock:
            if not missing:
                self.hit_time += seconds
                self.hit_bytes += got
            self.wrong += wrong
            self.wrong_calls += bool(wrong)
            self.gets += len(keys)
            self.hits += len(keys) - len(missing)
            self.cross_hits += cross
            self.moved += got
        return missing

    def tick(self) -> bool:
        """Count one call; every `_TICK_S` add a timeline row and redraw progress. True on a tick
        (for one of the threads)."""
        with self.lock:
            self.calls += 1
            now = time.perf_counter()
            if now - self._last_tick < _TICK_S:
                return False
            elapsed = now - self.start  # the progress line is built per tick, not per call
            self.progress.update(self.calls if self.ops else elapsed,
                                 f"ops {self.calls} hit {self.hit_rate:.1%} {gbps(self.moved, elapsed):.2f} GB/s")
            self._row(now)
        if self.owners is not None:
            self.owners.refresh()
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
        split = {"cross_node_hits": self.cross_hits, "local_hits": self.hits - self.cross_hits} if self.owners else {}
        return {"ops": self.calls, "seconds": round(elapsed, 2), "gets": self.gets,
                "hit_rate": round(self.hit_rate, 4), "wrong_blocks": self.wrong, **split,
                "throughput_gbps": round(gbps(self.moved, elapsed), 3), "ops_per_s": round(self.calls / elapsed, 1),
                **{f"tier_{k}": after[k] - self.before[k] for k in _TIERS},
                **{k: after[k] for k in ("dram_bytes", "dram_capacity", "ssd_bytes")}}


def _window_key(namespace: str) -> str:
    return f"{namespace}/window"


def _publish_window(client: PoolClient, namespace: str, run_id: str, draw: KeyDraw, sizes: list[int], seq: int,
                    announced: int | None) -> None:
    """The writer's key window for readers; `seq` counts the writer's publishes of it, `announced` its
    announcements so far (None: it announces none)."""
    window = {"run": run_id, "lo": draw.lo, "hi": draw.hi, "block_size": max(sizes), "sizes": sizes, "seq": seq,
              **({"announced": announced} if announced is not None else {})}
    client.put(_window_key(namespace), json.dumps(window).encode())


def _read_window(client: PoolClient, namespace: str, timeout: float,
                 writer_failed: Callable[[], str | None] = lambda: None) -> dict[str, Any]:
    """The writer's latest key window, waiting up to `timeout` s for a writer to publish one (BenchError
    as soon as `writer_failed` says why the writer failed)."""
    deadline = time.monotonic() + timeout
    next_check = time.monotonic() + 1.0
    while True:
        raw = client.get(_window_key(namespace))
        if raw is not None and json.loads(raw)["hi"] > 0:
            return dict(json.loads(raw))
        if time.monotonic() > next_check:
            why = writer_failed()
            if why:
                raise BenchError(f"no keys of a writer under namespace {namespace!r} to read: {why}")
            next_check = time.monotonic() + 1.0
        if time.monotonic() > deadline:
            raise PoolTimeout(f"no writer published keys under namespace {namespace!r} within {timeout:.0f} s "
                              "(start `kvpool bench cache --role writer` against the same --cluster)")
        time.sleep(0.1)


def _key(namespace: str, run_id: str, number: int) -> str:
    return f"{namespace}/{run_id}/{number}"


def _in_threads(pool: BenchPool, threads: int, loop: Callable[[PoolClient], None]) -> None:
    """Run `loop(client)` in `threads` threads, each with its own client of the pool where it has
    several (one client serializes its calls to a worker); the first error is raised after all end."""
    if threads == 1:
        loop(pool.client)
        return
    errors: list[BaseException] = []

    def guarded(client: PoolClient) -> None:
        try:
            loop(client)
        except BaseException as e:
            errors.append(e)

    with ExitStack() as stack:
        clients = [pool.client] + [stack.enter_context(pool.other_client()) for _ in range(threads - 1)]
        workers = [threading.Thread(target=guarded, args=(c,), name=f"kvtest-{i}") for i, c in enumerate(clients)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    if errors:
        raise errors[0]


def _write(pool: BenchPool, opts: cache_options.CacheOptions, tally: _Tally,
           notifier: Notifier | None) -> dict[str, Any]:
    run_id = os.urandom(4).hex()  # fresh keys stay fresh however often a namespace is reused
    draw = KeyDraw(opts.hit_rate, opts.key_pool_size, random.Random(7))
    shared = threading.Lock()  # the key draw and the notifier serve every thread
    pacer = Pacer(opts.target_qps)
    published = 0

    def publish(client: PoolClient) -> None:  # (holding `shared`)
        nonlocal published
        published += 1
        _publish_window(client, opts.namespace, run_id, draw, opts.sizes, published,
                        notifier.sent if notifier is not None else None)

    def loop(client: PoolClient) -> None:
        bufs = [np.empty(tally.blocks.size, dtype=np.uint8) for _ in range(opts.batch_size)]
        while tally.running():
            pacer.wait()
            t0 = time.perf_counter()
            with shared:
                keys = [_key(opts.namespace, run_id, n) for n in draw.draw(opts.batch_size)]
            missing = tally.read(client, keys, bufs)
            with shared:
                draw.record(len(keys), len(keys) - len(missing))
            if missing:
                time.sleep(opts.inference_delay_ms / 1e3)
                created = list(dict.fromkeys(missing))  # a batch may draw one window key twice
                blocks = [tally.blocks.make(k) for k in created]
                t = time.perf_counter()
                client.batch_put(created, blocks)
                nbytes = sum(b.nbytes for b in blocks)
                tally.timed("put", time.perf_counter() - t, nbytes)
                with tally.lock:
                    tally.moved += nbytes
                if notifier is not None:
                    with shared:
                        announce(notifier, run_id, created)
            tally.timed("get_or_create", time.perf_counter() - t0)
            if tally.tick() and pool.url:
                with shared:
                    publish(client)

    _in_threads(pool, opts.threads, loop)
    metrics = tally.finish()
    if pool.url:
        publish(pool.client)
    metrics.update(target_hit_rate=opts.hit_rate, keys_created=draw.hi, key_window=[draw.lo, draw.hi])
    if notifier is not None:
        metrics.update(notifications_sent=notifier.sent)
    if opts.role == "both":
        metrics.update(_read_back(pool, opts, run_id, (draw.lo, draw.hi), tally.blocks))
    return metrics


def _read_back(pool: BenchPool, opts: cache_options.CacheOptions, run_id: str, window: tuple[int, int],
               blocks: BlockContent) -> dict[str, Any]:
    """Every key of the final window read once through a second client: what another reader sees."""
    numbers = list(range(*window))
    bufs = [np.empty(blocks.size, dtype=np.uint8) for _ in range(opts.batch_size)]
    tally = _Tally("read back", pool, blocks, ops=None, duration=None)
    with pool.other_client() as client:
        for i in range(0, len(numbers), opts.batch_size):
            keys = [_key(opts.namespace, run_id, n) for n in numbers[i:i + opts.batch_size]]
            tally.read(client, keys, bufs[:len(keys)])
    return {"readback_keys": tally.gets, "readback_hit_rate": round(tally.hit_rate, 4),
            "readback_wrong_blocks": tally.wrong}


def _read(pool: BenchPool, opts: cache_options.CacheOptions, owners: Owners | None,
          notes: NotifyReader | None) -> tuple[dict[str, Any], _Tally, str | None]:
    """The reader role: gets of what the writer announced (when it announces), else random gets over
    its published window; every hit's bytes checked. Also why the run failed, if no announcement
    arrived while the writer announced (None otherwise)."""
    window = _read_window(pool.client, opts.namespace, _WAIT_FOR_WRITER_S, pool.peer_failed)
    announced = AnnouncedSince()
    announced.saw(window)
    blocks = BlockContent([int(s) for s in window.get("sizes") or [window["block_size"]]])
    tally = _Tally("cache reader", pool, blocks, ops=opts.ops, duration=opts.duration, owners=owners)
    pacer = Pacer(opts.target_qps)
    shared = threading.Lock()
    notified = {"gets": 0, "hits": 0}
    if notes is not None:
        notes.run = window["run"]

    def loop(client: PoolClient) -> None:
        nonlocal window
        bufs = [np.empty(blocks.size, dtype=np.uint8) for _ in range(opts.batch_size)]
        rng = random.Random(11 + threading.get_ident() % 1000)
        while tally.running():
            pacer.wait()
            first = notes.take(opts.batch_size) if notes is not None else []
            w = window
            keys = first + [_key(opts.namespace, w["run"], rng.randrange(w["lo"], w["hi"]))
                            for _ in range(opts.batch_size - len(first))]
            missing = set(tally.read(client, keys, bufs))
            if first:
                with shared:
                    notified["gets"] += len(first)
                    notified["hits"] += sum(1 for k in first if k not in missing)
            if tally.tick():
                window = _read_window(client, opts.namespace, _WAIT_FOR_WRITER_S, pool.peer_failed)
                with shared:
                    announced.saw(window)
                    if notes is not None:
                        notes.run = announced.run

    _in_threads(pool, opts.threads, loop)
    metrics = tally.finish()
    metrics.update(hits=tally.hits, writer_run=window["run"])
    failure = None
    if notes is not None:
        last = pool.client.get(_window_key(opts.namespace))  # (gone with a writer's worker that left: the one seen)
        sent = announced.since(json.loads(last) if last is not None else window)
        deadline = time.monotonic() + _NOTIFY_GRACE_S
        while sent and not notes.received and time.monotonic() < deadline:
            time.sleep(0.1)
        metrics.update(notes.metrics(), notified_gets=notified["gets"], notified_hits=notified["hits"])
        if sent and not notes.received:
            failure = (f"the writer announced {sent} batches of its run {announced.run} while this reader listened, "
                       f"and no announcement arrived (stream kvtest-{opts.namespace}, namespace {opts.namespace!r})")
    return metrics, tally, failure


@contextmanager
def _notifications(pool: BenchPool, opts: cache_options.CacheOptions
                   ) -> Iterator[tuple[Notifier | None, NotifyReader | None]]:
    """(notifier, reader) of the run: a writer announces, a reader follows; none without a cluster."""
    writer: Notifier | None = None
    reader: NotifyReader | None = None
    try:
        if pool.url and opts.role == "writer":
            writer = open_notifier(pool.url, opts.namespace)
        elif pool.url and opts.role == "reader":
            reader = open_notify_reader(pool.url, opts.namespace)
        yield writer, reader
    finally:
        for part in (writer, reader):
            if part is not None:
                part.close()


def _csv_rows(tally: _Tally, seconds: float) -> list[dict[str, object]]:
    return [kvtest_csv.row(op, lat, tally.wrong_calls if op == "get" else 0, seconds, tally.op_bytes.get(op, 0))
            for op, lat in tally.lat.items()]


def run(args: argparse.Namespace) -> int:
    opts = cache_options.resolve(args)
    if opts.csv:
        kvtest_csv.check_writable(opts.csv)
    block = max(opts.sizes)
    sized = max(256 << 20, 2 * opts.key_pool_size * block // max(opts.workers, 1))
    dram = opts.dram_bytes or min(_DEFAULT_DRAM_CAP, sized)
    inst = opts.instance
    with BenchPool(block_size=block, dram_bytes=dram, workers=opts.workers, cluster=opts.cluster,
                   ssd=opts.ssd, instance=inst) as pool, _notifications(pool, opts) as (notifier, reader):
        owners = Owners(pool.client, inst.worker_id) if inst is not None else None
        failure = None
        if opts.role == "reader":
            metrics, tally, failure = _read(pool, opts, owners, reader)
        else:
            tally = _Tally(f"cache {opts.role}", pool, BlockContent(opts.sizes), ops=opts.ops, duration=opts.duration,
                           owners=owners)
            metrics = _write(pool, opts, tally, notifier)
        wrong = metrics["wrong_blocks"] + metrics.get("readback_wrong_blocks", 0)
        pool.failure = failure or (f"{wrong} blocks read back wrong" if wrong else None)  # told to a kvtest peer
        where = pool.where
    block = tally.blocks.size
    working_set = (64 << 20) if args.quick else (256 << 20)
    memcpy = memcpy_gbps(block, max(1, min(opts.key_pool_size, working_set // block)), 3)
    metrics = {"role": opts.role, "pool": where, "block_bytes": block, "batch_size": opts.batch_size,
               "threads": opts.threads, **({"data_sizes": opts.sizes} if len(opts.sizes) > 1 else {}),
               **({"target_qps": opts.target_qps} if opts.target_qps else {}),
               **({"instance": inst.worker_id, "remote_worker": inst.remote_worker} if inst else {}), **metrics}
    ratios = {"get_vs_memcpy": gbps(tally.hit_bytes, tally.hit_time) / memcpy if tally.hit_time else 0.0}
    if opts.csv:
        kvtest_csv.write(opts.csv, _csv_rows(tally, metrics["seconds"]))
    if inst is not None:
        metrics["pairing"] = "failed" if pool.peer_failure or pool.failure else "ok"
    emit("cache", metrics, ratios, args.json, notes=f"{opts.role} on the {where}",
         latencies=tally.lat, timeline=tally.timeline)
    if pool.failure:
        print(f"kvpool bench cache: the {opts.role} failed: {pool.failure}", file=sys.stderr, flush=True)
    if pool.peer_failure:
        print(f"kvpool bench cache: the {opts.role}'s pairing failed: {pool.peer_failure}", file=sys.stderr, flush=True)
    return 1 if pool.failure or pool.peer_failure else 0

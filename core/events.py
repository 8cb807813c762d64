"""Block events of the pool: what each worker stores, copies between tiers, drops and removes.

A worker with `events` on announces what its cache holds at start (a restart's SSD tier included),
then queues its cache's changes (`cache_events.CacheListener`) and publishes
them in batches, every `FLUSH_S` seconds, on the NATS subject `kvpool.events.<worker_id>`; the
JetStream stream `KVPOOL_EVENTS` keeps them (an hour, 1 GiB by default, less where
JetStream cannot reserve that) so a consumer can replay
what it missed. A batch is JSON:
`{"v": 1, "worker", "node", "boot", "seq", "ts", "lost", "events": [[kind, tier, reason, key], ...]}`
with kind one of stored/copied/dropped/removed/cleared (see `cache_events`), `seq` counting batches
from 0 per worker process (`boot`), `lost` the events not delivered so far (the queue was full, or a
sink failed: NATS away), and `key` a str (UTF-8 keys) or `{"hex": ...}`. Each boot starts with
`cleared` then its holdings, and re-announces them so after any loss, so a consumer never keeps what an
earlier boot or a lost batch announced; a clean stop takes back what goes with the process (reason
`stop`). `EventFeed` reads them back; `events_zmq` turns them into vLLM's KV-event format.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import math
import os
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .aio import LoopThread, nats_connect, nats_denied, nats_error
from .cache_events import CacheListener, Holdings
from .errors import AuthError, ProtocolError
from .nats_creds import NatsCreds, redacted_url

__all__ = ["STREAM", "SUBJECT_PREFIX", "FLUSH_S", "MAX_QUEUED", "MAX_BATCH", "MAX_BATCH_BYTES", "KINDS",
    "BlockEvent", "EventBatch", "subject_of", "EventQueue", "ensure_stream", "Sink", "EventPublisher", "NatsSink",
    "EventIndex", "EventFeed", "key_to_json", "key_from_json"]

log = logging.getLogger("kvpool.events")

REANNOUNCE_S = 5.0
"""The least time between two re-announcements of a worker's holdings (after lost events)."""

STREAM = "KVPOOL_EVENTS"
SUBJECT_PREFIX = "kvpool.events"
FLUSH_S = 0.05
"""How often queued events are published, in seconds."""
MAX_QUEUED = 1 << 20
"""Events held at most while waiting to be published; more are counted in `lost`, not kept."""
MAX_BATCH = 4096
"""Events per published batch at most."""
MAX_BATCH_BYTES = 256 << 10
"""Key bytes per published batch at most, with an allowance per event: a batch stays well under
NATS's default 1 MiB max payload however long the keys (up to 511 bytes; hex-encoded if binary)."""
_EVENT_OVERHEAD = 32
KINDS = ("stored", "copied", "dropped", "removed", "cleared")


@dataclasses.dataclass(frozen=True)
class BlockEvent:
    """One change: `kind` (one of `KINDS`), the tier it happened in, why (drops and removals), the key."""

    kind: str
    tier: str
    reason: str
    key: bytes


@dataclasses.dataclass
class EventBatch:
    """The events a worker published in one message, in the order they happened."""

    worker: str
    node: str
    boot: str
    seq: int
    ts: float
    lost: int
    events: list[BlockEvent]

    def encode(self) -> bytes:
        return json.dumps({"v": 1, "worker": self.worker, "node": self.node, "boot": self.boot, "seq": self.seq,
                           "ts": self.ts, "lost": self.lost,
                           "events": [[e.kind, e.tier, e.reason, key_to_json(e.key)] for e in self.events]},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> EventBatch:
        """Parse a published batch; ProtocolError names what is wrong. Unknown fields are ignored."""
        try:
            raw = json.loads(data)
            events = [BlockEvent(str(k), str(t), str(r), key_from_json(key)) for k, t, r, key in raw["events"]]
            return cls(str(raw["worker"]), str(raw.get("node", "")), str(raw.get("boot", "")), int(raw["seq"]),
                       float(raw["ts"]), int(raw.get("lost", 0)), events)
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:  # 1e400, deep nesting
            raise ProtocolError(f"malformed event batch ({len(data)} bytes): {type(e).__name__}: {e}") from e


def key_to_json(key: bytes) -> Any:
    """A key as an event batch's JSON carries it: its text where it is UTF-8, else `{"hex": ...}`."""
    try:
        return key.decode()
    except UnicodeDecodeError:
        return {"hex": key.hex()}


def key_from_json(key: Any) -> bytes:
    """The key `key_to_json` gave."""
    return bytes.fromhex(key["hex"]) if isinstance(key, dict) else str(key).encode()


def subject_of(worker_id: str) -> str:
    """The subject a worker publishes on; characters NATS reserves in a token become `_`."""
    return f"{SUBJECT_PREFIX}.{re.sub(r'[^A-Za-z0-9_-]', '_', worker_id)}"


class EventQueue(CacheListener):
    """A CacheListener that queues every change for a publisher: cheap under the cache's lock. A replay
    (`add_listener(replay=True)`) is taken as a snapshot (`replayed`) and its events made as they are
    taken, off the lock, after what was queued before it and before what comes after."""

    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self._q: collections.deque[BlockEvent] = collections.deque()
        self._ahead: Iterator[BlockEvent] | None = None  # what goes out before `_q`: earlier events, a replay
        self._next: collections.deque[BlockEvent] = collections.deque()  # `_ahead`'s next events, made
        self.max_queued = max_queued
        self.lost = 0
        self.unbounded = False
        """Set while a publisher announces what the cache holds: an announcement is never cut short."""

    def _add(self, kind: str, key: bytes, tier: str, reason: str = "") -> None:
        if len(self._q) >= self.max_queued and not self.unbounded:
            self.lost += 1
            return
        self._q.append(BlockEvent(kind, tier, reason, key))

    def stored(self, key: bytes, tier: str) -> None:
        self._add("stored", key, tier)

    def copied(self, key: bytes, tier: str) -> None:
        self._add("copied", key, tier)

    def dropped(self, key: bytes, tier: str, reason: str) -> None:
        self._add("dropped", key, tier, reason)

    def removed(self, key: bytes, tier: str, reason: str) -> None:
        self._add("removed", key, tier, reason)

    def cleared(self) -> None:
        self._add("cleared", b"*", "")

    def replayed(self, holdings: Holdings) -> bool:
        """Called under the cache's lock, as every change is: what is queued now goes out first, then the
        holdings, then the changes from now on. Take calls come from one thread, which is also the one
        that registers the queue (or registers it before that thread starts)."""
        replay = (BlockEvent(kind, tier, "", key) for kind, key, tier in holdings)
        self._ahead = itertools.chain(self._next, self._ahead or (), self._q, replay)  # (`_next`: `_ahead`'s head)
        self._next, self._q = collections.deque(), collections.deque()
        return True

    def _source(self) -> collections.deque[BlockEvent]:
        """The events to take from next: a replay's (made a chunk at a time), else the queue."""
        if not self._next and self._ahead is not None:
            self._next.extend(itertools.islice(self._ahead, MAX_BATCH))
            if not self._next:
                self._ahead = None
        return self._next if self._next else self._q

    def take(self, n: int = MAX_BATCH, max_bytes: int = MAX_BATCH_BYTES) -> list[BlockEvent]:
        """Up to `n` of the oldest queued events, their keys about `max_bytes` at most (at least one
        event). Deque pops are atomic: no lock shared with the cache."""
        out: list[BlockEvent] = []
        size = 0
        while len(out) < n:
            q = self._source()
            if not q or (out and size + 2 * len(q[0].key) + _EVENT_OVERHEAD > max_bytes):
                break
            e = q.popleft()
            size += 2 * len(e.key) + _EVENT_OVERHEAD
            out.append(e)
        return out


_NO_STORAGE = 10047  # JetStream: "insufficient storage resources available"
LEAST_BYTES = 64 << 20


async def ensure_stream(js: Any, max_age_s: float = 3600.0, max_bytes: int = 1 << 30) -> None:
    """Create the events stream unless it exists (one with other limits is left as it is). Where
    JetStream cannot reserve `max_bytes` (its file store is bounded by the disk it found free, or by
    `max_file_store`), the stream keeps half as much, and so on down to `LEAST_BYTES`, with a warning."""
    from nats.js.api import StreamConfig
    from nats.js.errors import APIError, NotFoundError

    try:
        await js.stream_info(STREAM)
        return
    except NotFoundError:
        pass
    asked = max_bytes
    while True:
        try:
            await js.add_stream(StreamConfig(name=STREAM, subjects=[f"{SUBJECT_PREFIX}.>"], max_age=max_age_s,
                                             max_bytes=max_bytes))
        except APIError as e:
            if "already in use" in str(e):  # created by another worker meanwhile
                return
            if e.err_code == _NO_STORAGE and max_bytes // 2 >= LEAST_BYTES:
                max_bytes //= 2
                continue
            raise
        if max_bytes < asked:
            log.warning("JetStream could not reserve %d MiB for the events stream %s (little free disk, or its "
                        "max_file_store): it keeps the last %d MiB of events", asked >> 20, STREAM, max_bytes >> 20)
        return


Sink = Callable[[EventBatch], None]


class EventPublisher:
    """Drains an EventQueue every `flush_s` seconds into batches for each sink (NATS, ZMQ, tests).

    It starts with `cleared` then what the cache holds (a restart's SSD tier): a consumer forgets what
    an earlier boot of the worker announced (DRAM blocks a kill -9 lost, blocks the start-up catch-up
    dropped). A sink that fails is logged once per change of error and the batch goes on to the others;
    it is not retried, its events count in `lost`, and once every sink is connected again (`connected`,
    where a sink has it) the publisher re-announces its holdings (`cleared`, then what it holds): what
    the lost batches said is not missed for good. So does an overflow of the queue; re-announcements
    come `REANNOUNCE_S` apart at least (each copies the cache's index under its lock: `EventQueue.replayed`)."""

    def __init__(self, cache: Any, worker_id: str, node_id: str, sinks: list[Sink], *,
                 flush_s: float = FLUSH_S) -> None:
        self.queue = EventQueue()
        self.worker_id, self.node_id, self.sinks, self.flush_s = worker_id, node_id, sinks, flush_s
        self.boot = os.urandom(4).hex()
        self.seq = 0
        self.undelivered = 0
        """events of batches some sink failed to take (`lost` counts them with the queue's overflow)"""
        self._errors: dict[int, str] = {}
        self._cache = cache
        self._stop = threading.Event()
        self._lock = threading.Lock()  # listener changes: a re-announcement vs close
        self._closing = False
        self._reannounce = False
        self._announced_at = -math.inf
        self._lost_seen = 0
        self._announce()
        self._thread = threading.Thread(target=self._run, name="kvpool-events", daemon=True)
        self._thread.start()

    def _announce(self) -> None:
        """Queue `cleared` then every block held, with no change slipping in between or lost (the
        queue's bound does not cut an announcement short: a tier of more blocks than it holds)."""
        self._cache.remove_listener(self.queue)  # (not listening yet at start: nothing)
        self.queue.unbounded = True
        try:
            self.queue.cleared()
            self._cache.add_listener(self.queue, replay=True)
        finally:
            self.queue.unbounded = False
        self._lost_seen = self.queue.lost

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()
        self.flush()

    def _sinks_connected(self) -> bool:
        return all(getattr(sink, "connected", True) for sink in self.sinks)

    def flush(self) -> None:
        """Publish everything queued now (in batches of at most MAX_BATCH), after re-announcing the
        holdings where a batch was lost and the sinks are back."""
        if self.queue.lost > self._lost_seen:  # the queue overflowed: what it dropped is said again
            self._lost_seen = self.queue.lost
            self._reannounce = True
        if self._reannounce and self._sinks_connected() and \
                time.monotonic() - self._announced_at >= REANNOUNCE_S:
            with self._lock:
                if not self._closing:
                    self._reannounce = False
                    self._announce()
                    self._announced_at = time.monotonic()
        while True:
            events = self.queue.take()
            if not events:
                return
            batch = EventBatch(self.worker_id, self.node_id, self.boot, self.seq, time.time(),
                               self.queue.lost + self.undelivered, events)
            self.seq += 1
            failed = False
            for i, sink in enumerate(self.sinks):
                try:
                    sink(batch)
                    if self._errors.pop(i, None):
                        log.info("event sink %d publishing again", i)
                except Exception as e:  # a sink down must not stop the others, nor the worker
                    failed = True
                    why = f"{type(e).__name__}: {e}"
                    if self._errors.get(i) != why:
                        self._errors[i] = why
                        log.warning("event sink %d failed (%s); its batches are lost meanwhile and the "
                                    "holdings re-announced once it is back", i, why)
            if failed:
                self.undelivered += len(events)
                self._reannounce = True

    def close(self, *, going: bool = False) -> None:
        """Publish what is queued, stop listening and stop the thread (sinks are closed by their owner).
        `going=True` (the worker stops, its cache still open): end with `cleared` then what the SSD
        tier keeps, the blocks that outlive the process (none without an SSD tier)."""
        with self._lock:
            self._closing = True
            self._cache.remove_listener(self.queue)
        self._stop.set()
        self._thread.join(10)
        if not going:
            return
        if self._thread.is_alive():  # a sink stuck past the wait: the queue is not this thread's to take from
            log.warning("events: the publisher did not stop within 10 s; what the SSD tier keeps is not announced")
            return
        self.queue.unbounded = True  # (a full queue drops no part of the last announcement)
        try:
            self.queue.cleared()
            kept = _OnSsd(self.queue)
            self._cache.add_listener(kept, replay=True)
            self._cache.remove_listener(kept)
        finally:
            self.queue.unbounded = False
        self.flush()


class _OnSsd(CacheListener):
    """Replays into `queue` only the blocks the SSD tier holds, as `stored` there."""

    def __init__(self, queue: EventQueue) -> None:
        self.queue = queue

    def stored(self, key: bytes, tier: str) -> None:
        if tier == "ssd":
            self.queue.stored(key, tier)

    def copied(self, key: bytes, tier: str) -> None:
        self.stored(key, tier)

    def replayed(self, holdings: Holdings) -> bool:
        return self.queue.replayed(holdings.on_ssd())  # (unbounded: the queue's bound counts no replay)


class NatsSink:
    """Publishes batches on `kvpool.events.<worker>` (JetStream keeps them in `KVPOOL_EVENTS`)."""

    def __init__(self, nats_url: str, worker_id: str, timeout_s: float = 5.0, *,
                 creds: NatsCreds | None = None) -> None:
        self.subject = subject_of(worker_id)
        self.timeout_s = timeout_s
        self._io = LoopThread("kvpool-events-nats")
        try:
            self._nc = self._io.run(nats_connect(nats_url, timeout_s, log, role="worker", creds=creds),
                                    timeout=timeout_s + 2)
            self._io.run(ensure_stream(self._nc.jetstream()), timeout=timeout_s + 2)
        except Exception as e:
            self._io.stop()
            raise nats_error(e, f"cannot publish events at {redacted_url(nats_url)}") from e

    @property
    def connected(self) -> bool:
        """Whether NATS is reachable now (not reconnecting): what is published now is not buffered."""
        return bool(self._nc.is_connected)

    def __call__(self, batch: EventBatch) -> None:
        self._io.run(self._nc.publish(self.subject, batch.encode()), timeout=self.timeout_s)

    def close(self) -> None:
        try:
            self._io.run(self._nc.drain(), timeout=self.timeout_s)
        except Exception as e:  # NATS away: what was not published yet is lost, as while it was down
            log.warning("events to %s not drained at close: %r", self.subject, e)
        self._io.stop()


class EventIndex:
    """What the pool holds, rebuilt from its events: (worker, key) -> the tiers holding the block.

    Feed it every batch in order (`EventFeed(replay=True)` from the start of retention); a router
    or prefix index asks `workers(key)` where a block is. A batch of a new `boot` of a worker drops
    what its earlier boots announced (a restarted worker announces its holdings again); `gaps` counts
    batches missing from a boot's `seq` (lost: the worker re-announces its holdings after a loss)."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, bytes], set[str]] = {}
        self.seen: set[bytes] = set()
        """every key any event named"""
        self.boots: dict[str, tuple[str, int]] = {}
        """worker -> (its boot, the last seq applied)"""
        self.gaps = 0

    def apply(self, batch: EventBatch) -> None:
        last = self.boots.get(batch.worker)
        if last is not None and last[0] != batch.boot:
            self.forget(batch.worker)
        elif last is not None and batch.seq > last[1] + 1:
            self.gaps += batch.seq - last[1] - 1
        self.boots[batch.worker] = (batch.boot, batch.seq)
        for e in batch.events:
            k = (batch.worker, e.key)
            self.seen.add(e.key)
            if e.kind == "stored":
                self.held[k] = {e.tier}
            elif e.kind == "copied":
                self.held.setdefault(k, set()).add(e.tier)
            elif e.kind == "dropped":
                tiers = self.held.get(k)
                if tiers is not None:
                    tiers.discard(e.tier)
                    if not tiers:
                        del self.held[k]
            elif e.kind == "removed":
                self.held.pop(k, None)
            elif e.kind == "cleared":
                self.forget(batch.worker)

    def forget(self, worker: str) -> None:
        """Drop everything `worker` was said to hold."""
        self.held = {h: t for h, t in self.held.items() if h[0] != worker}

    def workers(self, key: bytes) -> set[str]:
        """The workers holding `key` (in any tier)."""
        return {w for (w, k) in self.held if k == key}

    def keys(self) -> set[bytes]:
        return {k for (_, k) in self.held}


class EventFeed:
    """The pool's event batches from NATS, oldest first: every batch still retained (`replay=True`)
    or only those published from now on. Iterate it, or `next_batch(timeout)`; `close()` ends it (a
    feed dropped unclosed ends too, once collected)."""

    def __init__(self, nats_url: str, *, replay: bool = False, timeout_s: float = 5.0,
                 creds: NatsCreds | None = None) -> None:
        self._io = LoopThread("kvpool-events-feed")
        self._q: queue.Queue[EventBatch] = queue.Queue()
        self.malformed = 0
        self._nc: Any = None
        self._sub: Any = None
        try:
            self._nc = self._io.run(nats_connect(nats_url, timeout_s, log, creds=creds), timeout=timeout_s + 2)
            self._sub = self._io.run(self._subscribe(replay), timeout=timeout_s + 2)
        except BaseException as e:  # Ctrl-C while waiting for NATS included: the loop thread goes too
            _disconnect(self._io, self._nc, None)
            if not isinstance(e, Exception):
                raise
            if self._nc is not None and nats_denied(self._nc, "$JS.API.STREAM.CREATE."):
                raise AuthError(f"no events stream {STREAM} at {redacted_url(nats_url)} yet, and this NATS user may "
                                "not create it: start a worker with --events first") from e
            raise nats_error(e, f"cannot read events at {redacted_url(nats_url)}") from e
        # its loop thread holds the connection, not the feed: a feed dropped unclosed is collected, and this
        # ends its connection and thread (else reconnecting for ever)
        self._closer = weakref.finalize(self, _disconnect, self._io, self._nc, self._sub)
        self._closer.atexit = False  # (a process that exits takes its connections along)

    async def _subscribe(self, replay: bool) -> Any:
        from nats.js.api import DeliverPolicy

        js = self._nc.jetstream()
        await ensure_stream(js)
        feed = weakref.ref(self)  # (the subscription, which the loop holds, must not keep the feed)

        async def on_msg(msg: Any) -> None:
            me = feed()
            if me is None:
                return
            try:
                me._q.put(EventBatch.decode(msg.data))
            except ProtocolError as e:
                me.malformed += 1
                log.warning("skipping an event batch: %s", e)

        policy = DeliverPolicy.ALL if replay else DeliverPolicy.NEW
        return await js.subscribe(f"{SUBJECT_PREFIX}.>", cb=on_msg, ordered_consumer=True, deliver_policy=policy)

    def next_batch(self, timeout: float | None = None) -> EventBatch | None:
        """The next batch, or None after `timeout` seconds without one."""
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def __iter__(self) -> Iterator[EventBatch]:
        while True:
            batch = self.next_batch(0.5)
            if batch is not None:
                yield batch

    def close(self) -> None:
        """Unsubscribe, disconnect and stop the loop thread; again, nothing."""
        self._closer()

    def __enter__(self) -> EventFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _disconnect(io: LoopThread, nc: Any, sub: Any) -> None:
    """End an `EventFeed`'s subscription `sub` and connection `nc` (either may be None: not made) and
    stop its loop thread, from any thread (it is a finalizer too). NATS away: the server drops the
    ordered consumer by itself."""
    async def close() -> None:
        try:
            if sub is not None:
                await sub.unsubscribe()
        finally:
            await nc.close()

    io.shut(close if nc is not None else None)

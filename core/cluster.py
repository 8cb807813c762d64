"""Cluster membership over NATS JetStream, and placement of keys on workers.

Workers put their description in the KV bucket `kvpool_members` every heartbeat; clients watch the
bucket and consider a worker live while its heartbeats keep arriving (`ttl_s`). Keys are placed by
rendezvous hashing, so a worker joining or leaving moves only about 1/N of the keys.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from .aio import LoopThread, nats_connect
from .errors import PoolUnavailable

log = logging.getLogger("kvpool.cluster")

BUCKET = "kvpool_members"


def rank(key: bytes, worker_ids: Sequence[str]) -> list[str]:
    """Workers ordered by rendezvous score for `key` (highest first): owners are a prefix of it."""
    return sorted(worker_ids, key=lambda w: xxhash.xxh3_64_intdigest(key, seed=xxhash.xxh32_intdigest(w.encode())),
                  reverse=True)


class Membership:
    """A NATS connection that registers a worker and/or watches the member list."""

    def __init__(self, nats_url: str, ttl_s: float = 10.0, connect_timeout: float = 5.0) -> None:
        self.url = nats_url
        self.ttl_s = ttl_s
        self._io = LoopThread("kvpool-nats")
        self._members: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._registered: str | None = None
        self._lost_at: float | None = None  # when the NATS connection dropped; members do not age meanwhile
        self._watcher: Any = None

        try:
            self._nc = self._io.run(nats_connect(nats_url, connect_timeout, log, disconnected_cb=self._disconnected,
                                                 reconnected_cb=self._reconnected), timeout=connect_timeout + 2)
            self._kv = self._io.run(self._bucket(), timeout=connect_timeout + 2)
        except Exception as e:
            self._io.stop()
            raise PoolUnavailable(f"cannot reach the cluster at {nats_url}: {e}") from e

    async def _bucket(self) -> Any:
        """The members bucket, created on first use (entries age out after `ttl_s`)."""
        from nats.js.api import KeyValueConfig
        from nats.js.errors import BucketNotFoundError

        js = self._nc.jetstream()
        try:
            return await js.key_value(BUCKET)
        except BucketNotFoundError:
            return await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1, ttl=self.ttl_s))

    # ----- worker side ------------------------------------------------------------------------

    def register(self, worker_id: str, info: Callable[[], dict[str, Any]], heartbeat_s: float) -> None:
        """Publish `info()` under `worker_id` now and every `heartbeat_s` until `close()`."""
        self._registered = worker_id

        async def beat() -> None:
            while True:
                try:
                    await self._kv.put(worker_id, json.dumps({**info(), "ts": time.time()}).encode())
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # NATS restarting: keep beating; recreate the bucket if lost
                    log.warning("heartbeat failed: %s", e)
                    try:
                        self._kv = await self._bucket()
                    except Exception:
                        pass
                await asyncio.sleep(heartbeat_s)

        self._io.run(self._kv.put(worker_id, json.dumps({**info(), "ts": time.time()}).encode()), timeout=10)
        self._io.spawn(beat())

    # ----- client side ------------------------------------------------------------------------

    def watch(self) -> None:
        """Keep `members()` current from the bucket (returns once the initial values are in)."""
        ready = threading.Event()

        async def follow() -> None:
            while True:  # an iteration ends when `_reconnected` stops the watcher: watch afresh
                try:
                    self._watcher = watcher = await self._kv.watchall()
                    async for entry in watcher:
                        if entry is None:
                            ready.set()
                            continue
                        self._apply(entry)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.warning("member watch interrupted: %s; retrying", e)
                    ready.set()
                    await asyncio.sleep(0.5)
                    try:
                        self._kv = await self._bucket()
                    except Exception:
                        pass

        self._io.spawn(follow())
        ready.wait(10)

    def _apply(self, entry: Any) -> None:
        with self._lock:
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._members.pop(entry.key, None)
            else:
                try:
                    self._members[entry.key] = (time.monotonic(), json.loads(entry.value))
                except ValueError:
                    return
            self._changed.notify_all()

    def members(self) -> dict[str, dict[str, Any]]:
        """Live workers (heard from within `ttl_s`) by worker id. While NATS is unreachable this is the
        last list seen: silence then says nothing about the workers, and data does not go through NATS."""
        with self._lock:
            now = self._lost_at if self._lost_at is not None else time.monotonic()
            return {w: info for w, (seen, info) in self._members.items() if now - seen <= self.ttl_s}

    async def _disconnected(self) -> None:
        with self._lock:
            if self._lost_at is None:
                self._lost_at = time.monotonic()

    async def _reconnected(self) -> None:
        """Members resume ageing where they stopped: each has what was left of its TTL to be heard again.
        The watch restarts at once (its consumer may be gone with the old server; waiting for it to
        notice missed heartbeats would leave joins and leaves unseen for seconds)."""
        with self._lock:
            if self._lost_at is not None:
                gap = time.monotonic() - self._lost_at
                self._members = {w: (seen + gap, info) for w, (seen, info) in self._members.items()}
                self._lost_at = None
                self._changed.notify_all()
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception as e:
                log.debug("stopping the member watch after a reconnect: %s", e)

    def wait_for(self, predicate: Callable[[dict[str, dict[str, Any]]], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate(self.members()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._lock:
                self._changed.wait(min(remaining, 0.2))
        return True

    def close(self) -> None:
        """Leave the cluster (delete our entry) and disconnect."""
        if self._registered:
            try:
                self._io.run(self._kv.delete(self._registered), timeout=2)
            except Exception as e:
                log.warning("could not deregister %s: %s", self._registered, e)
        try:
            self._io.run(self._nc.close(), timeout=2)
        except Exception:
            pass
        self._io.stop()

"""Cluster membership over NATS JetStream, and placement of keys on workers.

Workers put their description in the KV bucket `kvpool_members` every heartbeat; clients watch the
bucket and consider a worker live while its heartbeats keep arriving (`ttl_s`). Keys are placed by
rendezvous hashing, so a worker joining or leaving moves only about 1/N of the keys.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from .aio import LoopThread, nats_connect, nats_denied, nats_error
from .errors import AuthError, ConfigError, PoolUnavailable
from .nats_creds import NatsCreds, Role, redacted_url
from .records import WorkerInfo

__all__ = ["BUCKET", "rank", "Membership"]

log = logging.getLogger("kvpool.cluster")

BUCKET = "kvpool_members"
BEAT_RETRY_S = 0.25
"""How soon a heartbeat that failed is tried again: a worker whose NATS node is cut off fails over to
another (aio.PING_INTERVAL_S) and must be heard again well within the member TTL."""
REGISTER_S = 30.0
"""How long a worker's first registration is tried again while JetStream cannot take it yet: a NATS
cluster answers nothing, or "no responders", until it has elected the bucket's leader (here seconds after
it created the bucket)."""
_NO_PEERS_YET = 10005  # JetStream's "no suitable peers for placement": fewer nodes up than the replicas


def _not_ready(e: BaseException) -> bool:
    """Whether `e` is JetStream not answering yet (a NATS cluster electing a leader answers nothing, or
    503, and one whose nodes are not all up yet has "no suitable peers" to place replicas on), rather
    than a refusal."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import APIError, NoStreamResponseError

    if isinstance(e, APIError):
        return e.code == 503 or e.err_code == _NO_PEERS_YET
    return isinstance(e, (NatsTimeout, NoRespondersError, NoStreamResponseError, asyncio.TimeoutError, TimeoutError))


def rank(key: bytes, worker_ids: Sequence[str]) -> list[str]:
    """Workers ordered by rendezvous score for `key` (highest first): owners are a prefix of it. (One
    worker ranks first for every key: a node's own worker alone, the usual same-node case, costs no
    hashing; placement runs for every key of every batch.)"""
    if len(worker_ids) == 1:
        return list(worker_ids)
    return sorted(worker_ids, key=lambda w: xxhash.xxh3_64_intdigest(key, seed=_seed(w)), reverse=True)


@functools.lru_cache(maxsize=4096)
def _seed(worker_id: str) -> int:
    """The rendezvous hash seed of a worker."""
    return xxhash.xxh32_intdigest(worker_id.encode())


class Membership:
    """A NATS connection that registers a worker and/or watches the member list.

    `role`: the NATS user to connect as (`kvpool.core.nats_creds`): a `worker` registers; a `client`
    with credentials may only read the bucket, so it waits for a worker to create it. `creds`: that
    user's credentials, if not those `find_creds(role)` finds (or the URL holds)."""

    def __init__(self, nats_url: str, ttl_s: float = 10.0, connect_timeout_s: float = 5.0, replicas: int = 1, *,
                 role: Role = "client", creds: NatsCreds | None = None) -> None:
        self.url = nats_url
        self.role = role
        self.ttl_s = ttl_s
        self.replicas = replicas
        self._io = LoopThread("kvpool-nats")
        self._members: dict[str, tuple[float, WorkerInfo]] = {}  # worker id -> (heard at, its entry)
        # every worker heard since the watch began, by when it was last heard (not moved on a reconnect, kept
        # after it leaves): whom a worker back from an absence asks what changed meanwhile
        self._heard: dict[str, tuple[float, WorkerInfo]] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._registered: str | None = None
        self._lost_at: float | None = None  # when the NATS connection dropped; members do not age meanwhile
        self._watcher: Any = None

        try:
            self._nc = self._io.run(nats_connect(nats_url, connect_timeout_s, log, role=role, creds=creds,
                                                 disconnected_cb=self._disconnected,
                                                 reconnected_cb=self._reconnected), timeout=connect_timeout_s + 2)
            # a client user may not create the bucket (nats_creds.PERMISSIONS): it waits for a worker's
            self._may_create = role != "client" or not (self._nc.options.get("user") or "@" in nats_url)
            self._kv: Any = self._io.run(self._first_bucket(connect_timeout_s), timeout=connect_timeout_s + 2)
        except (AuthError, ConfigError):  # refused, or a credentials file that is not one
            self._disconnect()
            raise
        except Exception as e:
            denied = nats_denied(getattr(self, "_nc", None), f"$JS.API.STREAM.CREATE.KV_{BUCKET}")
            self._disconnect()
            if denied:
                raise AuthError(f"the NATS user at {redacted_url(nats_url)} may not create the member bucket "
                                f"(role {role!r}): {denied}") from e
            raise PoolUnavailable(f"cannot reach the cluster at {redacted_url(nats_url)}: {e}") from e
        except BaseException:  # Ctrl-C while waiting for NATS: the loop thread and its sockets go too
            self._disconnect()
            raise

    async def _first_bucket(self, within_s: float) -> Any:
        """`_bucket()`, asked again while JetStream cannot answer yet (a NATS cluster electing a leader
        answers nothing, or 503; one whose nodes are not all up yet has "no suitable peers" to place
        the bucket's replicas on) until `within_s` seconds have passed."""
        deadline = time.monotonic() + within_s
        while True:
            left = deadline - time.monotonic()
            try:
                return await self._bucket(timeout=max(0.5, min(2.0, left)))
            except Exception as e:
                if not _not_ready(e) or left <= 0.7:
                    raise
                log.debug("members bucket not answering yet: %r", e)
                await asyncio.sleep(0.2)

    async def _bucket(self, timeout: float = 5.0) -> Any:
        """The members bucket, created on first use (entries age out after `ttl_s`); None while it does
        not exist and this user may not create it. `timeout`: for each JetStream request."""
        from nats.js.api import KeyValueConfig
        from nats.js.errors import BucketNotFoundError

        js = self._nc.jetstream(timeout=timeout)
        try:
            kv = await js.key_value(BUCKET)
        except BucketNotFoundError:
            if not self._may_create:
                return None
            return await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1, ttl=self.ttl_s,
                                                            replicas=self.replicas))
        if self.role == "worker" or self.replicas > 1:
            # a bucket made by a client (1 replica; its own TTL) is raised to the workers' settings: an
            # entry that aged out of it before the worker's TTL would hide a worker that has not fenced
            # itself from every client that starts meanwhile
            cfg = (await js.stream_info(f"KV_{BUCKET}")).config
            raised = dataclasses.replace(cfg, num_replicas=max(cfg.num_replicas or 1, self.replicas))
            if self.role == "worker" and cfg.max_age and cfg.max_age < self.ttl_s:  # (0: entries never age out)
                raised = dataclasses.replace(raised, max_age=self.ttl_s)
            if raised != cfg:
                await js.update_stream(raised)
        return kv

    async def _reopen_bucket(self) -> None:
        """After a failure on the bucket (NATS restarting, the bucket lost): open or recreate it; a
        failure here is retried by the caller's next round."""
        try:
            self._kv = await self._bucket()
        except Exception as e:
            log.debug("members bucket not reachable yet: %s", e)

    # ----- worker side ------------------------------------------------------------------------

    def register(self, worker_id: str, info: Callable[[], dict[str, Any]], heartbeat_s: float,
                 on_rejoin: Callable[[float], None] | None = None,
                 on_beat: Callable[[], None] | None = None) -> None:
        """Publish `info()` under `worker_id` now and every `heartbeat_s` until `close()`.

        `on_rejoin(gap_s)` runs once per outage (in the NATS thread) as soon as no heartbeat got through
        for so long that the entry may have expired: clients then place this worker's keys elsewhere, so
        what it holds may become older than what they write meanwhile. A process paused (SIGSTOP) for
        that long counts as an outage too. `on_beat()` runs (in the NATS thread) after each heartbeat
        that got through."""
        last_ok = time.monotonic()
        told = last_ok  # the gap on_rejoin was last called for, by its start

        def check_gap() -> None:
            nonlocal told
            gap = time.monotonic() - last_ok
            if gap >= self.ttl_s - heartbeat_s and told != last_ok and on_rejoin is not None:
                told = last_ok
                on_rejoin(gap)

        async def beat() -> None:
            nonlocal last_ok
            failing = False
            while True:
                try:
                    check_gap()
                    # at most a beat per try: a put sent just before a cut cable gets no answer, and the
                    # next one goes out (through the node the connection has failed over to) at once
                    await asyncio.wait_for(
                        self._kv.put(worker_id, json.dumps({**info(), "ts": time.time()}).encode()), heartbeat_s)
                    # a put may hang through the whole outage (a cut cable) and then succeed: the gap is
                    # told before this heartbeat counts, so the worker fences before it serves again
                    check_gap()
                    last_ok = time.monotonic()
                    if failing:
                        log.warning("heartbeats get through again")
                        failing = False
                    if on_beat is not None:
                        on_beat()
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # NATS restarting or failing over: keep trying; recreate the bucket if lost
                    if not failing:
                        log.warning("heartbeat failed (trying again every %.2f s): %r", BEAT_RETRY_S, e)
                        failing = True
                    if not isinstance(e, asyncio.TimeoutError):  # an answer saying the bucket is gone
                        await self._reopen_bucket()
                    await asyncio.sleep(BEAT_RETRY_S)
                    continue
                await asyncio.sleep(heartbeat_s)

        deadline, told = time.monotonic() + REGISTER_S, False
        while True:
            try:
                if self._kv is None:
                    raise PoolUnavailable(f"no member bucket {BUCKET!r} at {redacted_url(self.url)}, and this NATS "
                                          "user may not create it")
                self._io.run(self._kv.put(worker_id, json.dumps({**info(), "ts": time.time()}).encode()), timeout=10)
                break
            except Exception as e:
                denied = nats_denied(self._nc, f"$KV.{BUCKET}.")
                if denied:
                    raise AuthError(f"the NATS user at {redacted_url(self.url)} may not register members (role "
                                    f"{self.role!r}; workers need the worker credentials): {denied}") from e
                if not _not_ready(e) or time.monotonic() >= deadline:
                    raise nats_error(e, f"cannot register {worker_id!r} at {redacted_url(self.url)}") from e
                if not told:
                    log.warning("JetStream does not take the registration of %r yet (%r): trying again every "
                                "%.2f s for up to %.0f s", worker_id, e, BEAT_RETRY_S, REGISTER_S)
                    told = True
                time.sleep(BEAT_RETRY_S)
        self._registered = worker_id
        if on_beat is not None:
            on_beat()
        self._io.spawn(beat())

    def peers(self, timeout_s: float = 5.0) -> dict[str, WorkerInfo]:
        """The members registered now (heard from within `ttl_s`, or their own longer `member_ttl_s`),
        read from the bucket once.
        Raises PoolUnavailable if NATS does not answer within `timeout_s`."""
        async def read() -> dict[str, WorkerInfo]:
            from nats.js.errors import NoKeysError

            if self._kv is None:
                await self._reopen_bucket()
            if self._kv is None:
                return {}
            try:
                names = await self._kv.keys()
            except NoKeysError:
                return {}
            out: dict[str, WorkerInfo] = {}
            now = time.time()
            for name in names:
                try:
                    entry = await self._kv.get(name)
                    fields = json.loads(entry.value)
                    if now - float(fields.get("ts", now)) <= self._kept_s(float(fields.get("member_ttl_s", 0))):
                        out[name] = WorkerInfo.from_dict(fields, name)
                except (ValueError, TypeError, AttributeError) as e:
                    log.warning("ignoring member entry %r: %s", name, e)
            return out

        try:
            return self._io.run(read(), timeout=timeout_s)
        except Exception as e:
            raise nats_error(e, f"cannot list the members at {redacted_url(self.url)}") from e

    # ----- client side ------------------------------------------------------------------------

    def watch(self) -> None:
        """Keep `members()` current from the bucket (returns once the initial values are in)."""
        ready = threading.Event()

        async def follow() -> None:
            while True:  # an iteration ends when `_reconnected` stops the watcher: watch afresh
                try:
                    if self._kv is None:  # no bucket yet, and ours to wait for: no members yet
                        ready.set()
                        await asyncio.sleep(0.5)
                        await self._reopen_bucket()
                        continue
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
                    await self._reopen_bucket()

        self._io.spawn(follow())
        ready.wait(10)

    def _apply(self, entry: Any) -> None:
        info: WorkerInfo | None = None
        if entry.operation not in ("DEL", "PURGE") and entry.value:
            try:
                info = WorkerInfo.from_dict(json.loads(entry.value), entry.key)
            except (ValueError, TypeError, AttributeError) as e:  # not a JSON object of member fields
                log.warning("ignoring member entry %r: %s", entry.key, e)
                return
        with self._lock:
            if info is None:
                self._members.pop(entry.key, None)
            else:
                self._members[entry.key] = self._heard[entry.key] = (time.monotonic(), info)
            self._changed.notify_all()

    def members(self) -> dict[str, WorkerInfo]:
        """Live workers (heard from within `ttl_s`, or within its own `member_ttl_s` where a worker's is
        longer: it fences itself only then, so its keys are not written elsewhere before) by worker id.
        While NATS is unreachable this is the last list seen: silence then says nothing about the
        workers, and data does not go through NATS."""
        with self._lock:
            now = self._lost_at if self._lost_at is not None else time.monotonic()
            return {w: info for w, (seen, info) in self._members.items()
                    if now - seen <= self._kept_s(info.member_ttl_s)}

    def _kept_s(self, member_ttl_s: float) -> float:
        """How long after its last heartbeat a worker whose own TTL is `member_ttl_s` counts as a member
        here: the longer of the two (it fences itself only after its own)."""
        return max(self.ttl_s, member_ttl_s)

    def heard_since(self, since: float) -> dict[str, WorkerInfo]:
        """Every worker whose entry came in at or after `since` (time.monotonic()) while watching,
        whether it is live now or not, even if it left since: the peers that may have taken writes
        after that moment."""
        with self._lock:
            return {w: info for w, (seen, info) in self._heard.items() if seen >= since}

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

    def wait_for(self, predicate: Callable[[dict[str, WorkerInfo]], bool], timeout_s: float) -> bool:
        """Whether `predicate(members())` holds within `timeout_s` seconds (checked on every change)."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self.members()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._lock:
                self._changed.wait(min(remaining, 0.2))
        return True

    def close(self) -> None:
        """Leave the cluster (delete our entry) and disconnect; again, nothing."""
        if self._io.loop.is_closed():
            return
        if self._registered:
            try:
                self._io.run(self._kv.delete(self._registered), timeout=2)
            except Exception as e:
                log.warning("could not deregister %s: %s", self._registered, e)
        self._disconnect()

    def _disconnect(self) -> None:
        """Close the NATS connection (if one was made) and stop its loop."""
        if getattr(self, "_nc", None) is not None:
            try:
                self._io.run(self._nc.close(), timeout=2)
            except Exception as e:  # leaving anyway: the loop stops and the socket goes with it
                log.debug("closing the NATS connection: %s", e)
        self._io.stop()

"""Consumer: receive a stream's messages in order, with explicit acks, replay, fan-out or groups.

Each Consumer without a group is its own (ephemeral) JetStream consumer: every such consumer sees every
message (fan-out). Consumers sharing a `group` share one durable consumer: each message goes to one
member. At most `max_ack_pending` messages are out unacked per consumer/group; an unacked message is
redelivered after `ack_wait_s` seconds, at most `max_deliver` times: the next delivery goes to the
dead-letter subject `kvpool.dead.<stream>` instead and is terminated. By-reference payloads are fetched
through the pool and verified. Whatever arrives is handed out as a message: one that cannot be decoded
has kind 'invalid' and its `error`, so that no message, however malformed, blocks a consumer.
"""
from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js import api

from kvpool.core import ConfigError, PoolClient

from . import envelope as env
from ._link import Link
from .admin import check_token, dead_subject, subject
from .errors import ForgedMessage, MalformedMessage, PayloadError, StreamError
from .message import BaseMessage, Message
from .payload import fetch
from .sealing import secret_from, verify

log = logging.getLogger("kvpool.streams")

Start = str | int | datetime.datetime
"""Where a new consumer starts: 'all' (default), 'new', 'last', a stream sequence (int, 1-based) or a
time (timezone-aware datetime). A group that already exists keeps its position."""

MAX_DELIVER = 5
"""Default deliveries of one message to one consumer (or group) before it is dead-lettered."""
POLL_S = 0.01
"""How long a receive of no time (`timeout` <= 0, a poll) waits for the server's answer: a fetch needs a
positive wait."""

LIMITS_S = 0.5
"""How long a consumer goes on with the pool's max block it last asked for."""
_REASON_CHARS = 300


def consumer_config(start: Start, ack_wait_s: float, max_ack_pending: int) -> api.ConsumerConfig:
    """The JetStream consumer config for a start position and ack bounds."""
    if not 0 < ack_wait_s < math.inf or max_ack_pending < 1:
        raise ConfigError(f"ack_wait_s={ack_wait_s} must be finite and > 0 s, "
                          f"and max_ack_pending={max_ack_pending} >= 1")
    cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
                             max_ack_pending=max_ack_pending)
    if isinstance(start, datetime.datetime):
        if start.tzinfo is None:
            raise ConfigError(f"start time {start} has no timezone; pass an aware datetime")
        cfg.deliver_policy, cfg.opt_start_time = api.DeliverPolicy.BY_START_TIME, start
    elif isinstance(start, int) and not isinstance(start, bool):
        if start < 1:
            raise ConfigError(f"start sequence {start} must be >= 1")
        cfg.deliver_policy, cfg.opt_start_seq = api.DeliverPolicy.BY_START_SEQUENCE, start
    elif start in ("all", "new", "last"):
        cfg.deliver_policy = api.DeliverPolicy(start)
    else:
        raise ConfigError(f"start {start!r} is not 'all', 'new', 'last', a sequence number or a datetime")
    return cfg


class Checks:
    """What a consumer checks on every delivery, shared by `Consumer` and `AsyncConsumer`: the limits,
    the signing key, `max_deliver`; and what it counts (`counts`: invalid, forged, dead-lettered)."""

    def __init__(self, stream: str, pool: PoolClient | None, limits: env.Limits | None, max_deliver: int,
                 secret: str | bytes | None) -> None:
        if max_deliver < 0:
            raise ConfigError(f"max_deliver={max_deliver} must be >= 0 (0 = redeliver forever)")
        self.stream, self.pool, self.max_deliver = stream, pool, max_deliver
        self.limits, self.key = limits or env.Limits(), secret_from(secret)
        self.counts = {"invalid": 0, "forged": 0, "dead": 0}
        self._current: tuple[float, env.Limits] | None = None  # (when asked, the limits then)

    def current_limits(self) -> env.Limits:
        """The limits, with max_block no larger than the pool's (asked again after `LIMITS_S`: members come
        and go; asking at every message cost a handoff's receiver ~25 us a layer here)."""
        if self.pool is None:
            return self.limits
        now = time.monotonic()
        if self._current is None or now - self._current[0] >= LIMITS_S:
            self._current = now, env.Limits(min(self.limits.max_block, self.pool.max_block), self.limits.max_keys,
                                            self.limits.max_bytes, self.limits.max_layer)
        return self._current[1]

    def exhausted(self, raw: Any) -> str | None:
        """Why `raw` goes to the dead-letter subject instead of the caller, or None."""
        n = raw.metadata.num_delivered
        if self.max_deliver and n > self.max_deliver:
            return f"delivered {n} times; max_deliver is {self.max_deliver}"
        return None

    def buried(self, raw: Any, consumer: str, reason: str) -> None:
        """Count a dead-lettered message; the first (and every 1000th) is logged as a warning."""
        self.counts["dead"] += 1
        n = self.counts["dead"]
        (log.warning if n % 1000 == 1 else log.debug)(
            "stream %r: message %d on %r dead-lettered to %s by %r (%d so far): %s", self.stream,
            raw.metadata.sequence.stream, raw.subject[:200], dead_subject(self.stream), consumer, n, reason)

    def invalid(self, msg: BaseMessage, err: StreamError) -> None:
        """Mark `msg` undeliverable; the first of each kind (and every 1000th) is logged as a warning."""
        msg.kind, msg.data, msg.ref, msg.error = env.INVALID, b"", None, err
        what = "forged" if isinstance(err, ForgedMessage) else "invalid"
        self.counts[what] += 1
        (log.warning if self.counts[what] % 1000 == 1 else log.debug)(
            "stream %r: message %d on %r is %s (%d so far): %s", self.stream, msg.seq, msg.subject[:200], what,
            self.counts[what], err)


def _printable(text: str) -> str:
    """`text` safe as a NATS header value: printable ASCII, bounded."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:_REASON_CHARS])


async def bury(nc: Any, stream: str, consumer: str, raw: Any, reason: str) -> None:
    """Publish `raw` to the dead-letter subject `kvpool.dead.<stream>` (its body, and headers saying
    where it came from and why) and terminate it, so that it is never delivered again."""
    meta = raw.metadata
    headers = {"Kvpool-Dead-Stream": stream, "Kvpool-Dead-Seq": str(meta.sequence.stream),
               "Kvpool-Dead-Subject": _printable(raw.subject), "Kvpool-Dead-Consumer": _printable(consumer),
               "Kvpool-Dead-Delivered": str(meta.num_delivered), "Kvpool-Dead-Reason": _printable(reason),
               "Kvpool-Dead-Kind": _printable((raw.headers or {}).get(env.KIND, env.INLINE))}
    body = bytes(raw.data[:max(nc.max_payload - 16384, 0)])
    await nc.publish(dead_subject(stream), body, headers=headers)
    await raw.term()


async def pull_one(js: Any, sub: Any, stream: str, consumer: str, wait: float) -> Any:
    """The next message of pull subscription `sub` within `wait` seconds (TimeoutError if none). A pull
    nobody answers is JetStream's answer for a consumer or stream deleted as well as for JetStream away:
    asked which, a deleted one raises NotFoundError (StreamNotFound once translated), not the retryable
    'unavailable' for ever."""
    try:
        (raw,) = await sub.fetch(1, timeout=wait)
    except nats.js.errors.ServiceUnavailableError:
        await js.consumer_info(stream, consumer)
        raise
    return raw


M = TypeVar("M", bound=BaseMessage)


def decode(raw: Any, checks: Checks, into: Any, fetch_payload: bool, msg: M) -> M:
    """Fill `msg` from a JetStream message; a by-reference payload is fetched (if `fetch_payload`) and
    verified. A message that cannot be decoded comes back with kind 'invalid' and its `error`; a payload
    that cannot be delivered intact raises PayloadError (with `.message`, whose `error` it also is)."""
    headers = dict(raw.headers or {})
    meta = raw.metadata
    msg.seq, msg.subject, msg.kind, msg.data, msg.headers = (meta.sequence.stream, raw.subject, env.INVALID,
                                                             b"", headers)
    msg.delivered, msg.timestamp = meta.num_delivered, meta.timestamp.timestamp()
    try:
        msg.kind = env.kind_of(headers)
        if checks.key is not None and (why := verify(checks.key, raw.subject, headers, raw.data)):
            raise ForgedMessage(f"message {msg.seq} of stream {checks.stream!r}: {why} (a stream secret is set)")
        if msg.kind in (env.REF, env.KV):
            msg.ref = env.Ref.decode(raw.data, checks.current_limits())
        elif msg.kind == env.KV_LAYERS:  # (its layers' blocks, one after the other)
            limits = checks.current_limits()
            msg.ref = env.Layers.decode(raw.data, limits).merged(limits)
        elif msg.kind == env.END:
            env.End.decode(raw.data, checks.limits)
    except (MalformedMessage, ForgedMessage) as e:
        checks.invalid(msg, e)
        return msg
    if msg.ref is None:
        msg.data = raw.data
        return msg
    if not fetch_payload:
        return msg
    what = f"message {msg.seq} of stream {checks.stream!r}"
    try:
        if checks.pool is None:
            raise PayloadError(f"{what} holds {msg.ref.total} bytes by reference; the Consumer needs a pool",
                               size=msg.ref.total)
        msg.data, msg.blocks = fetch(checks.pool, msg.ref, into, what=what)
    except PayloadError as e:
        e.message, msg.error = msg, e
        raise
    return msg


class Subscription:
    """A pull subscription on an open `Link`: pulls one message per request to the server (a group's
    other members may take the next ones) and hands it out with its payload fetched and verified."""

    def __init__(self, link: Link, stream: str, filter_subject: str, group: str | None,
                 config: api.ConsumerConfig, checks: Checks, fetch: bool = True) -> None:
        self._link, self.stream, self.group, self.checks, self.fetch = link, stream, group, checks, fetch
        if group is None:
            config.inactive_threshold = 60.0  # an abandoned ephemeral consumer is dropped by the server
        self._sub = link.call(link.js.pull_subscribe(filter_subject, durable=group, stream=stream, config=config),
                              f"subscribe to stream {stream!r}")
        self.name = group or self._sub._consumer

    def receive(self, timeout: float, into: Any = None) -> Message | None:
        """The next message, or None if none arrives within `timeout` seconds (<= 0: a poll, `POLL_S`).
        Messages past `max_deliver` are dead-lettered on the way and never returned."""
        timeout = max(timeout, POLL_S)
        deadline = time.monotonic() + timeout
        wait = timeout
        while True:
            try:
                raw = self._link.call(pull_one(self._link.js, self._sub, self.stream, self.name, wait),
                                      f"receive from stream {self.stream!r}", timeout=wait)
            except TimeoutError:
                return None
            reason = self.checks.exhausted(raw)
            if reason is None:
                return self._decode(raw, into)
            self._link.call(bury(self._link.nc, self.stream, self.name, raw, reason),
                            f"dead-letter message {raw.metadata.sequence.stream} of stream {self.stream!r}")
            self.checks.buried(raw, self.name, reason)
            wait = deadline - time.monotonic()
            if wait <= 0:
                return None

    def _decode(self, raw: Any, into: Any) -> Message:
        return decode(raw, self.checks, into, self.fetch,
                      Message(0, "", "", b"", {}, 0, 0.0, _settle=lambda op, delay: self._settle(raw, op, delay)))

    def _settle(self, raw: Any, op: str, delay_s: float) -> None:
        coro = raw.nak(delay=delay_s or None) if op == "nak" else getattr(raw, op)()
        self._link.call(coro, f"{op} message on stream {self.stream!r}")

    def close(self, delete: bool) -> None:
        try:
            self._link.call(self._sub.unsubscribe(), "unsubscribe")
            if delete:
                self._link.call(self._link.js.delete_consumer(self.stream, self.name), "delete consumer")
        except (ConnectionError, LookupError, nats.errors.Error):
            pass  # the server already dropped it, or is gone: nothing to release


class Consumer:
    """Receives from stream `stream` (which must exist). Not thread-safe; one per thread.

    `group`: share a durable consumer of that name with other members (each message to one member);
    None: a private consumer that sees every message and is deleted on `close()`.
    `topic`: only messages published with that topic (default: all). `pool`: needed to receive payloads
    that went by reference. `fetch=False`: leave by-reference payloads in the pool (`data` is empty;
    `ref` names the blocks and `size` is their total), e.g. to monitor a stream.
    `max_deliver`: deliveries of an unacked message before it goes to `kvpool.dead.<stream>` and is
    terminated (0: redeliver forever). `limits`: what one message may name (blocks, bytes), checked
    before anything is allocated. `secret`: the stream secret (default $KVPOOL_STREAM_SECRET); when
    set, unsigned or badly signed messages arrive as 'invalid' with a ForgedMessage `error`.
    `counts` says how many messages were invalid, forged, dead-lettered.
    """

    def __init__(self, stream: str, nats_url: str, *, group: str | None = None, start: Start = "all",
                 pool: PoolClient | None = None, topic: str = ">", ack_wait_s: float = 30.0,
                 max_ack_pending: int = 1000, fetch: bool = True, timeout_s: float = 5.0,
                 max_deliver: int = MAX_DELIVER, limits: env.Limits | None = None,
                 secret: str | bytes | None = None) -> None:
        check_token(stream, "stream name")
        if group is not None:
            check_token(group, "group")
        cfg = consumer_config(start, ack_wait_s, max_ack_pending)
        checks = Checks(stream, pool, limits, max_deliver, secret)
        filt = subject(stream, ">" if topic == ">" else check_token(topic, "topic"))
        self._link = Link(nats_url, timeout_s)
        try:
            self._sub = Subscription(self._link, stream, filt, group, cfg, checks, fetch)
        except BaseException:
            self._link.close()
            raise

    @property
    def counts(self) -> dict[str, int]:
        """Messages seen invalid, forged (bad or missing signature) and dead-lettered, so far."""
        return dict(self._sub.checks.counts)

    def receive(self, timeout: float = 1.0, into: Any = None) -> Message | None:
        """The next message, or None if none arrives within `timeout` seconds.

        A message that cannot be decoded is returned with kind 'invalid' and its `error` (ack or term
        it). A by-reference payload is read into `into` (writable, large enough) or a new buffer, and
        verified; a missing or corrupt block raises PayloadError whose `.message` can be acked/termed."""
        return self._sub.receive(timeout, into)

    def __iter__(self) -> Iterator[Message]:
        """Messages as they arrive, forever (stop by breaking out or closing from the same thread)."""
        while True:
            msg = self.receive(1.0)
            if msg is not None:
                yield msg

    def close(self) -> None:
        """Stop receiving; a private consumer is deleted, a group's durable consumer stays."""
        self._sub.close(delete=self._sub.group is None)
        self._link.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

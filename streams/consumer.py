"""Consumer: receive a stream's messages in order, with explicit acks, replay, fan-out or groups.

Each Consumer without a group is its own (ephemeral) JetStream consumer: every such consumer sees every
message (fan-out). Consumers sharing a `group` share one durable consumer: each message goes to one
member. At most `max_ack_pending` messages are out unacked per consumer/group; an unacked message is
redelivered after `ack_wait_s` seconds. By-reference payloads are fetched through the pool and verified.
"""
from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any, TypeVar

import nats.errors
from nats.js import api

from kvpool.core import ConfigError, PoolClient

from . import envelope as env
from ._link import Link
from .admin import check_token, subject
from .errors import PayloadError
from .message import BaseMessage, Message
from .payload import fetch

Start = str | int | datetime.datetime
"""Where a new consumer starts: 'all' (default), 'new', 'last', a stream sequence (int, 1-based) or a
time (timezone-aware datetime). A group that already exists keeps its position."""


def consumer_config(start: Start, ack_wait_s: float, max_ack_pending: int) -> api.ConsumerConfig:
    """The JetStream consumer config for a start position and ack bounds."""
    if ack_wait_s <= 0 or max_ack_pending < 1:
        raise ConfigError(f"ack_wait_s={ack_wait_s} must be > 0 s and max_ack_pending={max_ack_pending} >= 1")
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


M = TypeVar("M", bound=BaseMessage)


def decode(raw: Any, stream: str, pool: PoolClient | None, into: Any, fetch_payload: bool, msg: M) -> M:
    """Fill `msg` from a JetStream message; a by-reference payload is fetched (if `fetch_payload`) and
    verified. Raises PayloadError (with `.message`) if it cannot be delivered intact."""
    headers = dict(raw.headers or {})
    meta = raw.metadata
    msg.seq, msg.subject, msg.kind, msg.data, msg.headers = (meta.sequence.stream, raw.subject, env.kind_of(headers),
                                                             raw.data, headers)
    msg.delivered, msg.timestamp = meta.num_delivered, meta.timestamp.timestamp()
    if msg.kind not in (env.REF, env.KV):
        return msg
    msg.ref, msg.data = env.Ref.decode(raw.data), b""
    if not fetch_payload:
        return msg
    what = f"message {msg.seq} of stream {stream!r}"
    if pool is None:
        raise PayloadError(f"{what} holds {msg.ref.total} bytes by reference; the Consumer needs a pool", msg)
    try:
        msg.data, msg.blocks = fetch(pool, msg.ref, into, what=what)
    except PayloadError as e:
        e.message = msg
        raise
    return msg


class Subscription:
    """A pull subscription on an open `Link`: pulls one message per request to the server (a group's
    other members may take the next ones) and hands it out with its payload fetched and verified."""

    def __init__(self, link: Link, stream: str, filter_subject: str, group: str | None,
                 config: api.ConsumerConfig, pool: PoolClient | None, fetch: bool = True) -> None:
        self._link, self.stream, self.group, self.pool, self.fetch = link, stream, group, pool, fetch
        if group is None:
            config.inactive_threshold = 60.0  # an abandoned ephemeral consumer is dropped by the server
        self._sub = link.call(link.js.pull_subscribe(filter_subject, durable=group, stream=stream, config=config),
                              f"subscribe to stream {stream!r}")
        self.name = group or self._sub._consumer

    def receive(self, timeout: float, into: Any = None) -> Message | None:
        """The next message, or None if none arrives within `timeout` seconds."""
        try:
            (raw,) = self._link.call(self._sub.fetch(1, timeout=timeout), f"receive from stream {self.stream!r}",
                                     timeout=timeout)
        except TimeoutError:
            return None
        return self._decode(raw, into)

    def _decode(self, raw: Any, into: Any) -> Message:
        return decode(raw, self.stream, self.pool, into, self.fetch,
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
    """

    def __init__(self, stream: str, nats_url: str, *, group: str | None = None, start: Start = "all",
                 pool: PoolClient | None = None, topic: str = ">", ack_wait_s: float = 30.0,
                 max_ack_pending: int = 1000, fetch: bool = True, timeout_s: float = 5.0) -> None:
        check_token(stream, "stream name")
        if group is not None:
            check_token(group, "group")
        cfg = consumer_config(start, ack_wait_s, max_ack_pending)
        filt = subject(stream, ">" if topic == ">" else check_token(topic, "topic"))
        self._link = Link(nats_url, timeout_s)
        try:
            self._sub = Subscription(self._link, stream, filt, group, cfg, pool, fetch)
        except BaseException:
            self._link.close()
            raise

    def receive(self, timeout: float = 1.0, into: Any = None) -> Message | None:
        """The next message, or None if none arrives within `timeout` seconds.

        A by-reference payload is read into `into` (writable, large enough) or a new buffer, and
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

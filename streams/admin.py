"""Stream definition and management: create, describe, list and delete JetStream streams.

A kvpool stream NAME is the JetStream stream `NAME` holding the subjects `kvpool.stream.NAME.>`.
Limits (age in seconds, bytes, message count) bound what it retains; with `discard="new"` a full
stream refuses publishes (`StreamFull`) instead of dropping old messages: producer backpressure.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

from nats.js import api

from kvpool.core import ConfigError

from ._link import Link
from .errors import StreamUnavailable

SUBJECT_PREFIX = "kvpool.stream"
DEAD_PREFIX = "kvpool.dead"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RETENTIONS = ("limits", "interest", "workqueue")
DISCARDS = ("old", "new")


def check_token(value: str, what: str) -> str:
    """`value` if it is usable as one NATS subject token (letters, digits, `_`, `-`; 1-64 chars)."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(f"{what} {value!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return value


def subject(stream: str, *tokens: str) -> str:
    """The subject `kvpool.stream.<stream>.<tokens...>` (`>` for all of the stream)."""
    return ".".join((SUBJECT_PREFIX, stream, *tokens))


def dead_subject(stream: str) -> str:
    """Where consumers of `stream` send messages past their max_deliver: `kvpool.dead.<stream>`, outside
    the stream (a JetStream stream on `kvpool.dead.>` keeps them; otherwise only live subscribers see them)."""
    return ".".join((DEAD_PREFIX, stream))


@dataclasses.dataclass
class StreamConfig:
    """Retention and limits of a stream. 0 means unlimited; ages in seconds, sizes in bytes."""

    max_age_s: float = 0.0
    max_bytes: int = 0
    max_msgs: int = 0
    discard: str = "old"
    """what a full stream does: 'old' drops its oldest messages, 'new' refuses publishes (StreamFull)."""
    retention: str = "limits"
    """'limits' keeps messages until a limit drops them; 'interest' drops one once every consumer acked it;
    'workqueue' drops one once any consumer acked it."""
    memory: bool = False
    """keep messages in memory instead of the server's file store."""
    replicas: int = 1
    """copies JetStream keeps on a NATS cluster (3 on a 3-node cluster survives the loss of a node)."""

    def __post_init__(self) -> None:
        if self.discard not in DISCARDS:
            raise ConfigError(f"discard {self.discard!r} is not one of {', '.join(DISCARDS)}")
        if self.retention not in RETENTIONS:
            raise ConfigError(f"retention {self.retention!r} is not one of {', '.join(RETENTIONS)}")
        if not 1 <= self.replicas <= 5:
            raise ConfigError(f"replicas is {self.replicas}; JetStream keeps 1 to 5 copies",
                              size=self.replicas, limit=5)
        for name in ("max_age_s", "max_bytes", "max_msgs"):
            if not 0 <= getattr(self, name) < math.inf:  # NaN too
                raise ConfigError(f"{name} is {getattr(self, name)}; it must be finite and >= 0 (0 = unlimited)")

    def to_nats(self, name: str) -> api.StreamConfig:
        return api.StreamConfig(
            name=check_token(name, "stream name"), subjects=[subject(name, ">")],
            retention=api.RetentionPolicy(self.retention), discard=api.DiscardPolicy(self.discard),
            max_age=self.max_age_s or None, max_bytes=self.max_bytes or -1, max_msgs=self.max_msgs or -1,
            storage=api.StorageType.MEMORY if self.memory else api.StorageType.FILE, num_replicas=self.replicas,
            allow_direct=True)  # a receiver reads a request's stored messages in one batch (`live.Feed`)


def create_stream(nats_url: str, name: str, config: StreamConfig | None = None) -> dict[str, Any]:
    """Create stream `name` (or update its limits if it exists); returns its info (see `stream_info`)."""
    link = Link(nats_url, role="admin")  # configuring streams is the admin user's (see nats_creds)
    try:
        cfg = (config or StreamConfig()).to_nats(name)
        try:
            link.call(link.js.stream_info(name), f"look up stream {name!r}")
            info = link.call(link.js.update_stream(cfg), f"update stream {name!r}")
        except LookupError:
            info = link.call(link.js.add_stream(cfg), f"create stream {name!r}")
        if cfg.num_replicas and cfg.num_replicas > 1:
            info = _led(link, name)
        return _describe(info)
    finally:
        link.close()


def _led(link: Link, name: str) -> Any:
    """The stream's info once its replicas have elected a leader: until then a NATS cluster answers
    its calls with 503 (unavailable), so a stream is not handed out before it can serve."""
    deadline = time.monotonic() + link.timeout_s
    while True:
        try:
            info = link.call(link.js.stream_info(name), f"stream {name!r}")
            if info.cluster is None or info.cluster.leader:
                return info
        except StreamUnavailable:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise StreamUnavailable(f"stream {name!r} elected no leader within {link.timeout_s} s",
                                    limit=link.timeout_s)
        time.sleep(0.1)


def stream_info(nats_url: str, name: str) -> dict[str, Any]:
    """Messages, bytes, first/last sequence, limits and consumer count of stream `name`.

    Raises StreamNotFound if there is none."""
    check_token(name, "stream name")
    link = Link(nats_url)
    try:
        return _describe(link.call(link.js.stream_info(name), f"stream {name!r}"))
    finally:
        link.close()


def list_streams(nats_url: str) -> list[dict[str, Any]]:
    """Info of every kvpool stream on the server (JetStream streams of other users are left out)."""
    link = Link(nats_url)
    try:
        infos = link.call(link.js.streams_info(), "list streams")
        return [_describe(i) for i in infos
                if any(s.startswith(SUBJECT_PREFIX + ".") for s in (i.config.subjects or []))]
    finally:
        link.close()


def delete_stream(nats_url: str, name: str) -> None:
    """Delete stream `name` and its consumers. Raises StreamNotFound if there is none. Pool blocks that its
    messages referenced are left to the pool's eviction."""
    check_token(name, "stream name")
    link = Link(nats_url, role="admin")  # configuring streams is the admin user's (see nats_creds)
    try:
        link.call(link.js.delete_stream(name), f"delete stream {name!r}")
    finally:
        link.close()


def _describe(info: Any) -> dict[str, Any]:
    c, s = info.config, info.state
    return {"name": c.name, "messages": s.messages, "bytes": s.bytes, "first_seq": s.first_seq,
            "last_seq": s.last_seq, "consumers": s.consumer_count, "max_age_s": c.max_age or 0,
            "max_bytes": max(c.max_bytes or 0, 0), "max_msgs": max(c.max_msgs or 0, 0),
            "discard": getattr(c.discard, "value", c.discard), "retention": getattr(c.retention, "value", c.retention)}

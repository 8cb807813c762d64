"""A received stream message: payload, position in the stream, and its acknowledgement.

`BaseMessage` holds what every delivery carries; `Message` settles it with blocking calls and
`kvpool.streams.aio.AsyncMessage` with coroutines (siblings, so neither overrides the other's signature).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from .envelope import TYPE, Ref
from .errors import MalformedMessage, StreamError


@dataclasses.dataclass
class BaseMessage:
    """One delivery of a stream message, without the means to settle it.

    `data` is the payload: the inline bytes, or for a by-reference payload the buffer it was fetched
    into (verified against its checksums). `blocks` are the per-block views of that buffer (`kv` layers).
    A message that could not be decoded (malformed, over the consumer's limits, or unsigned where a
    stream secret is set) has kind 'invalid', no data, and its reason in `error`: ack or term it.
    """

    seq: int
    """stream sequence number (1-based, increasing in publish order)."""
    subject: str
    kind: str
    """'inline', 'ref', 'kv' or 'end' (see `envelope`), or 'invalid' (see `error`)."""
    data: bytes | memoryview
    headers: dict[str, str]
    delivered: int
    """how many times this message has been delivered (1 = first time)."""
    timestamp: float
    """when the stream stored it, unix seconds."""
    ref: Ref | None = None
    blocks: list[memoryview] = dataclasses.field(default_factory=list)
    error: StreamError | None = None
    """why the message cannot be delivered: MalformedMessage, ForgedMessage or PayloadError; None if it can."""

    @property
    def size(self) -> int:
        """Payload size in bytes (for by-reference payloads, the bytes fetched from the pool)."""
        return self.ref.total if self.ref is not None else len(self.data)

    def json(self) -> Any:
        """The payload decoded as JSON (notifications published as dict/list); raises `error` if set, and
        MalformedMessage if the payload is not JSON (anyone may publish to a stream)."""
        if self.error is not None:
            raise self.error
        try:
            return json.loads(bytes(self.data))
        except (ValueError, RecursionError) as e:
            raise MalformedMessage(f"message {self.seq} on {self.subject[:200]!r} is not JSON: "
                                   f"{type(e).__name__}: {str(e)[:120]}", size=len(self.data)) from None

    @property
    def is_json(self) -> bool:
        return self.headers.get(TYPE) == "json"


@dataclasses.dataclass
class Message(BaseMessage):
    """A delivery from `Consumer`: until `ack()`, it is redelivered after the consumer's ack wait."""

    _settle: Callable[[str, float], None] | None = dataclasses.field(default=None, repr=False)

    def ack(self) -> None:
        """Done with it: never deliver it to this consumer (or group) again."""
        self._do("ack", 0.0)

    def nak(self, delay_s: float = 0.0) -> None:
        """Not processed: deliver it again after `delay_s` seconds."""
        self._do("nak", delay_s)

    def term(self) -> None:
        """Never deliver it again, unprocessed (e.g. its payload is missing from the pool)."""
        self._do("term", 0.0)

    def _do(self, op: str, delay_s: float) -> None:
        if self._settle is not None:
            self._settle(op, delay_s)

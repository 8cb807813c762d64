"""Errors of kvpool.streams, all under the root `KVPoolError`; NATS errors are translated in `_link`."""
from __future__ import annotations

from kvpool.core.errors import KVPoolError


class StreamError(KVPoolError):
    """Root of the stream errors."""


class StreamNotFound(StreamError, LookupError):
    """The named stream does not exist (create it with `create_stream` or `kvpool streams create`)."""


class StreamFull(StreamError):
    """A publish was refused: the stream is at its max_msgs/max_bytes limit and discards new messages."""


class StreamUnavailable(StreamError, ConnectionError):
    """The NATS server cannot be reached, or the connection is closed."""


class StreamTimeout(StreamUnavailable, TimeoutError):
    """A NATS request did not finish within its bound."""


class PayloadError(StreamError):
    """A by-reference payload cannot be delivered intact; `.message` is the message (ack or term it).

    Raised instead of ever returning wrong bytes: a block missing from the pool, or one whose size or
    checksum disagrees with what the producer published.
    """

    def __init__(self, text: str, message: object = None) -> None:
        super().__init__(text)
        self.message = message


class HandoffTimeout(StreamError, TimeoutError):
    """A prefill/decode handoff saw no next layer (or end of request) within its timeout: the producer
    is slow or died mid-request."""

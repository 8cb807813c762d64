"""Errors of kvpool.streams, all under the root `KVPoolError`; NATS errors are translated in `_link`."""
from __future__ import annotations

from kvpool.core import AuthError, CorruptBlock, KVPoolError, ProtocolError


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


class StreamRefused(StreamError):
    """NATS or JetStream refused a request for a reason other than a full or missing stream: a JetStream
    API error (its code is in the message), a bad subject, a payload over the server's max_payload,
    credentials refused."""


class PayloadError(StreamError):
    """A by-reference payload cannot be delivered intact; `.message` is the message (ack or term it).

    Raised instead of ever returning wrong bytes: a block missing from the pool, or one whose size or
    checksum disagrees with what the producer published. `key` is the block's, `size` its bytes.
    """

    def __init__(self, text: str, message: object = None, *, key: bytes | str | None = None,
                 size: int | None = None, limit: int | float | None = None) -> None:
        super().__init__(text, key=key, size=size, limit=limit)
        self.message = message


class CorruptPayload(PayloadError, CorruptBlock):
    """A by-reference payload's block fails its checksum: a PayloadError (term the message) that is
    also the pool's CorruptBlock."""


class HandoffTimeout(StreamError, TimeoutError):
    """A prefill/decode handoff saw no next layer (or end of request) within its timeout: the producer
    is slow or died mid-request."""


class MalformedMessage(StreamError, ProtocolError):
    """A delivered message cannot be decoded: an unknown kind, a malformed body, a bad key or request id,
    or a size or count past the consumer's limits (`size` and `limit` say which). It arrives as a
    message of kind 'invalid' whose `.error` is this; ack or term it (after `max_deliver` deliveries
    the consumer dead-letters it)."""


class ForgedMessage(StreamError, AuthError):
    """A message that is not from who it claims: unsigned or badly signed while a stream secret is
    configured, or a handoff message outside its request's producer chain."""


class HandoffError(StreamError):
    """A handoff request's own producer sent an inconsistent sequence (an `end` whose layer count
    disagrees with the layers that arrived, a layer twice), or two producers
    claim one request id. Raised instead of ever returning a short or mixed request."""

"""Publish/subscribe of KV blocks and notifications between instances, on NATS JetStream.

`Producer` publishes (large payloads by reference through the pool, pinned there until consumed),
`Consumer` (and its asyncio twin `AsyncConsumer`, an async iterator or a callback) receives with acks,
replay, fan-out or groups; `HandoffReceiver.iter_layers` is the decode side of a prefill/decode handoff.
Every delivered message is checked (`Limits`, a stream secret's signatures, a handoff's producer chain);
one that fails is handed out as kind 'invalid' with its `error`, or dropped by a handoff, never trusted.
"""
from .admin import StreamConfig, create_stream, dead_subject, delete_stream, list_streams, stream_info
from .aio import AsyncConsumer, AsyncMessage, Consuming
from .consumer import MAX_DELIVER, Consumer
from .envelope import Limits
from .errors import (
    CorruptPayload,
    ForgedMessage,
    HandoffError,
    HandoffTimeout,
    MalformedMessage,
    PayloadError,
    StreamError,
    StreamFull,
    StreamNotFound,
    StreamRefused,
    StreamTimeout,
    StreamUnavailable,
)
from .handoff import HandoffReceiver
from .message import BaseMessage, Message
from .producer import INLINE_MAX, Producer

__all__ = [
    "Producer", "Consumer", "AsyncConsumer", "Consuming", "BaseMessage", "Message", "AsyncMessage",
    "HandoffReceiver", "StreamConfig", "Limits", "INLINE_MAX", "MAX_DELIVER",
    "create_stream", "delete_stream", "list_streams", "stream_info", "dead_subject",
    "StreamError", "StreamFull", "StreamNotFound", "StreamRefused", "StreamTimeout", "StreamUnavailable",
    "PayloadError", "CorruptPayload", "HandoffTimeout", "HandoffError", "MalformedMessage", "ForgedMessage",
]

"""Publish/subscribe of KV blocks and notifications between instances, on NATS JetStream.

`Producer` publishes (large payloads by reference through the pool, pinned there until consumed),
`Consumer` (and its asyncio twin `AsyncConsumer`, an async iterator or a callback) receives with acks,
replay, fan-out or groups; `HandoffReceiver.iter_layers` is the decode side of a prefill/decode handoff.
"""
from .admin import StreamConfig, create_stream, delete_stream, list_streams, stream_info
from .aio import AsyncConsumer, AsyncMessage, Consuming
from .consumer import Consumer
from .errors import (
    CorruptPayload,
    HandoffTimeout,
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
    "HandoffReceiver", "StreamConfig", "INLINE_MAX",
    "create_stream", "delete_stream", "list_streams", "stream_info",
    "StreamError", "StreamFull", "StreamNotFound", "StreamRefused", "StreamTimeout", "StreamUnavailable",
    "PayloadError", "CorruptPayload", "HandoffTimeout",
]

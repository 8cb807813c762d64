"""Decode side of a prefill/decode KV handoff: the layers of one request, as soon as each is ready.

The prefill side (`Producer.publish_kv` per layer, then `Producer.end_request`) puts each layer's blocks
in the pool and publishes a `kv` message on `kvpool.stream.<stream>.req.<request_id>`. `iter_layers`
reads that subject from its start, fetches each layer's bytes, and ends at the `end` message.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from kvpool.core.client import PoolClient
from kvpool.core.keys import Key

from . import envelope as env
from ._link import Link
from .admin import check_token, subject
from .consumer import Subscription, consumer_config
from .errors import HandoffTimeout

_PREFETCH = 16
"""Layer messages pulled per request to the server (a private consumer, so no one else waits on them)."""


class HandoffReceiver:
    """Receives handoff requests from stream `stream` over one NATS connection; bytes come via `pool`."""

    def __init__(self, stream: str, nats_url: str, pool: PoolClient, *, timeout_s: float = 5.0) -> None:
        self.stream, self.pool = check_token(stream, "stream name"), pool
        self._link = Link(nats_url, timeout_s)

    def iter_layers(self, request_id: str, timeout: float = 10.0) -> Iterator[tuple[int, list[Key], list[memoryview]]]:
        """Yield (layer, block_keys, buffers) per layer in publish order, until the request's end message.

        `timeout`: seconds to wait for each next layer (or the end); past it, HandoffTimeout (the producer
        is slow or died mid-request). A missing or corrupt block raises PayloadError. Each buffer is a
        fresh, checksum-verified copy of its block."""
        filt = subject(self.stream, "req", check_token(request_id, "request id"))
        sub = Subscription(self._link, self.stream, filt, None, consumer_config("all", 60.0, 1000), self.pool,
                           prefetch=_PREFETCH)
        try:
            layers, last = 0, time.monotonic()
            while True:
                msg = sub.receive(timeout)
                if msg is None:
                    raise HandoffTimeout(f"request {request_id!r} on stream {self.stream!r}: no layer or end "
                                         f"within {timeout} s after {layers} layer(s) "
                                         f"({time.monotonic() - last:.1f} s idle); is the prefill side alive?")
                msg.ack()
                last = time.monotonic()
                if msg.kind == env.END:
                    return
                if msg.kind == env.KV and msg.ref is not None:
                    layers += 1
                    yield msg.ref.layer, msg.ref.keys, msg.blocks
        finally:
            sub.close(delete=True)

    def close(self) -> None:
        self._link.close()

    def __enter__(self) -> HandoffReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

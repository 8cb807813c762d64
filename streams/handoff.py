"""Decode side of a prefill/decode KV handoff: the layers of one request, as soon as each is ready.

The prefill side (`Producer.publish_kv` per layer, then `Producer.end_request`) puts each layer's blocks
in the pool and publishes a `kv` message on `kvpool.stream.<stream>.req.<request_id>`. `iter_layers`
reads that subject from its start through a push consumer (the server streams each layer's message as
it is stored: no pull round trip per layer), fetches each layer's bytes, and ends at the `end` message.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from nats.js import api

from kvpool.core import Key, PoolClient

from . import envelope as env
from ._link import Link
from .admin import check_token, subject
from .errors import HandoffTimeout
from .payload import fetch_many

_IDLE_S = 60.0
"""An abandoned handoff consumer (its receiver died) is dropped by the server after this many seconds."""

Into = Callable[[int, int], Any]
"""into(layer, nbytes) -> a writable buffer of at least `nbytes` for that layer's blocks, back to back."""


async def _arrived(sub: Any, timeout: float) -> list[Any]:
    """The next message and every one already queued behind it: one trip to the loop, and one pool
    request for their blocks, per burst."""
    msgs = [await sub.next_msg(timeout)]
    while sub.pending_msgs:
        msgs.append(await sub.next_msg(None))
    return msgs


class HandoffReceiver:
    """Receives handoff requests from stream `stream` over one NATS connection; bytes come via `pool`."""

    def __init__(self, stream: str, nats_url: str, pool: PoolClient, *, timeout_s: float = 5.0) -> None:
        self.stream, self.pool = check_token(stream, "stream name"), pool
        self._link = Link(nats_url, timeout_s)

    def iter_layers(self, request_id: str, timeout: float = 10.0,
                    into: Into | None = None) -> Iterator[tuple[int, list[Key], list[memoryview]]]:
        """Yield (layer, block_keys, buffers) per layer in publish order, until the request's end message.

        `timeout`: seconds to wait for each next layer (or the end); past it, HandoffTimeout (the producer
        is slow or died mid-request). A missing or corrupt block raises PayloadError. Each buffer is a
        checksum-verified copy of its block: a view into `into(layer, nbytes)` (e.g. the decode engine's
        own KV memory), or a fresh buffer. A handoff has one reader: once the end arrives, the request's
        messages are purged from the stream, which also ends the producer's pins on their blocks."""
        filt = subject(self.stream, "req", check_token(request_id, "request id"))
        cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL,
                                 inactive_threshold=_IDLE_S)
        link = self._link
        sub = link.call(link.js.subscribe(filt, stream=self.stream, config=cfg),
                        f"subscribe to request {request_id!r} of stream {self.stream!r}")
        try:
            layers, last = 0, time.monotonic()
            while True:
                try:
                    burst = link.call(_arrived(sub, timeout), f"receive request {request_id!r}", timeout=timeout)
                except TimeoutError:
                    raise HandoffTimeout(f"request {request_id!r} on stream {self.stream!r}: no layer or end "
                                         f"within {timeout} s after {layers} layer(s) ({time.monotonic() - last:.1f}"
                                         " s idle); is the prefill side alive?") from None
                last = time.monotonic()
                kinds = [env.kind_of(raw.headers) for raw in burst]
                refs = [env.Ref.decode(raw.data) for raw, kind in zip(burst, kinds) if kind == env.KV]
                got = fetch_many(self.pool, refs, [into(r.layer, r.total) if into is not None else None for r in refs],
                                 [f"layer {r.layer} of request {request_id!r}" for r in refs]) if refs else []
                for ref, (_, blocks) in zip(refs, got):
                    layers += 1
                    yield ref.layer, ref.keys, blocks
                if env.END in kinds:
                    link.call(link.js.purge_stream(self.stream, subject=filt), f"purge request {request_id!r}")
                    return
        finally:
            try:
                link.call(sub.unsubscribe(), "unsubscribe")
            except (ConnectionError, TimeoutError):
                pass  # the server is gone: it drops the consumer after _IDLE_S

    def close(self) -> None:
        self._link.close()

    def __enter__(self) -> HandoffReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

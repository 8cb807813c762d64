"""Decode side of a prefill/decode KV handoff: the layers of one request, as soon as each is ready.

The prefill side (`Producer.publish_kv` per layer, then `Producer.end_request`) puts each layer's blocks
in the pool and publishes a `kv` message on `kvpool.stream.<stream>.req.<request_id>`. `iter_layers`
reads that subject from its start through a push consumer (the server streams each layer's message as
it is stored: no pull round trip per layer), fetches each layer's bytes, and ends at the `end` message.

Anyone who can publish to the stream can publish on that subject, so each message is checked before it
counts: its kind, body and limits (`envelope`), its signature where a stream secret is set, and its place
in the request's producer chain (`sealing`); a message failing these is dropped, counted and logged. The
request's own messages are checked for consistency: a layer twice, or an `end` whose layer count
disagrees with the layers that arrived, is a HandoffError, never a short or mixed request.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from nats.js import api

from kvpool.core import Key, PoolClient

from . import envelope as env
from ._link import Link
from .admin import check_token, subject
from .consumer import Checks
from .errors import ForgedMessage, HandoffError, HandoffTimeout, MalformedMessage, StreamError
from .payload import fetch_many
from .sealing import ChainCheck, verify

log = logging.getLogger("kvpool.streams")

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
    """Receives handoff requests from stream `stream` over one NATS connection; bytes come via `pool`.

    `secret`: the stream secret (default $KVPOOL_STREAM_SECRET); when set, messages without a good
    signature are dropped. `limits`: what one layer may name (blocks, bytes), checked before `into` is
    called or anything is allocated. `counts["rejected"]`: messages dropped so far."""

    def __init__(self, stream: str, nats_url: str, pool: PoolClient, *, timeout_s: float = 5.0,
                 secret: str | bytes | None = None, limits: env.Limits | None = None) -> None:
        self.stream, self.pool = check_token(stream, "stream name"), pool
        self._checks = Checks(self.stream, pool, limits, 0, secret)
        self.counts = {"rejected": 0}
        self._link = Link(nats_url, timeout_s)

    def iter_layers(self, request_id: str, timeout: float = 10.0,
                    into: Into | None = None) -> Iterator[tuple[int, list[Key], list[memoryview]]]:
        """Yield (layer, block_keys, buffers) per layer in publish order, until the request's end message.

        `timeout`: seconds to wait for each next layer (or the end); past it, HandoffTimeout (the producer
        is slow or died mid-request). A missing or corrupt block raises PayloadError; a layer twice, an
        end whose layer count disagrees with the layers that arrived, or a second producer claiming the
        request raises HandoffError. Each buffer is a checksum-verified copy of its block: a view into
        `into(layer, nbytes)` (e.g. the decode engine's own KV memory), or a fresh buffer. A handoff has
        one reader: once the end arrives, the request's messages are purged from the stream, which also
        ends the producer's pins on their blocks."""
        filt = subject(self.stream, "req", check_token(request_id, "request id"))
        cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL,
                                 inactive_threshold=_IDLE_S)
        link = self._link
        sub = link.call(link.js.subscribe(filt, stream=self.stream, config=cfg),
                        f"subscribe to request {request_id!r} of stream {self.stream!r}")
        chain, seen, rejected = ChainCheck(request_id), set[int](), [0]
        try:
            last = time.monotonic()
            while True:
                try:
                    burst = link.call(_arrived(sub, timeout), f"receive request {request_id!r}", timeout=timeout)
                except TimeoutError:
                    raise HandoffTimeout(f"request {request_id!r} on stream {self.stream!r}: no layer or end "
                                         f"within {timeout} s after {len(seen)} layer(s) ({time.monotonic() - last:.1f}"
                                         " s idle); is the prefill side alive?") from None
                last = time.monotonic()
                refs: list[env.Ref] = []
                end: env.End | None = None
                for raw in burst:
                    item = self._admit(raw, request_id, chain, rejected)
                    if isinstance(item, env.End):
                        end = item
                        break
                    if item is not None:
                        if item.layer in seen:
                            raise HandoffError(f"request {request_id!r}: its producer sent layer {item.layer} twice")
                        seen.add(item.layer)
                        refs.append(item)
                got = fetch_many(self.pool, refs, [into(r.layer, r.total) if into is not None else None for r in refs],
                                 [f"layer {r.layer} of request {request_id!r}" for r in refs]) if refs else []
                for ref, (_, blocks) in zip(refs, got):
                    yield ref.layer, ref.keys, blocks
                if end is not None:
                    link.call(link.js.purge_stream(self.stream, subject=filt), f"purge request {request_id!r}")
                    if end.layers != len(seen):
                        raise HandoffError(f"request {request_id!r}: its end says {end.layers} layer(s); "
                                           f"{len(seen)} arrived", size=len(seen), limit=end.layers)
                    return
        finally:
            try:
                link.call(sub.unsubscribe(), "unsubscribe")
            except (ConnectionError, TimeoutError):
                pass  # the server is gone: it drops the consumer after _IDLE_S

    def _admit(self, raw: Any, request_id: str, chain: ChainCheck, rejected: list[int]) -> env.Ref | env.End | None:
        """The layer or end in `raw` if it is the request producer's next message; None (dropped,
        counted, logged) if it is malformed, unsigned where a secret is set, or outside the chain."""
        headers = dict(raw.headers or {})
        item: env.Ref | env.End
        try:
            kind = env.kind_of(headers)
            key = self._checks.key
            if key is not None and (why := verify(key, raw.subject, headers, raw.data)):
                raise ForgedMessage(f"{why} (a stream secret is set)")
            if kind == env.KV:
                item = env.Ref.decode(raw.data, self._checks.current_limits())
            elif kind == env.END:
                item = env.End.decode(raw.data, self._checks.limits)
            else:
                raise MalformedMessage(f"a {kind!r} message on a handoff subject")
            if item.request != request_id:
                raise MalformedMessage(f"it names request {item.request!r}")
            if not chain.accept(item.seal, last=kind == env.END):
                raise ForgedMessage("it is outside the request's producer chain (forged or replayed)")
        except (MalformedMessage, ForgedMessage) as e:
            self._reject(request_id, raw, e, rejected)
            return None
        return item

    def _reject(self, request_id: str, raw: Any, err: StreamError, rejected: list[int]) -> None:
        rejected[0] += 1
        self.counts["rejected"] += 1
        seq = getattr(getattr(raw, "metadata", None), "sequence", None)
        (log.warning if rejected[0] == 1 else log.debug)(
            "stream %r, request %r: dropped message %s (%d dropped in this request): %s", self.stream, request_id,
            getattr(seq, "stream", "?"), rejected[0], err)

    def close(self) -> None:
        self._link.close()

    def __enter__(self) -> HandoffReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

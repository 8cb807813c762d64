"""Producer: publish notifications and payloads to a stream; large payloads go by reference.

Payloads of at most `inline_max` bytes travel inside the NATS message. Larger ones are put in the pool
(PoolClient) and the message carries only their keys, sizes and checksums, so NATS never carries bulk
bytes; their blocks stay pinned in the pool while the message may still be read (`pins.PinKeeper`).
The prefill side of a KV handoff uses `publish_kv` per layer and `end_request` when done.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import numbers
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

from kvpool.core import Alarm, ConfigError, InvalidArgument, Key, KVPoolError, PoolClient, Stagers, readable

from . import envelope as env
from ._link import Link
from .admin import check_token, subject
from .announcer import Announcer
from .errors import StreamUnavailable
from .layer_hold import HOLD_S, LayerHold
from .payload import put_blocks, put_payload
from .pins import PinKeeper
from .sealing import Sealer, secret_from, sign
from .wire import Wire

log = logging.getLogger("kvpool.streams")

INLINE_MAX = 256 << 10
"""Default largest payload sent inline, in bytes."""
PIN_TTL_S = 60.0
"""Default bound, in seconds, on how long a by-reference payload's pins outlive its producer."""
_HEADER_NAME = re.compile(r"^[!-9;-~]+$")
"""A header name: printable ASCII but ':' (no spaces)."""
_RETRY_S = 0.1
"""How long after its send failed the alarm tries again to announce layers that wait (NATS away)."""
_HEADER_ROOM = 4096
"""What a handoff message's headers may take besides its body, against the server's max_payload."""
_OPEN_REQUESTS = 4096
"""Handoff requests a producer keeps the chain of until their end; past it the oldest is forgotten
(its further messages start a new chain, which its receiver refuses as a second producer)."""


def encode(data: Any) -> tuple[memoryview, str]:
    """The bytes a message carries for `data` and their type: a dict/list as JSON, anything else as
    its bytes (bytes-like, numpy, torch). Whether a payload goes inline or by reference is decided on
    these bytes."""
    if isinstance(data, (dict, list)):
        return memoryview(json.dumps(data).encode()), "json"
    return readable(data), "bytes"


class Producer:
    """Publishes to stream `stream` (which must exist: `create_stream`). Not thread-safe.

    `pool` is needed only for payloads larger than `inline_max` bytes and for `publish_kv`. Their blocks
    are pinned until every consumer has acked the message or retention drops it, while this producer
    lives, and for at most `pin_ttl_s` seconds after it closes or dies (0: no pins). Unacked `publish`
    payloads stay pinned up to `max_pinned_bytes` (default: a quarter of the pool's DRAM); past it the
    oldest are unpinned, so consumers that never ack cannot fill the pool (a consumer that reads one
    the pool then evicted gets a PayloadError).
    A publish to a full stream with discard=new raises `StreamFull`; one to a missing stream raises
    `StreamNotFound`. `secret`: the stream secret (default $KVPOOL_STREAM_SECRET; "" for none): every
    message is signed with it (HMAC-SHA256), for consumers and handoff receivers that require it.
    `hold_s`: a handoff request's layers that come within this many seconds of each other are announced
    together (`layer_hold`; 0: each at once).
    """

    def __init__(self, stream: str, nats_url: str, pool: PoolClient | None = None, *,
                 inline_max: int = INLINE_MAX, pin_ttl_s: float = PIN_TTL_S, timeout_s: float = 5.0,
                 max_pinned_bytes: int | None = None, secret: str | bytes | None = None,
                 hold_s: float = HOLD_S) -> None:
        self.stream = check_token(stream, "stream name")
        self._key = secret_from(secret)
        self._chains: collections.OrderedDict[str, Sealer] = collections.OrderedDict()
        if inline_max < 0 or pin_ttl_s < 0 or not 0 <= hold_s <= 1:
            raise ConfigError(f"inline_max={inline_max} bytes and pin_ttl_s={pin_ttl_s} must be >= 0, "
                              f"hold_s={hold_s} 0 to 1 s")
        self.pool, self.inline_max, self.pin_ttl_s = pool, inline_max, pin_ttl_s
        self.max_pinned_bytes = max_pinned_bytes
        self._link = Link(nats_url, timeout_s)
        # what a producer dropped unclosed must still let go (its pin keeper would renew for ever): stopped
        # by a finalizer, which holds these and never the producer
        self._held: list[Callable[[], None]] = [self._link.close]
        self._dropped = weakref.finalize(self, _release_later, self._held)
        self._dropped.atexit = False  # (a process that exits takes its threads and connections along)
        self._pins: PinKeeper | None = None
        self._announcer: Announcer | None = None  # on a Wire of its own, made at the first handoff message
        self._stagers: Stagers | None = None  # publish_kv's puts to workers on this node
        self._waiting = LayerHold(hold_s)  # layers published, not announced yet
        self._alarm_thread: Alarm | None = None  # announces them should no call come (made at the first)
        self._late_failed = False  # (an alarm's send failed before: logged once)
        self._lock = threading.Lock()  # the caller's calls against the alarm's

    def publish(self, data: Any, *, topic: str = "msg", headers: dict[str, str] | None = None) -> int:
        """Publish a dict/list (as JSON) or a bytes-like/numpy/torch payload; returns its stream sequence.

        `topic` is the last subject token (consumers may filter on it)."""
        view, kind = encode(data)
        hdrs = {**_checked_headers(headers or {}), env.TYPE: kind}
        subj = subject(self.stream, check_token(topic, "topic"))
        if len(view) <= self.inline_max:
            return self._send(subj, bytes(view), {**hdrs, env.KIND: env.INLINE})
        ref = put_payload(self._need_pool(f"a payload of {len(view)} bytes"),
                          f"kvpool.stream/{self.stream}/{uuid.uuid4().hex}", view, pin_s=self.pin_ttl_s)
        return self._send_ref(subj, ref, {**hdrs, env.KIND: env.REF})

    def publish_kv(self, request_id: str, layer: int, block_keys: Sequence[Key], tensors: Sequence[Any]) -> None:
        """Put one layer's KV blocks in the pool under `block_keys` and announce them to the decode side.

        `tensors`: one buffer (bytes-like, numpy, torch) per key. Returns once the blocks are in the pool's
        memory and the announcement is sent, without waiting for JetStream to acknowledge it (nor, on this
        node, for the worker to commit them: their commit goes after the announcement, with those of the next
        layers while they come fast: `kvpool.core.shm_stage`), so that the
        next layer's put overlaps this one's publish; `end_request` waits for both. While a request's
        layers come within `HOLD_S` of each other, those after its first wait to be announced together
        (`layer_hold`: up to `HOLD_LAYERS` in one message, none past `HOLD_S` after the last layer, nor
        past `end_request`). An announcement the stream refused (e.g. StreamFull) raises from the next
        call. A call that raises announced nothing of its layer: it may be published again (e.g. once NATS
        is back); layers held from calls before go with the next call's."""
        if len(block_keys) != len(tensors):
            raise InvalidArgument(f"{len(block_keys)} block keys but {len(tensors)} tensors")
        limits = env.Limits()
        most = limits.max_keys
        if not 0 < len(block_keys) <= most:  # what a receiver takes (it would drop the layer, then time out)
            raise InvalidArgument(f"a layer of {len(block_keys)} blocks: a layer has 1 to {most}",
                                  size=len(block_keys), limit=most)
        limit = limits.max_layer
        if not isinstance(layer, numbers.Integral) or isinstance(layer, bool) or not 0 <= layer <= limit:
            raise InvalidArgument(f"layer {layer!r} must be an integer from 0 to {limit}", limit=limit)
        layer = int(layer)
        subj = subject(self.stream, "req", check_token(request_id, "request id"))
        pool = self._need_pool("publish_kv")
        with self._lock:
            self._announcing().ready()
        if self._stagers is None:
            self._stagers = Stagers(pool)
            self._held.append(self._stagers.close)
        ref = put_blocks(pool, block_keys, tensors, request=request_id, layer=layer, pin_s=self.pin_ttl_s,
                         stagers=self._stagers, hold=True)
        try:
            with self._lock:
                waiting = self._waiting
                if not waiting.fits(request_id, ref):  # (another request's, or too many blocks or bytes)
                    self._announce_waiting()
                chain = self._chain(request_id)  # (after: making it may let the oldest request's chain go)
                now = time.monotonic()
                if waiting.add(request_id, subj, chain, ref, now):
                    self._alarm().arm(now + waiting.hold_s)
                else:
                    try:
                        self._announce_waiting()
                    except BaseException:  # not announced: a retry of this layer takes its place
                        waiting.drop_last()
                        raise
                chain.layers += 1
        finally:  # the worker commits the layer while the announcement is on its way, not before
            self._stagers.send_held()

    def _announce_waiting(self) -> None:
        """Announce the layers waiting (`LayerHold`), one as `kv`, several as `kv-layers`, in one message
        sealed as the next of their request's chain (lock held); layers whose one message would pass the
        server's max_payload go one to a message. One that raises announced none of them: they wait on,
        for the next call (or the alarm) to send."""
        waiting = self._waiting
        if waiting.refs and self._send_layers(waiting.refs):
            waiting.clear()
        while waiting.refs:
            self._send_layers(waiting.refs[:1])
            waiting.take_first()

    def _send_layers(self, refs: list[env.Ref]) -> bool:
        """Announce `refs` (the first layers waiting) in one message sealed as the next of their chain;
        False, with nothing sent, for several whose message would pass the server's max_payload. Nothing
        is announced if it raises."""
        waiting, announcer = self._waiting, self._announcing()
        request, subj, chain = cast(str, waiting.request), waiting.subject, cast(Sealer, waiting.chain)
        seal = chain.next()
        if len(refs) == 1:
            kind, body = env.KV, refs[0].encode(seal)
        else:
            kind, body = env.KV_LAYERS, env.Layers(request, refs, seal).encode()
            if len(body) + _HEADER_ROOM > announcer.max_payload:
                chain.take_back()
                return False
        try:
            announcer.send(subj, body, self._signed(subj, {env.KIND: kind, **_sent()}, body),
                           [k for r in refs for k in r.keys], sum(r.total for r in refs))
        except BaseException:  # not announced: the next message takes its place in the chain
            chain.take_back()
            raise
        return True

    def _announce_held_now(self) -> None:
        with self._lock:
            self._announce_waiting()

    def _alarm(self) -> Alarm:
        if self._alarm_thread is None:
            self._alarm_thread = Alarm(weakref.WeakMethod(self._announce_late), "kvpool-announce",
                                       "announcing held layers")
            self._held.append(self._alarm_thread.stop)
        return self._alarm_thread

    def _announce_late(self) -> None:
        """The alarm's turn: announce the layers still waiting `HOLD_S` after the producer's last one. A
        failure leaves them waiting: the alarm tries again `_RETRY_S` later, and the producer's next call
        sends them or raises (the first failure is logged as a warning, later ones at debug level)."""
        with self._lock:
            if self._waiting.refs:
                try:
                    self._announce_waiting()
                except Exception as e:
                    (log.debug if self._late_failed else log.warning)(
                        "stream %r: announcing held layers failed (tried again in %s s, and by the next call): %r",
                        self.stream, _RETRY_S, e)
                    self._late_failed = True
                    self._alarm().arm(time.monotonic() + _RETRY_S)

    def _announcing(self) -> Announcer:
        if self._announcer is None:
            wire = Wire(self._link.url, self._link.timeout_s)
            try:
                self._announcer = Announcer(wire, self.stream, self._stored, self._unpin)
            except BaseException:
                wire.close()
                raise
            self._held.append(wire.close)
        return self._announcer

    def _chain(self, request_id: str) -> Sealer:
        chain = self._chains.get(request_id)
        if chain is None:
            chain = self._chains[request_id] = Sealer()
            if len(self._chains) > _OPEN_REQUESTS:
                self._chains.popitem(last=False)
        return chain

    def _signed(self, subj: str, headers: dict[str, str], body: bytes) -> dict[str, str]:
        """`headers`, with the message's signature if this producer has a stream secret."""
        if self._key is not None:
            headers[env.SIG] = sign(self._key, subj, headers, body)
        return headers

    def flush(self) -> None:
        """Wait until the pool committed every layer put so far and JetStream stored every kv announcement
        sent (publish_kv waits for neither), the layers held to go together sent first; raises the error
        of any refused."""
        with self._lock:
            self._announce_waiting()
            if self._stagers is not None:
                self._stagers.settle()
            if self._announcer is not None:
                self._announcer.flush()

    def end_request(self, request_id: str, layers: int | None = None) -> int:
        """Tell the decode side that request `request_id` has no more layers, once JetStream has stored
        every layer announced before; raises the error of any it refused. Returns the end's sequence.

        The end carries the number of layers this producer published for the request (the receiver
        checks it against what arrived); `layers`, if given, must agree with it. A call that raises may be
        made again: the receiver takes the end once."""
        subj = subject(self.stream, "req", check_token(request_id, "request id"))
        with self._lock:
            self._announce_waiting()  # (the request's last layers, held to go together)
            return self._end(request_id, subj, layers)

    def _end(self, request_id: str, subj: str, layers: int | None) -> int:
        published = self._chains[request_id].layers if request_id in self._chains else 0
        if self._stagers is not None:
            self._stagers.settle()  # a layer's put the worker refused fails the request here, not its end
        if layers is not None and layers != published:
            raise InvalidArgument(f"end_request({request_id!r}, layers={layers}): this producer published "
                                  f"{published} layer(s) of it", size=layers, limit=published)
        chain = self._chain(request_id)  # (kept until the end is stored: asked again, it goes on the same chain)
        body = env.End(request_id, chain.layers, chain.next(last=True)).encode()
        headers = {env.KIND: env.END, env.TYPE: "json", **_sent()}
        try:
            # (one duplicate id for the request's end: an end asked again after one stored but not
            # acknowledged is stored once, and a receiver's purge leaves no copy behind to fail the id's next use)
            seq = self._announcing().publish(subj, body, self._signed(subj, headers, body),
                                             msg_id=f"kvpool-end.{chain.end_id}")
        except BaseException:  # the end may be asked again (sent, but not acknowledged)
            chain.take_back()
            raise
        self._chains.pop(request_id, None)
        return seq

    def _stored(self, seq: int, subj: str, keys: Sequence[Key], nbytes: int) -> None:
        """JetStream stored kv announcement `seq` (blocks `keys`, `nbytes` of them): they stay pinned
        until it is consumed, within the producer's `max_pinned_bytes`."""
        if self.pin_ttl_s:
            self._keeper().add(seq, subj, keys, nbytes)

    def _unpin(self, keys: Sequence[Key]) -> None:
        """A kv announcement was refused: nothing will read its blocks through the stream."""
        if self.pin_ttl_s:
            self._need_pool("unpin").batch_pin(keys, 0)

    def _keeper(self) -> PinKeeper:
        if self._pins is None:
            pool = self._need_pool("pins")
            budget = self.max_pinned_bytes if self.max_pinned_bytes is not None else _default_budget(pool)
            self._pins = PinKeeper(self._link, self.stream, pool, self.pin_ttl_s, budget)
            self._held.append(self._pins.stop)
        return self._pins

    def _need_pool(self, what: str) -> PoolClient:
        if self.pool is None:
            raise ConfigError(f"{what} goes by reference (above inline_max={self.inline_max} bytes) and "
                              "needs a PoolClient: Producer(..., pool=PoolClient(...))")
        return self.pool

    def _send_ref(self, subj: str, ref: env.Ref, headers: dict[str, str]) -> int:
        """Publish a reference to blocks under keys we made up and keep them pinned while it may be
        read. If JetStream refused the message, the blocks are removed (nobody can ever learn their
        names); if the publish timed out or the connection broke, JetStream may have stored it
        anyway, so the blocks stay, pinned for `pin_ttl_s` and evictable after that, and a consumer
        of a stored message still finds its payload."""
        pool = self._need_pool("a reference")
        try:
            seq = self._send(subj, ref.encode(), headers)
        except StreamUnavailable:  # includes StreamTimeout: the outcome is unknown
            raise
        except BaseException:
            pool.batch_remove(ref.keys)
            raise
        if self.pin_ttl_s:
            self._keeper().add(seq, subj, ref.keys, ref.total)
        return seq

    def _send(self, subj: str, body: bytes, headers: dict[str, str]) -> int:
        headers = self._signed(subj, dict(headers), body)
        ack = self._link.call(self._link.js.publish(subj, body, stream=self.stream, headers=headers),
                              f"publish {len(body)} bytes to stream {self.stream!r}")
        return int(ack.seq)

    def close(self) -> None:
        """Wait until JetStream stored every kv announcement (raising any refusal), release the pins of
        messages already done (the others expire within `pin_ttl_s`) and disconnect from NATS (the pool
        client is the caller's to close)."""
        with contextlib.ExitStack() as stack:
            stack.callback(self._dropped.detach)  # (last: what is below is let go in order)
            stack.callback(self._link.close)
            if self._pins is not None:
                stack.callback(self._pins.close)
            if self._announcer is not None:
                stack.callback(self._announcer.close)
                stack.callback(self._announcer.flush)
                stack.callback(self._announce_held_now)
            if self._alarm_thread is not None:
                stack.callback(self._alarm_thread.stop)
            if self._stagers is not None:
                stack.callback(self._stagers.close)
                self._stagers.settle()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sent() -> dict[str, str]:
    """A handoff message's publish time header (`envelope.SENT`): a receiver drops a replay older than the
    stream keeps messages (signed, with a stream secret; without one, not authenticated)."""
    return {env.SENT: str(time.time_ns() // 1_000_000)}


def _release_later(held: list[Callable[[], None]]) -> None:
    """What a producer dropped unclosed held, let go on a thread of its own: a collection runs the
    finalizer on whichever thread it happens on, maybe one of those being stopped, or one holding a lock
    that closing takes (a stager's flusher)."""
    threading.Thread(target=_release, args=(held,), name="kvpool-producer-drop", daemon=True).start()


def _release(held: list[Callable[[], None]]) -> None:
    """Each of `held`, the last made first, whatever the one before raised (logged: nobody is left to
    raise to). The pin keeper stops without a last pass: its pins expire within `pin_ttl_s`."""
    for close in reversed(held):
        try:
            close()
        except Exception as e:
            log.warning("releasing what a producer dropped unclosed held: %r", e)


def _checked_headers(headers: dict[str, str]) -> dict[str, str]:
    """`headers` if each name is a header token and each value one line of UTF-8 text; InvalidArgument
    otherwise (a CR/LF would let a value add headers of its own, and a lone surrogate cannot be sent)."""
    for name, value in headers.items():
        if not (isinstance(name, str) and isinstance(value, str) and _HEADER_NAME.match(name)
                and "\r" not in value and "\n" not in value and _utf8(value)):
            raise InvalidArgument(f"header {str(name)[:40]!r}: {str(value)[:40]!r} is not a header name "
                                  "with one line of UTF-8 text")
    return headers


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _default_budget(pool: PoolClient) -> int | None:
    """A quarter of the pool's DRAM (all workers), or no budget when the pool cannot tell."""
    try:
        stats = pool.stats()
    except KVPoolError:
        return None
    return stats.total.dram_capacity // 4 or None

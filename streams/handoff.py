"""Decode side of a prefill/decode KV handoff: the layers of one request, as soon as each is ready.

The prefill side (`Producer.publish_kv` per layer, then `Producer.end_request`) puts each layer's blocks
in the pool and publishes a `kv` message on `kvpool.stream.<stream>.req.<request_id>`. `iter_layers`
takes each message live, the moment the NATS server routes it (`live.Feed`: a core NATS subscription on
the subject; no JetStream consumer and no round trip per layer), and reads the stream's stored copy of
the subject where the live path may have missed one: at start unless the request's first message comes
live within `FIRST_LIVE_S`, on a gap in the request's chain, after `RECOVER_S` without news, and before
giving up. It copies each layer's blocks into the caller's buffer, on the producer's node straight from
the worker's shared memory where the message says the producer committed them (no request to the
worker; `payload.fetch_many`), elsewhere from the pool, and ends at the `end` message.

Anyone who can publish to the stream can publish on that subject, so each message is checked before it
counts: its kind, body and limits (`envelope`), its signature where a stream secret is set, and its place
in the request's producer chain (`sealing`); a message failing these is dropped, counted and logged. The
chain also orders the request: a message ahead of its place waits for the ones before it, and one seen
twice (live and read back) counts once. The request's own messages are checked for consistency: a layer
twice, or an `end` whose layer count disagrees with the layers that arrived, is a HandoffError, never a
short or mixed request. A request id is for one request while the stream keeps its messages: messages of
a second chain on the subject (the id used again, a second producer, a forged first message) fail the
request with HandoffError, never yield another request's layers; a message published longer ago than the
stream keeps messages (`envelope.SENT`) is a replay, dropped.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from kvpool.core import CLOCK_SKEW_MS, Key, PoolClient

from . import envelope as env
from ._link import Link, translate
from .admin import check_token, subject
from .consumer import Checks
from .errors import ForgedMessage, HandoffError, HandoffTimeout, MalformedMessage, StreamError
from .live import Feed, Raw, Retention, direct_last, purge_upto, stored_last, stored_seq
from .payload import by_bytes, fetch_many, overlapping
from .request_chain import Item, RequestChain
from .sealing import two_chains, verify
from .wire import Wire

log = logging.getLogger("kvpool.streams")

RECOVER_S = 0.1
"""Seconds without a message after which a receiver reads the stream back, in case the live path lost
one (a slow subscriber, a reconnect); also how soon a lost message is found when none follows it.
Each read-back that finds nothing doubles the wait, up to `RECOVER_MAX_S` (so that many receivers
waiting on a slow prefill do not poll JetStream), and progress resets it."""
RECOVER_MAX_S = 2.0
FIRST_LIVE_S = 0.002
"""How long a receiver waits for its request's first message to come live before it reads the stream
back (where a request published before the receiver subscribed is found)."""
LOOK_S = 0.25
"""The least time a read-back is given (more while the caller's timeout allows, up to the link's): with
NATS unreachable, `iter_layers(timeout=t)` gives up after about t + LOOK_S, not the link's timeout."""
_PURGING = 64
"""Purges a receiver lets run in the background at once; the next request's waits for one to end."""
_END_STORED_S = 1.0
"""How long a receiver's purge of a request whose end came live waits for the stream to have stored the
end, so that the purge takes it too."""
_SCAN_AFTER_S = 0.01
"""How long a purge waits for the end it took live to be the subject's last stored message before it looks
through the subject for it (a request of the same id stored after it)."""
RETENTION_WAIT_S = 1.0
"""How long a receiver that does not know the stream's max_age yet (its ask not answered, or failed: a
receiver made before its stream) waits for an answer before it checks a message's age; after a wait that
timed out it waits no more, and checks the ages once an answer comes (`live.Retention`)."""
_SCAN = 70000
"""Messages of a request's subject looked through for its end, where the end came live and the subject's
last stored message is not it (a request of the same id published after it): a request's layers and end."""

Into = Callable[[int, int], Any]
"""into(layer, nbytes) -> a writable buffer of at least `nbytes` for that layer's blocks, back to back."""


class HandoffReceiver:
    """Receives handoff requests from stream `stream` over one NATS connection; bytes come via `pool`.

    `secret`: the stream secret (default $KVPOOL_STREAM_SECRET); when set, messages without a good
    signature are dropped. `limits`: what one layer may name (blocks, bytes), checked before `into` is
    called or anything is allocated. `counts`: messages `rejected` (dropped) and `recovered` (taken from
    the stream's stored copy rather than live: published before the receiver subscribed, or lost on
    the live path), and blocks read `in_place` (from the worker's shared memory on the producer's node)
    and `from_pool` (a get: another node, or a place that did not hold the block any more) so far.

    A request id is for one request while the stream keeps its messages (its max_age). The first producer
    chain the receiver sees is the request's; a message of another chain of the id, stored or arriving (an
    earlier request nobody read, a replay of one, a second producer, a forged first message), fails the
    request with HandoffError. Where the receiver reads the stream back before it took any message, it
    also looks at the subject's last stored message (one get, where the read-back stopped short of it): an
    earlier complete request followed by a newer one fails before any layer is yielded. A receiver that
    reads an earlier request whole before the newer one is published takes it: ids that are not used again
    are the only sure way.

    Every handoff message carries its publish time (`envelope.SENT`: ms, the producer's clock); one
    published longer ago than the stream's max_age (plus the clock skew allowed,
    `kvpool.core.versions.CLOCK_SKEW_MS`) cannot be a stored one: a replay, dropped. The time is signed
    where a stream secret is set; without one nothing authenticates it, and the check only drops stale
    copies. The max_age is asked when the receiver is made (again every `live.ASK_AGAIN_S` while an ask
    fails: a receiver made before its stream); a message to check before it is known waits up to
    `RETENTION_WAIT_S` for the answer, and passes unchecked where none comes."""

    def __init__(self, stream: str, nats_url: str, pool: PoolClient, *, timeout_s: float = 5.0,
                 secret: str | bytes | None = None, limits: env.Limits | None = None) -> None:
        self.stream, self.pool = check_token(stream, "stream name"), pool
        self._checks = Checks(self.stream, pool, limits, 0, secret)
        self.counts = {"rejected": 0, "recovered": 0, "in_place": 0, "from_pool": 0}
        self._purges: dict[str, concurrent.futures.Future[Any]] = {}  # purges under way by subject (`_purge`)
        self._purges_lock = threading.Lock()
        self._purger = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-purge")
        self._link = Link(nats_url, timeout_s)
        wires: list[Wire] = []
        try:
            self._wire = Wire(nats_url, timeout_s)  # the live messages, read in the caller's thread
            wires.append(self._wire)
            # the purges' requests, on a connection of their own: on the live one, the purge thread's wait
            # for an answer would read the caller's messages and hand them over (a wake-up more for each)
            self._purge_wire = Wire(nats_url, timeout_s)
            wires.append(self._purge_wire)
        except BaseException:
            for wire in wires:
                wire.close()
            self._link.close()
            raise
        # a receiver dropped unclosed lets its sockets go too (its link disconnects by its own finalizer)
        self._dropped = weakref.finalize(self, _close_all, wires)
        self._dropped.atexit = False
        self._retention = Retention(self._link, self.stream)

    def iter_layers(self, request_id: str, timeout: float = 10.0,
                    into: Into | None = None) -> Iterator[tuple[int, list[Key], list[memoryview]]]:
        """Yield (layer, block_keys, buffers) per layer in publish order, until the request's end message.

        `timeout`: seconds to wait for each next layer (or the end); past it, HandoffTimeout (the producer
        is slow or died mid-request). A missing or corrupt block raises PayloadError; a layer twice, an
        end whose layer count disagrees with the layers that arrived, or messages of a second producer
        chain on the request's subject (a second producer, a forged first message, the id used again
        within the stream's max_age) raise HandoffError. Each buffer is a checksum-verified copy of its
        block: a view into `into(layer, nbytes)` (e.g. the decode engine's own KV memory), or a fresh
        buffer. A handoff has one reader: once the end arrives, the request's messages are purged from the
        stream (in the background: the loop ends with the last layer; `close` waits for the purges under
        way), which also ends the producer's pins on their blocks."""
        filt = subject(self.stream, "req", check_token(request_id, "request id"))
        with self._purges_lock:
            earlier = self._purges.get(filt)
        if earlier is not None:  # the id read again: the earlier request's messages go first, or they are read as
            concurrent.futures.wait([earlier], min(timeout, self._purge_s()))  # this one's (stale layers)
            if not earlier.done():
                raise HandoffTimeout(f"request {request_id!r} on stream {self.stream!r}: the earlier request of this "
                                     f"id was not purged within {timeout} s (is NATS reachable?)")
        feed = Feed(self._link, self._wire, self.stream, filt)
        rejected = [0]
        req = RequestChain(request_id, lambda raw, err: self._reject(request_id, raw, err, rejected))
        seen: set[int] = set()
        try:
            last = time.monotonic()
            # What was published before we subscribed is read back only if the first message to come
            # live is not the request's first (a gap), or none comes within FIRST_LIVE_S: a receiver that
            # starts as its producer does (layers racing in) takes them live, not one get_msg each.
            burst: list[Raw] = []
            recover = False
            quiet = FIRST_LIVE_S
            while True:
                if not burst and (recover or feed.reconnected()):
                    burst, recover = feed.stored(max(LOOK_S, last + timeout - time.monotonic())), False
                    if not burst:
                        quiet = max(RECOVER_S, min(2 * quiet, RECOVER_MAX_S))
                elif not burst:
                    idle = time.monotonic() - last
                    if idle >= timeout:
                        burst = feed.stored(LOOK_S)  # a last look: the live path may have lost the rest
                        if not burst:
                            raise HandoffTimeout(
                                f"request {request_id!r} on stream {self.stream!r}: no layer or end within "
                                f"{timeout} s after {len(seen)} layer(s) ({idle:.1f} s idle); is the prefill "
                                "side alive?")
                    else:
                        burst = feed.live(min(quiet, timeout - idle))
                        recover = not burst  # quiet for a while: read the stream back
                if not burst:
                    continue
                live = burst[0].seq is None
                refs: list[env.Ref] = []
                end: tuple[env.End, Raw] | None = None
                admitted = [(one, raw) for raw in burst if (one := self._admit(raw, request_id, rejected)) is not None]
                if not live and admitted and req.chain.nonce is None:  # nothing taken yet: look at all of it first
                    self._one_request(feed, request_id, burst, admitted, max(LOOK_S, last + timeout - time.monotonic()))
                for item, raw in admitted:
                    for it, came in req.take(item, raw):
                        self.counts["recovered"] += came.seq is not None
                        if isinstance(it, env.End):
                            end = it, came
                            break
                        for ref in it.refs if isinstance(it, env.Layers) else (it,):
                            if ref.layer in seen:
                                raise HandoffError(f"request {request_id!r}: its producer sent layer {ref.layer} twice")
                            seen.add(ref.layer)
                            refs.append(ref)
                    if end is not None:
                        break
                burst = []
                if refs or end is not None:
                    last, quiet = time.monotonic(), RECOVER_S
                recover = req.gap and live  # a live message ahead of its place: one was lost, read back
                for part in by_bytes(refs, self._checks.limits.max_bytes):  # (a burst read back may name
                    # thousands of layers: what is read ahead of the caller stays within one message's bound)
                    yield from self._fetched(part, into, request_id)
                if end is not None:
                    req.drop_waiting()
                    try:
                        self._purge(filt, end[1], request_id)
                    except StreamError as e:
                        self._not_purged(request_id, e)
                    if end[0].layers != len(seen):
                        raise HandoffError(f"request {request_id!r}: its end says {end[0].layers} layer(s); "
                                           f"{len(seen)} arrived", size=len(seen), limit=end[0].layers)
                    return
        finally:
            feed.close()

    def _fetched(self, part: list[env.Ref], into: Into | None,
                 request_id: str) -> Iterator[tuple[int, list[Key], list[memoryview]]]:
        """Each layer of `part` as `iter_layers` yields it, its blocks copied in one pool request for the
        run; one at a time, each as it is yielded, where `into` gave layers of the run buffers that share
        bytes (a scratch buffer used again for each layer: copied all at once, each would hold the last)."""
        intos = [into(r.layer, r.total) if into is not None else None for r in part]
        whats = [f"layer {r.layer} of request {request_id!r}" for r in part]
        step = 1 if len(part) > 1 and overlapping(intos) else len(part)
        for at in range(0, len(part), step):
            got = fetch_many(self.pool, part[at:at + step], intos[at:at + step], whats[at:at + step], self.counts)
            for ref, (_, blocks) in zip(part[at:at + step], got):
                yield ref.layer, ref.keys, blocks

    def _purge(self, filt: str, end: Raw, request_id: str) -> None:
        """Drop the request's messages from the stream, in the background (the receiver's purge thread):
        the caller has every layer, and its engine need not wait for housekeeping. A purge that fails is
        logged (the stream's limits drop the messages); `close` waits for those under way, and a request
        ending with `_PURGING` under way for one of them."""
        with self._purges_lock:
            running = list(self._purges.values())
        if len(running) >= _PURGING:  # JetStream slower than the requests end: no queue without bound
            concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        try:
            future = self._purger.submit(self._purge_now, filt, end, request_id)
        except RuntimeError:  # closed
            return
        with self._purges_lock:
            self._purges[filt] = future
        future.add_done_callback(lambda done: self._purged(filt, done))

    def _purge_now(self, filt: str, end: Raw, request_id: str) -> None:
        """The purge (see `_purge`), up to the request's end and not one message past it: a request of the
        same id after it stays. Its requests go on a `Wire` (about a third of the CPU nats-py took for
        them), all within the link's timeout and `_END_STORED_S`."""
        deadline = time.monotonic() + self._link.timeout_s + _END_STORED_S
        try:
            upto = end.seq if end.seq is not None else self._end_seq(filt, end, deadline)
            if upto is None:  # never without a bound: it would take a later request of the same id too
                raise StreamError("its end is not among the stream's messages (the stream's limits drop them)")
            purge_upto(self._purge_wire, self.stream, filt, upto, max(0.0, deadline - time.monotonic()))
        except Exception as e:  # housekeeping: every layer is in the caller's hands
            err = translate(e, f"purge request {request_id!r}")
            self._not_purged(request_id, err if isinstance(err, StreamError) else StreamError(repr(err)))

    def _end_seq(self, filt: str, end: Raw, deadline: float) -> int | None:
        """The stream sequence of `end`, which came live: it may not be stored yet, so this waits (briefly)
        until it is the subject's last stored message; or, once it had the time to be stored, looks
        through the subject for it (a request of the same id stored after it). None if not found by
        `_END_STORED_S`."""
        start = time.monotonic()
        pause = 0.001
        while True:
            last = self._last_stored(filt, deadline)
            if last is not None and last.data == end.data:
                return last.seq
            late = time.monotonic() - start
            if last is not None and late > _SCAN_AFTER_S:
                left = max(0.0, deadline - time.monotonic())
                upto: int | None = self._link.call(
                    asyncio.wait_for(stored_seq(self._link, self.stream, filt, end.data, _SCAN), left),
                    f"look for the end of {filt!r} in stream {self.stream!r}", timeout=left)
                if upto is not None:
                    return upto
            if late > _END_STORED_S:
                return None
            time.sleep(pause)
            pause = min(2 * pause, 0.05)  # a stream that never stores it is not asked 1000 times

    def _last_stored(self, filt: str, deadline: float) -> Raw | None:
        """The subject's last stored message: a direct get on the purges' `Wire`, or where the stream
        serves none (created without allow_direct; or gone for a moment: asked each time), a get through
        the link."""
        got = direct_last(self._purge_wire, self.stream, filt, max(0.0, deadline - time.monotonic()))
        if got is not False:
            return got if isinstance(got, Raw) else None
        left = max(0.0, deadline - time.monotonic())
        return self._link.call(asyncio.wait_for(stored_last(self._link, self.stream, filt), left),
                               f"read the last message of {filt!r} from stream {self.stream!r}", timeout=left)

    def _purged(self, filt: str, future: concurrent.futures.Future[Any]) -> None:
        with self._purges_lock:
            if self._purges.get(filt) is future:
                del self._purges[filt]

    def _purge_s(self) -> float:
        """The longest one purge takes (`_purge`'s bound), and a second."""
        return self._link.timeout_s + _END_STORED_S + 1

    def _not_purged(self, request_id: str, err: StreamError) -> None:
        log.warning("stream %r: request %r read whole, but its messages were not purged: %s",
                    self.stream, request_id, err)

    def _one_request(self, feed: Feed, request_id: str, burst: list[Raw], admitted: list[tuple[Item, Raw]],
                     within: float) -> None:
        """HandoffError where the subject holds messages of more than one producer chain, looked for in a
        read-back before any of it is taken: in `burst`, and, where the read-back did not reach the
        subject's end (it stops at `live._RECOVER_BATCH` messages, or at its time bound), in the subject's
        last stored message (one get): the request stops at its end, and a newer request of the id stored
        after an earlier complete one would be seen only there. A last message that fails the checks
        (forged, malformed) tells nothing."""
        nonces = dict.fromkeys(item.seal.nonce for item, _ in admitted if item.seal is not None)
        last = None if feed.reached_end else feed.last_stored(within)  # (a read to the end holds the last)
        if last is not None and last.seq is not None and last.seq > max(raw.seq or 0 for raw in burst):
            try:
                item = self._item(last, request_id)
            except (MalformedMessage, ForgedMessage):
                pass
            else:
                if item.seal is not None:
                    nonces.setdefault(item.seal.nonce)
        if len(nonces) > 1:
            first, other, *_ = nonces
            raise two_chains(request_id, first, other)

    def _admit(self, raw: Raw, request_id: str, rejected: list[int]) -> Item | None:
        """The layer or end in `raw` if it passes `_item`'s checks; None (dropped, counted, logged) if not.
        Its place in the chain is `RequestChain`'s call."""
        try:
            return self._item(raw, request_id)
        except (MalformedMessage, ForgedMessage) as e:
            self._reject(request_id, raw, e, rejected)
            return None

    def _item(self, raw: Raw, request_id: str) -> Item:
        """The layer or end in `raw`: MalformedMessage or ForgedMessage unless it is well formed, signed
        where a secret is set, of this request, sealed, and not older than the stream keeps messages."""
        kind = env.kind_of(raw.headers)
        key = self._checks.key
        if key is not None and (why := verify(key, raw.subject, raw.headers, raw.data)):
            raise ForgedMessage(f"{why} (a stream secret is set)")
        item: Item
        if kind == env.KV:
            item = env.Ref.decode(raw.data, self._checks.current_limits())
        elif kind == env.KV_LAYERS:
            item = env.Layers.decode(raw.data, self._checks.current_limits())
        elif kind == env.END:
            item = env.End.decode(raw.data, self._checks.limits)
        else:
            raise MalformedMessage(f"a {kind!r} message on a handoff subject")
        if item.request != request_id:
            raise MalformedMessage(f"it names request {item.request!r}")
        if item.seal is None:
            raise ForgedMessage("it carries no producer seal")
        self._check_age(raw)
        return item

    def _check_age(self, raw: Raw) -> None:
        """ForgedMessage if `raw` was published longer ago than the stream keeps messages (its max_age,
        and the clock skew allowed): a replay. MalformedMessage for a malformed publish time."""
        sent = env.sent_ms(raw.headers)
        if sent is None:
            return
        max_age = self._retention.max_age_s(min(RETENTION_WAIT_S, self._link.timeout_s))
        if not max_age:
            return
        age = _now_ms() - sent
        if age > max_age * 1000 + CLOCK_SKEW_MS:
            raise ForgedMessage(f"it was published {age} ms ago; stream {self.stream!r} keeps messages "
                                f"{max_age} s (replayed)", size=age, limit=int(max_age * 1000) + CLOCK_SKEW_MS)

    def _reject(self, request_id: str, raw: Raw, err: StreamError, rejected: list[int]) -> None:
        rejected[0] += 1
        self.counts["rejected"] += 1
        (log.warning if rejected[0] == 1 else log.debug)(
            "stream %r, request %r: dropped message %s (%d dropped in this request): %s", self.stream, request_id,
            "(live)" if raw.seq is None else raw.seq, rejected[0], err)

    def close(self) -> None:
        """Close, once the purges under way have ended (each is bounded by the connection's timeout)."""
        with self._purges_lock:
            purges = list(self._purges.values())
        concurrent.futures.wait(purges, self._purge_s())
        try:
            self._dropped()  # (the wires' close: a purge still waiting for an answer gives up)
        finally:
            self._purger.shutdown(wait=True, cancel_futures=True)
            self._link.close()

    def __enter__(self) -> HandoffReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_all(wires: list[Wire]) -> None:
    for wire in wires:
        wire.close()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000

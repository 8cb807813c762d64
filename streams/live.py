"""A handoff request's messages as they are published: live from core NATS, recovered from JetStream.

A producer publishes each message once, on its stream's subject. The NATS server routes it to the
stream, which stores it, and in the same step to every plain (core NATS) subscriber of that subject.
`Feed` takes that live copy on a `Wire` (read in the caller's thread): no JetStream consumer sits on the
hot path (no store-then-deliver step, no pull round trip, no consumer state on the server). Core NATS
delivery is at most once (a reconnect loses what was in flight), so the stream is the record: `stored()`
reads what the stream holds on the subject, from where the last read stopped (in one batched direct get
where the stream allows it, else a message per request), and the receiver calls it
at start (messages published before it subscribed), on a gap in the request's chain, when nothing has
arrived for a while, and before giving up. A message may so arrive twice; the receiver counts it once.
The first read starts at the subject's first stored message: an earlier request of the same id, left
unread, may be there too (`last_stored` tells the receiver whether the subject holds another chain past
what one read returned: `handoff` fails the request then).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from typing import Any, Literal

import nats.js.errors

from ._link import _NOT_FOUND_CODES, Link
from .errors import StreamNotFound, StreamRefused, StreamTimeout, StreamUnavailable
from .wire import Msg, Wire

log = logging.getLogger("kvpool.streams")

RETENTION_S = 30.0
"""How long a receiver goes on with the stream's max_age it was last told before it asks again (`Retention`)."""
ASK_AGAIN_S = 0.5
"""How soon a receiver asks again for the stream's max_age after an ask that failed, or has not answered
within the link's timeout (a receiver made before its stream exists, NATS away for a while)."""
_RECOVER_BATCH = 4096
"""Stored messages one `stored()` reads at most (the rest on the next call)."""
_DIRECT_GET = "$JS.API.DIRECT.GET"
_DIRECT_HEADERS = frozenset({"Nats-Stream", "Nats-Subject", "Nats-Sequence", "Nats-Time-Stamp", "Nats-Num-Pending",
                             "Nats-Last-Sequence", "Nats-UpTo-Sequence"})
"""What a direct get adds to a stored message's own headers."""
_NO_MESSAGE = 10037
"""JetStream's error code for "no message found" (a missing stream is another 404: 10059)."""


async def _get(link: Link, stream: str, **kw: Any) -> Any:
    """`js.get_msg`, None where the stream holds no such message (a missing stream still raises)."""
    try:
        return await link.js.get_msg(stream, **kw)
    except nats.js.errors.NotFoundError as e:
        if getattr(e, "err_code", None) == _NO_MESSAGE:
            return None
        raise


async def stored_last(link: Link, stream: str, subj: str) -> Raw | None:
    """The last message `stream` holds on subject `subj`, or None."""
    m = await _get(link, stream, subject=subj)
    if m is None:
        return None
    return Raw(str(m.subject or subj), dict(m.headers or {}), bytes(m.data or b""), m.seq)


async def stored_seq(link: Link, stream: str, subj: str, data: bytes, most: int) -> int | None:
    """The sequence of the first message `stream` holds on subject `subj` whose body is `data`, among
    the first `most` there; None if none is."""
    seq = 1
    for _ in range(most):
        m = await _get(link, stream, seq=seq, subject=subj, next=True)
        if m is None or m.seq is None:
            return None
        if bytes(m.data or b"") == data:
            return int(m.seq)
        seq = int(m.seq) + 1
    return None


def direct_last(wire: Wire, stream: str, subj: str, timeout: float) -> Raw | None | Literal[False]:
    """The last message `stream` holds on subject `subj`, read in one direct get on `wire` (None: it
    holds none there); False where the stream serves no direct gets (created without `allow_direct`:
    the server answers that no one responds). StreamTimeout if no answer comes within `timeout` s."""
    m = wire.request(f"{_DIRECT_GET}.{stream}", json.dumps({"last_by_subj": subj}).encode(), timeout)
    if m is None:
        raise StreamTimeout(f"read the last message of {subj!r} from stream {stream!r}: no answer within "
                            f"{timeout:.2f} s")
    status = m.headers.get("Status")
    if status == "404":
        return None
    seq = m.headers.get("Nats-Sequence", "")
    if status is not None or not seq.isdigit():
        return False
    return Raw(m.headers.get("Nats-Subject", subj), {}, m.data, int(seq))


def purge_upto(wire: Wire, stream: str, subj: str, upto: int, timeout: float) -> int:
    """Drop `stream`'s messages on subject `subj` up to sequence `upto` (and not one after it), in one
    request on `wire`; how many went. StreamTimeout, StreamUnavailable, StreamNotFound or StreamRefused
    as JetStream answers (or does not)."""
    what = f"purge {subj!r} up to {upto} from stream {stream!r}"
    m = wire.request(f"$JS.API.STREAM.PURGE.{stream}", json.dumps({"filter": subj, "seq": upto + 1}).encode(),
                     timeout)
    if m is None:
        raise StreamTimeout(f"{what}: no answer within {timeout:.2f} s")
    if m.headers.get("Status") == "503":
        raise StreamUnavailable(f"{what}: JetStream does not answer (no responders)")
    try:
        answer = json.loads(m.data)
        err = answer.get("error")
        if err is None:
            return int(answer["purged"])
        code, desc = int(err.get("err_code") or 0), str(err.get("description") or "")
    except (ValueError, TypeError, KeyError, AttributeError):
        raise StreamRefused(f"{what}: not a JetStream answer: {m.data[:120]!r}") from None
    raise (StreamNotFound if code in _NOT_FOUND_CODES else StreamRefused)(f"{what}: JetStream error {code}: {desc}")


class Retention:
    """How long `stream` keeps messages (its max_age), asked through `link` in the background when made,
    again every `RETENTION_S`, and every `ASK_AGAIN_S` while an ask fails or goes unanswered. Threads may
    share one (a receiver read by several)."""

    def __init__(self, link: Link, stream: str) -> None:
        self._link, self.stream = link, stream
        self._lock = threading.Lock()
        self._known: float | None = None
        self._answered = False  # whether the last ask that ended was answered
        self._asked = time.monotonic()
        self._asking: concurrent.futures.Future[Any] | None = None
        self._waited_in_vain = False  # a wait went unanswered: none again (live layers would pay it each time)
        with self._lock:
            self._ask()

    def max_age_s(self, wait_s: float = 0.0) -> float | None:
        """The stream's max_age in seconds (0: none); None while not known (not answered yet, or the
        stream info could not be read). Known once, it is kept while later asks fail. `wait_s`: where it
        is not known, the seconds to wait for an answer (an ask under way, or one made now), unless a
        wait timed out before: then the answer is only taken when it comes (an ask that failed, a stream
        not made yet, is no reason to stop waiting)."""
        with self._lock:
            self._settle()
            now = time.monotonic()
            if self._asking is None:
                if now - self._asked > (RETENTION_S if self._answered else ASK_AGAIN_S):
                    self._ask()  # (an admin may have changed it)
            elif now - self._asked > self._link.timeout_s + ASK_AGAIN_S:  # never answered (its loop stopped)
                self._asking.cancel()
                self._ask()
            if self._known is not None or wait_s <= 0 or self._waited_in_vain:
                return self._known
            if self._asking is None:
                self._ask()
            asking = self._asking
        if asking is not None:
            concurrent.futures.wait([asking], wait_s)
        with self._lock:
            self._settle()
            self._waited_in_vain = self._known is None and asking is not None and not asking.done()  # (timed out)
            return self._known

    def _ask(self) -> None:
        """Ask in the background; nothing where the link's loop is closed (the receiver closing). Lock held."""
        self._asked = time.monotonic()
        self._asking = None
        if self._link.io.loop.is_closed():
            return
        ask = self._link.js.stream_info(self.stream)
        try:
            self._asking = self._link.io.spawn(ask)
        except RuntimeError:  # the loop closed since (asyncio: "Event loop is closed")
            ask.close()

    def _settle(self) -> None:
        """Take the answer of an ask that ended. Lock held."""
        asking = self._asking
        if asking is None or not asking.done():
            return
        self._asking = None
        self._answered = not asking.cancelled() and asking.exception() is None
        if self._answered:
            self._known = float(asking.result().config.max_age or 0)
        else:
            log.debug("stream %r: its retention is not known: %r", self.stream,
                      None if asking.cancelled() else asking.exception())


@dataclasses.dataclass(frozen=True)
class Raw:
    """One message as delivered: live (`seq` None) or read back from the stream (`seq` its sequence)."""

    subject: str
    headers: dict[str, str]
    data: bytes
    seq: int | None = None


class Feed:
    """The live subscription to `subj` (one subject of `stream`) on `wire`, and the stream's record of
    it through `link`."""

    def __init__(self, link: Link, wire: Wire, stream: str, subj: str) -> None:
        self._link, self._wire, self.stream, self.subject = link, wire, stream, subj
        self._next_seq = 1
        self._read_back: list[Raw] = []  # read from the stream, not yet returned (a bounded read cut short)
        self._direct: bool | None = None  # whether the stream answers batched direct gets (None: not asked yet)
        self.reached_end = False
        """Whether the last `stored()` read up to the subject's last stored message (not cut short by its
        bound of `_RECOVER_BATCH` messages, nor by time)."""
        self._reconnects = wire.reconnects
        self._arrived: list[Raw] = []
        self._sid = wire.subscribe(subj)  # in place at the server: every later publish reaches it live

    def live(self, timeout: float) -> list[Raw]:
        """The next live message and every one already arrived behind it; [] if none within `timeout` s."""
        deadline = time.monotonic() + timeout
        while not self._arrived:
            first = self._wire.next(self._sid, deadline - time.monotonic())
            if first is None:
                return []
            for msg in (first, *self._wire.pending(self._sid)):
                self._on_live(msg)
        out, self._arrived = self._arrived, []
        return out

    def _on_live(self, msg: Msg) -> None:
        """Each message as it comes off the wire."""
        self._arrived.append(Raw(msg.subject, msg.headers, msg.data))

    def reconnected(self) -> bool:
        """Whether the connection was re-established since the last call (or since subscribing): what
        was published while it was down never came live."""
        now = self._wire.reconnects
        changed, self._reconnects = now != self._reconnects, now
        return changed

    def stored(self, within: float | None = None) -> list[Raw]:
        """What the stream stored on the subject since the last call (in stream order). `within`: seconds
        the read may take (default: the link's timeout); a read cut short returns what it took by then, or
        raises StreamTimeout if that is nothing."""
        bound = self._link.timeout_s if within is None else min(within, self._link.timeout_s)
        self.reached_end = False
        try:
            self._link.call(asyncio.wait_for(self._read_stored(), bound),
                            f"read {self.subject!r} back from stream {self.stream!r}", timeout=bound)
        except StreamTimeout:
            if not self._read_back:
                raise
        out, self._read_back = self._read_back, []
        return out

    def last_stored(self, within: float | None = None) -> Raw | None:
        """The last message the stream holds on the subject (one get), or None: past what `stored()` read
        where it did not reach the end. `within`: as `stored`'s; a get not answered by then raises
        StreamTimeout."""
        bound = self._link.timeout_s if within is None else min(within, self._link.timeout_s)
        return self._link.call(asyncio.wait_for(stored_last(self._link, self.stream, self.subject), bound),
                               f"read the last message of {self.subject!r} from stream {self.stream!r}",
                               timeout=bound)

    async def _read_stored(self) -> None:
        while self._direct is not False and len(self._read_back) < _RECOVER_BATCH:
            before = len(self._read_back)
            pending = await self._read_batch()
            self._direct = pending is not None
            self.reached_end = pending == 0
            if pending == 0 or (pending is not None and len(self._read_back) == before):
                return
        while len(self._read_back) < _RECOVER_BATCH:  # a message per request
            m = await _get(self._link, self.stream, seq=self._next_seq, subject=self.subject, next=True)
            if m is None or m.seq is None:
                self.reached_end = True
                return
            # no await between these two: a read cut short keeps every message it took
            self._next_seq = int(m.seq) + 1
            self._read_back.append(Raw(str(m.subject or self.subject), dict(m.headers or {}),
                                       bytes(m.data or b""), int(m.seq)))

    async def _read_batch(self) -> int | None:
        """Read on from `_next_seq` in one request: JetStream's batched direct get (a stream with
        `allow_direct`, a server that batches) answers with the subject's messages, then an end-of-batch
        status. Returns how many more the stream holds on the subject after those (0: all read), or
        None where the stream or server does not answer so (no responder, another status, one message
        alone): the caller reads on a message per request. A receiver that comes after its producer
        finished takes a request's 32 layers this way in one round trip instead of 32."""
        nc = self._link.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        pending = 0
        try:
            want = _RECOVER_BATCH - len(self._read_back)
            body = json.dumps({"seq": self._next_seq, "next_by_subj": self.subject, "batch": want}).encode()
            await nc.publish(f"{_DIRECT_GET}.{self.stream}", body, reply=inbox)
            while True:
                m = await sub.next_msg(timeout=self._link.timeout_s)
                headers = dict(m.headers or {})
                status = headers.get("Status")
                if status is not None:  # 204: the batch's end; 404: nothing (more) stored; else: not served
                    return pending if status == "204" else 0 if status == "404" else None
                seq = int(headers["Nats-Sequence"])
                # no await between these two: a read cut short keeps every message it took
                self._next_seq = seq + 1
                self._read_back.append(Raw(headers.get("Nats-Subject", self.subject),
                                           {k: v for k, v in headers.items() if k not in _DIRECT_HEADERS},
                                           bytes(m.data or b""), seq))
                if "Nats-Num-Pending" not in headers:  # a server that answers one message, not a batch
                    return None
                pending = int(headers["Nats-Num-Pending"])
        except (KeyError, ValueError):  # not a direct get's answer: the read a message per request decides
            return None
        finally:
            await sub.unsubscribe()

    def close(self) -> None:
        self._wire.unsubscribe(self._sid)

"""Pipelined announcements: a producer's kv and end messages, published in order on its `Wire` while
the producing thread goes on to its next layer.

Waiting for JetStream's acknowledgement of each layer's announcement would add a round trip through
the server to every layer. The caller only sends each announcement (`send`) with a reply subject of
our own; acknowledgements are taken as they arrive, whenever the caller comes back (`ready`, `flush`).
`flush` waits until everything sent is stored. An announcement the stream refused (e.g. StreamFull)
is raised by the caller's next `ready` or `flush`. Each carries a message id (`Nats-Msg-Id`), so that
after a broken connection the unacknowledged ones are sent again and JetStream stores each once.
"""
from __future__ import annotations

import collections
import itertools
import json
import secrets
import time
import uuid
from collections.abc import Callable, Sequence

import nats.js.errors
from nats.js import api

from kvpool.core import Key

from ._link import translate
from .errors import StreamNotFound, StreamRefused, StreamTimeout
from .wire import Msg, Wire

_EXPECTED_STREAM, _MSG_ID = api.Header.EXPECTED_STREAM.value, api.Header.MSG_ID.value
"""Header names (the enum's values: an enum member in an f-string is its qualified name)."""
_DENIED = "permissions violation"
"""How nats-server's -ERR for a publish it denies begins (lowercased)."""
WINDOW = 256
"""Announcements a caller may have unacknowledged before `ready` waits for them all to be stored."""


class Announcer:
    """Publishes announcements on `stream` for one producer over `wire`. `stored(seq, subject, keys,
    nbytes)` runs for each one JetStream stored; `refused(keys)` for each it refused (both in the
    caller's thread)."""

    def __init__(self, wire: Wire, stream: str, stored: Callable[[int, str, Sequence[Key], int], None],
                 refused: Callable[[Sequence[Key]], None]) -> None:
        self._wire, self.stream, self._stored, self._on_refused = wire, stream, stored, refused
        self._inbox = f"_INBOX.{uuid.uuid4().hex}"
        self._sid = wire.subscribe(self._inbox + ".*")
        self._tokens = itertools.count()
        self._unacked: dict[str, tuple[str, bytes, dict[str, str], Sequence[Key], int]] = {}
        self._seqs: dict[str, int] = {}  # tokens whose sequence `send(..., want_seq=True)` asked to keep
        self._refused: collections.deque[tuple[BaseException, Sequence[Key]]] = collections.deque()
        self._reconnects = wire.reconnects

    @property
    def max_payload(self) -> int:
        """The most bytes (headers and body) the server takes in one message."""
        return self._wire.max_payload

    def ready(self) -> None:
        """Call before putting the blocks of the next announcement: takes the acknowledgements that
        arrived, raises an earlier refusal, and waits for all to be stored once WINDOW are in flight."""
        if len(self._unacked) >= WINDOW:
            self.flush()
        else:
            self._take(self._wire.pending(self._sid))
        self._raise_refused()

    def send(self, subj: str, body: bytes, headers: dict[str, str], keys: Sequence[Key], nbytes: int = 0,
             msg_id: str | None = None) -> str:
        """Publish an announcement naming blocks `keys` (`nbytes` of them); returns its token without
        waiting for the ack. One that raises was not sent, and is not sent later: the caller may send it
        again. `msg_id`: JetStream's duplicate id (default: a random one, kept for resends), the same for a
        message sent again by a caller that had no answer (JetStream then stores it once)."""
        self._resend_if_reconnected()  # (before this one is listed: it goes out once, below)
        token = str(next(self._tokens))
        # (a duplicate id no stranger can guess: one claimed first would have this message dropped)
        headers = {**headers, _EXPECTED_STREAM: self.stream, _MSG_ID: msg_id or secrets.token_hex(16)}
        self._unacked[token] = (subj, body, headers, keys, nbytes)
        try:
            self._wire.publish(subj, body, headers, reply=f"{self._inbox}.{token}")
        except StreamRefused:  # not sent, and never will be (over the server's max_payload)
            del self._unacked[token]
            if keys:
                self._on_refused(keys)  # nothing will read its blocks through the stream
            raise
        except BaseException:
            del self._unacked[token]  # not sent (a send that fails leaves no whole message): nor resent later
            raise
        return token

    def publish(self, subj: str, body: bytes, headers: dict[str, str], msg_id: str | None = None) -> int:
        """Publish a message after every announcement before it is stored; its stream sequence (`msg_id`
        as for `send`)."""
        self.flush()
        token = self.send(subj, body, headers, (), msg_id=msg_id)
        self._seqs[token] = 0
        self.flush()
        return self._seqs.pop(token)

    def flush(self) -> None:
        """Wait until JetStream stored (or refused) every announcement sent; raise the first refusal.
        One still unanswered after the wire's timeout counts as refused (StreamTimeout); all unanswered
        ones are refused at once (StreamRefused) when the server says this user may not publish."""
        wire = self._wire
        deadline, errors = time.monotonic() + wire.timeout_s, wire.error_count
        while self._unacked and time.monotonic() < deadline:
            self._resend_if_reconnected()
            msg = wire.next(self._sid, deadline - time.monotonic())
            if msg is not None:
                self._take([msg])
            elif wire.error_count != errors and _DENIED in wire.errors[-1].lower():
                break  # the server will not store them: no acknowledgement is coming
        for token in list(self._unacked):
            if wire.error_count != errors and _DENIED in wire.errors[-1].lower():
                why = f"publish to stream {self.stream!r}: this NATS user may not do it ({wire.errors[-1]})"
                self._settle(token, StreamRefused(why))
            else:
                self._settle(token, StreamTimeout(f"publish to stream {self.stream!r}: not acknowledged within "
                                                  f"{wire.timeout_s} s"))
        self._raise_refused()

    def _resend_if_reconnected(self) -> None:
        """After a reconnect, the unacknowledged announcements again (JetStream drops the duplicates)."""
        if self._wire.reconnects != self._reconnects:
            self._reconnects = self._wire.reconnects
            for token, (subj, body, headers, _, _) in list(self._unacked.items()):
                self._wire.publish(subj, body, headers, reply=f"{self._inbox}.{token}")

    def _take(self, acks: list[Msg]) -> None:
        for msg in acks:
            self._on_ack(msg)

    def _on_ack(self, msg: Msg) -> None:
        """JetStream's answer to one announcement: its sequence, or why it was refused."""
        token = msg.subject.rsplit(".", 1)[1]
        what = f"publish to stream {self.stream!r}"
        if msg.headers.get("Status") == "503":
            self._settle(token, StreamNotFound(f"{what}: no stream takes this subject"))
            return
        try:
            reply = json.loads(msg.data)
            if "error" in reply:
                nats.js.errors.APIError.from_error(reply["error"])  # raises the typed error
            seq = int(reply["seq"])
        except nats.js.errors.Error as e:
            self._settle(token, translate(e, what))
        except (ValueError, KeyError, TypeError) as e:
            self._settle(token, StreamRefused(f"{what}: malformed acknowledgement {bytes(msg.data[:200])!r}: {e!r}"))
        else:
            self._settle(token, seq)  # (outside the try: an error of the stored callback is not the ack's)

    def _settle(self, token: str, outcome: int | BaseException) -> None:
        entry = self._unacked.pop(token, None)
        if entry is None:
            return
        subj, _, _, keys, nbytes = entry
        if isinstance(outcome, BaseException):
            self._refused.append((outcome, keys))
            return
        if token in self._seqs:
            self._seqs[token] = outcome
        elif keys:
            self._stored(outcome, subj, keys, nbytes)

    def _raise_refused(self) -> None:
        if not self._refused:
            return
        refused = [self._refused.popleft() for _ in range(len(self._refused))]
        for _, keys in refused:
            if keys:
                self._on_refused(keys)
        raise refused[0][0]

    def close(self) -> None:
        """Close the wire (the announcer's own)."""
        self._wire.close()

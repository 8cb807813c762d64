"""Pipelined announcements: a producer's kv messages, published in order from the NATS loop while the
producing thread goes on to its next layer.

Waking the loop thread and waiting for it, then for JetStream's acknowledgement, costs about as much as
putting a 1 MiB layer into the pool, so waiting per layer would halve a handoff's rate. The caller only
queues each announcement (`send`); one writer task on the loop publishes them in queue order with a
reply subject of our own, and JetStream's acknowledgements are matched as they arrive (nats-py's
`publish_async` is not used: it leaves a refused publish waiting forever). `flush` waits until
everything queued is stored. An announcement the stream refused (e.g. StreamFull) is raised by the
caller's next `ready` or `flush`.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

import nats.js.errors
from nats.js import api

from kvpool.core import Key

from ._link import Link, translate
from .errors import StreamNotFound, StreamRefused, StreamTimeout

WINDOW = 256
"""Announcements a caller may queue before `ready` waits for them all to be stored."""


class Announcer:
    """Publishes kv announcements on `stream` for one producer. `stored(seq, subject, keys)` runs on the
    loop for each one JetStream stored; `refused(keys)` runs in the caller's thread for each it refused."""

    def __init__(self, link: Link, stream: str, stored: Callable[[int, str, Sequence[Key]], None],
                 refused: Callable[[Sequence[Key]], None]) -> None:
        self._link, self.stream, self._stored, self._on_refused = link, stream, stored, refused
        self._queue: asyncio.Queue[tuple[str, bytes, dict[str, str], Sequence[Key]]] = asyncio.Queue()
        self._unacked: dict[str, tuple[str, Sequence[Key], asyncio.Future[None]]] = {}  # on the loop only
        self._refused: collections.deque[tuple[BaseException, Sequence[Key]]] = collections.deque()
        self._queued = 0  # since the last flush; touched by the caller only
        self._inbox = link.nc.new_inbox()
        link.call(link.nc.subscribe(self._inbox + ".*", cb=self._on_ack), f"subscribe to acks of {stream!r}")
        link.io.spawn(self._write())

    def ready(self) -> None:
        """Call before putting the blocks of the next announcement: raises an earlier refusal, and waits
        for the queued announcements to be stored once WINDOW of them are in flight."""
        if self._queued >= WINDOW:
            self.flush()
        self._raise_refused()

    def send(self, subj: str, body: bytes, headers: dict[str, str], keys: Sequence[Key]) -> None:
        """Queue an announcement naming blocks `keys`; returns without waiting for the loop."""
        self._link.io.loop.call_soon_threadsafe(self._queue.put_nowait, (subj, body, headers, keys))
        self._queued += 1

    def flush(self) -> None:
        """Wait until JetStream stored (or refused) every queued announcement; raise the first refusal.
        With nothing queued since the last flush, nothing is waited for (no trip to the loop)."""
        if self._queued:
            self._link.call(self._drained(), f"acknowledgements of stream {self.stream!r}")
            self._queued = 0
        self._raise_refused()

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        for n in itertools.count():
            subj, body, headers, keys = await self._queue.get()
            headers = {**headers, api.Header.EXPECTED_STREAM: self.stream}
            token = str(n)
            self._unacked[token] = (subj, keys, loop.create_future())
            try:
                await self._link.nc.publish(subj, body, reply=f"{self._inbox}.{token}", headers=headers)
            except Exception as e:  # reported to the caller, like a refusal
                self._settle(token, translate(e, f"publish to stream {self.stream!r}"))
            self._queue.task_done()

    async def _on_ack(self, msg: Any) -> None:
        """JetStream's answer to one announcement: its sequence, or why it was refused."""
        token = msg.subject.rsplit(".", 1)[1]
        what = f"publish to stream {self.stream!r}"
        if (msg.headers or {}).get(api.Header.STATUS) == "503":
            self._settle(token, StreamNotFound(f"{what}: no stream takes this subject"))
            return
        try:
            reply = json.loads(msg.data)
            if "error" in reply:
                nats.js.errors.APIError.from_error(reply["error"])  # raises the typed error
            self._settle(token, int(reply["seq"]))
        except nats.js.errors.Error as e:
            self._settle(token, translate(e, what))
        except (ValueError, KeyError, TypeError) as e:
            self._settle(token, StreamRefused(f"{what}: malformed acknowledgement {bytes(msg.data[:200])!r}: {e!r}"))

    def _settle(self, token: str, outcome: int | BaseException) -> None:
        entry = self._unacked.pop(token, None)
        if entry is None:
            return
        subj, keys, done = entry
        if isinstance(outcome, BaseException):
            self._refused.append((outcome, keys))
        else:
            self._stored(outcome, subj, keys)
        done.set_result(None)

    async def _drained(self) -> None:
        """Until everything queued is written and answered; an announcement still unanswered after
        the producer's timeout counts as refused (StreamTimeout), so one lost ack is reported once."""
        timeout = self._link.timeout_s
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
        except asyncio.TimeoutError:
            raise StreamTimeout(f"publish to stream {self.stream!r}: announcements not sent "
                                f"within {timeout} s") from None
        waiting = {token: done for token, (_, _, done) in self._unacked.items()}
        if waiting:
            await asyncio.wait(waiting.values(), timeout=timeout)
        for token, done in waiting.items():
            if not done.done():
                self._settle(token, StreamTimeout(f"publish to stream {self.stream!r}: not acknowledged "
                                                  f"within {timeout} s"))

    def _raise_refused(self) -> None:
        if not self._refused:
            return
        refused = [self._refused.popleft() for _ in range(len(self._refused))]
        for _, keys in refused:
            self._on_refused(keys)
        raise refused[0][0]

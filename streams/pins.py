"""Pins on the pool blocks that a producer's by-reference messages name, held while those messages may
still be read.

The producer puts a payload's blocks pinned for `ttl_s` seconds and records the message here once
JetStream has stored it. A reconciler thread compares the recorded messages with JetStream's state every
`min(1, ttl_s / 4)` seconds, and at once when they take `EARLY` of the budget. A message is done when it
is gone from the stream (retention dropped it: a limit, or under interest/workqueue retention the acks; or
it was purged, as a finished handoff is; seen as its sequence below the stream's first, or no message left
on its subject) or when every consumer whose filter takes its subject has acked past it (ack floor >= its
sequence; with no such consumer yet, it waits; consumers that never ack, like a handoff's, do not count:
delivery is not the end of their reading). Done messages' blocks are unpinned; the others' pins are
renewed every `ttl_s / 2`. Nothing else renews them: if the producer or this thread dies, or NATS stays
unreachable, the workers drop the pins `ttl_s` later, so a pin never outlives its producer by more than
that.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import nats.js.errors
from nats.js import api

from kvpool.core import Key, KVPoolError, PoolClient

from ._link import Link
from .admin import subject

log = logging.getLogger("kvpool.streams.pins")

_PAGE = 256
"""Consumers per JetStream CONSUMER.LIST page."""
_PIN_BATCH = 4096
"""Keys per pin request (a worker takes at most 65536 keys per frame)."""
LOW_WATER = 0.75
"""Past the budget, the oldest messages are unpinned until the rest take at most this share of it: the
unpins go in batches (with a producer ahead of the reconciler, one request to the worker per quarter of
the budget put, not one per message)."""
EARLY = 0.5
"""Share of the budget at which the reconciler makes a pass at once, not at its period's end: a producer
that puts more than the budget in a period (a same-node handoff here moves 2-3 GB/s, against a 128 MiB
budget and a pass a second) has what its consumers read released by a pass, and the budget drops only
what nobody read, not the read layers that no pass had seen yet (logged as unread)."""
_PASS_GAP_S = 0.005
"""Least time between two passes ..."""
_IDLE_GAP_S = 0.02
"""... and after one that released nothing, this long before an early one, twice as long after each such
pass in a row, up to `_IDLE_GAP_MAX_S`: a producer whose messages nobody reads does not have the
reconciler asking JetStream every few milliseconds, while one whose reader lags near the budget has a pass
5 ms after each that released something. (A reader that starts late is seen reading at most
`_IDLE_GAP_MAX_S` after it starts: past the budget meanwhile, the budget drops the oldest, as it would
without early passes.)"""
_IDLE_GAP_MAX_S = 0.25


def subject_matches(filt: str, subj: str) -> bool:
    """Whether NATS subject filter `filt` (tokens, `*` for one, `>` for the rest) takes subject `subj`."""
    want, have = filt.split("."), subj.split(".")
    for i, tok in enumerate(want):
        if tok == ">":
            return len(have) > i
        if i >= len(have) or (tok != "*" and tok != have[i]):
            return False
    return len(want) == len(have)


def _filters(config: api.ConsumerConfig) -> list[str]:
    """The subject filters of a consumer (none: it takes every subject)."""
    return (config.filter_subjects or []) + ([config.filter_subject] if config.filter_subject else [])


class _StreamState:
    """What decides whether a message is done: the stream's first sequence and live subjects, and the
    consumers' ack floors."""

    def __init__(self, info: dict[str, Any], consumers: list[Any]) -> None:
        state = info.get("state", {})
        self.first_seq = int(state.get("first_seq", 0))
        subjects = state.get("subjects") or {}
        # a paged (partial) subject list cannot tell that a subject is empty
        self.subjects: dict[str, int] | None = subjects if len(subjects) >= int(info.get("total", 0)) else None
        self.floors = [(_filters(c.config), int(c.ack_floor.stream_seq if c.ack_floor else 0))
                       for c in consumers if c.config.ack_policy != api.AckPolicy.NONE]

    def done(self, seq: int, subj: str) -> bool:
        if seq < self.first_seq or (self.subjects is not None and subj not in self.subjects):
            return True
        floors = [floor for filters, floor in self.floors
                  if not filters or any(subject_matches(f, subj) for f in filters)]
        return bool(floors) and min(floors) >= seq


class PinKeeper:
    """Renews or drops the pins of one producer's messages on stream `stream` (see the module doc)."""

    def __init__(self, link: Link, stream: str, pool: PoolClient, ttl_s: float,
                 max_pinned_bytes: int | None = None) -> None:
        self._link, self.stream, self._pool, self.ttl_s = link, stream, pool, ttl_s
        self.max_pinned_bytes = max_pinned_bytes
        self._messages: dict[int, tuple[str, Sequence[Key]]] = {}
        self._sizes: dict[int, int] = {}  # payload bytes of the counted messages
        self._pinned_bytes = 0
        self._over_logged = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a pass at once (set with `_stop`, and past `EARLY` of the budget)
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"kvpool-pins-{stream}", daemon=True)
        self._thread.start()

    def add(self, seq: int, subj: str, keys: Sequence[Key], nbytes: int = 0) -> None:
        """Message `seq` (on `subj`) names blocks `keys` (`nbytes` of payload), put pinned just before
        it was published. Past `max_pinned_bytes`, the oldest messages' blocks are unpinned (down to
        `LOW_WATER` of it): they stay readable until the pool needs their room, then a consumer gets a
        PayloadError for them, rather than unacked payloads filling the pool until unrelated puts fail."""
        with self._lock:
            self._messages[seq] = (subj, keys)
            if nbytes:
                self._sizes[seq] = nbytes
                self._pinned_bytes += nbytes
            dropped = self._over_budget()
            if self.max_pinned_bytes and self._pinned_bytes >= self.max_pinned_bytes * EARLY:
                self._wake.set()
        if dropped:
            self._pin(dropped, 0)

    def _over_budget(self) -> list[Key]:
        """Past the budget, forget the oldest counted messages until the rest take `LOW_WATER` of it (the
        newest always stays); returns their keys that no remaining message names. Caller holds the lock."""
        budget = self.max_pinned_bytes
        if budget is None or self._pinned_bytes <= budget:
            return []
        gone: dict[int, Sequence[Key]] = {}
        while self._pinned_bytes > budget * LOW_WATER and len(self._sizes) > 1:
            seq = min(self._sizes)
            self._pinned_bytes -= self._sizes.pop(seq)
            gone[seq] = self._messages.pop(seq, ("", ()))[1]
        if not gone:
            return []
        (log.debug if self._over_logged else log.warning)(
            "stream %r: unacked payloads over max_pinned_bytes (%d): unpinned messages %d..%d, which consumers "
            "may no longer find%s", self.stream, budget, min(gone), max(gone),
            "" if self._over_logged else " (logged once; later ones at debug level)")
        self._over_logged = True
        needed = {k for _, keys in self._messages.values() for k in keys}
        return list({k for keys in gone.values() for k in keys} - needed)

    def reconcile(self) -> bool:
        """One pass: unpin the blocks of done messages; renew the rest if half their time is gone. Whether
        any message was done."""
        with self._lock:
            held = dict(self._messages)
        if not held:
            return False
        state = self._link.call(self._state(), f"state of stream {self.stream!r}")
        done = [seq for seq, (subj, _) in held.items() if state is None or state.done(seq, subj)]
        with self._lock:
            for seq in done:
                self._messages.pop(seq, None)  # may be gone already (over budget)
                self._pinned_bytes -= self._sizes.pop(seq, 0)
            needed = {k for _, keys in self._messages.values() for k in keys}
        self._pin(list({k for seq in done for k in held[seq][1]} - needed), 0)
        if needed and time.monotonic() - self._renewed >= self.ttl_s / 2:
            self._pin(list(needed), self.ttl_s)
            self._renewed = time.monotonic()
        return bool(done)

    def _pin(self, keys: list[Key], seconds: float) -> None:
        for i in range(0, len(keys), _PIN_BATCH):
            self._pool.batch_pin(keys[i:i + _PIN_BATCH], seconds)

    async def _state(self) -> _StreamState | None:
        """The stream's state (None: the stream is gone, and every message with it)."""
        nc, js = self._link.nc, self._link.js
        ask = json.dumps({"subjects_filter": subject(self.stream, ">")}).encode()
        reply = await nc.request(f"$JS.API.STREAM.INFO.{self.stream}", ask, timeout=self._link.timeout_s)
        info = json.loads(reply.data)
        err = info.get("error")
        if err:
            if err.get("code") == 404:
                return None
            # nats-py's own error for JetStream's answer: Link.call translates it as any other
            raise nats.js.errors.APIError(code=err.get("code"), err_code=err.get("err_code"),
                                          description=err.get("description"))
        consumers: list[Any] = []
        while True:
            page = await js.consumers_info(self.stream, offset=len(consumers))
            consumers += page
            if len(page) < _PAGE:
                return _StreamState(info, consumers)

    def _run(self) -> None:
        period = min(1.0, self.ttl_s / 4)
        gap = _PASS_GAP_S
        while True:
            due = time.monotonic() + period
            if self._stop.wait(min(gap, period)):  # (an early pass no sooner than `gap` after the last)
                return
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            released = False
            try:
                released = self.reconcile()
            except (KVPoolError, OSError) as e:  # NATS or a worker away: the pins' TTL is the fallback
                log.warning("pins of stream %r not reconciled: %s", self.stream, e)
            gap = _PASS_GAP_S if released else min(_IDLE_GAP_MAX_S, max(_IDLE_GAP_S, 2 * gap))

    def stop(self) -> None:
        """Stop renewing, at once and without a last pass (what a producer dropped unclosed does): the
        pins expire within `ttl_s`. The thread ends after the pass under way, unwaited for: this may run
        on any thread, its own included."""
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        """Stop, after a last pass that releases what is done; the rest expire within `ttl_s`."""
        self.stop()
        self._thread.join()
        try:
            self.reconcile()
        except (KVPoolError, OSError) as e:
            log.warning("pins of stream %r left to expire: %s", self.stream, e)

"""Connections to a cluster's workers, and asking several of them at once under one deadline.

A worker that fails, or leaves a call unanswered for the client's whole `timeout_s`, is suspect for
`SUSPECT_S` seconds: calls skip it (a miss, or a replica's hit) instead of waiting on it again, and its
connection is dropped. It keeps its place in the ranking: its keys are not written elsewhere meanwhile.
One that only missed a shorter deadline (a replicated read's first round gets half the timeout) is slow
for as long: reads skip it, writes still go to it. A write leaves out only a worker that went unanswered
for `timeout_s`, which, paused that long (`STALL_S` at most), knows it may have missed writes and
catches up by itself (README, "Replicas").
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from .auth import unix_socket_usable
from .connection import sessions_entered
from .errors import Abandoned, KVPoolError, PoolTimeout, PoolUnavailable
from .records import WorkerInfo
from .transport import ShmTransport, TcpTransport, connect

__all__ = ["Transport", "SUSPECT_S", "DEPARTED_S", "Departures", "FanOut"]

log = logging.getLogger("kvpool.client")

T = TypeVar("T")
Transport = TcpTransport | ShmTransport

SUSPECT_S = 2.0
"""How long a worker that failed is treated as down before it is asked again."""
_WHOLE = 0.95
"""A call abandoned after this share of `timeout_s` counts as unanswered for the whole timeout."""
DEPARTED_S = 60.0
"""How long a connected worker may be missing from the members before its connection is closed."""


class Departures:
    """Which of the workers one holds something for (a connection, a stager) have been missing from the
    members for `DEPARTED_S`. Not thread-safe."""

    def __init__(self) -> None:
        self._absent: dict[str, float] = {}  # worker id -> since when it is no member

    def gone(self, held: Iterable[str], live: Mapping[str, WorkerInfo]) -> list[str]:
        """Those of `held` missing from `live` for DEPARTED_S (each told once)."""
        now = time.monotonic()
        held = set(held)
        self._absent = {w: since for w, since in self._absent.items() if w in held and w not in live}
        for w in held - live.keys():
            self._absent.setdefault(w, now)
        out = [w for w, since in self._absent.items() if now - since >= DEPARTED_S]
        for w in out:
            del self._absent[w]
        return out


class FanOut:
    """One transport per worker (shared memory to workers on `node_id`, TCP to the rest), the suspect
    list, and parallel calls. Thread-safe: one client serves many threads."""

    def __init__(self, node_id: str, token: str | None, timeout_s: float, tls_ca: str | None = None) -> None:
        self.node_id = node_id
        self.token = token
        self.timeout_s = timeout_s
        self.tls_ca = tls_ca  # TCP workers over TLS, verified against this CA file (else KVPOOL_TLS_CA's)
        self._transports: dict[str, tuple[tuple[Any, ...], Transport]] = {}
        self._suspect: dict[str, tuple[float, tuple[Any, ...]]] = {}  # worker -> (until, the incarnation that failed)
        self._slow: dict[str, tuple[float, tuple[Any, ...]]] = {}  # the same, for one that missed a short deadline
        self._departures = Departures()
        self._warned: set[str] = set()  # workers whose failure was logged, until they answer again
        self._answered_at: dict[str, float] = {}  # when each worker last answered (monotonic)
        self._lock = threading.Lock()  # guards the dicts above, the departures and `_closed`
        self._closed = False  # a call still running (a read repair) connects nowhere after `close`
        self._why_closed = "the client is closed"
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvpool-fanout")

    def _askable(self, live: Mapping[str, WorkerInfo], groups: Mapping[str, list[int]],
                 reads: bool = False) -> dict[str, list[int]]:
        """`groups` less the suspect workers (and, for `reads`, the slow ones): a call gets nothing from
        them (a miss, or a put that did not reach them), but placement still counts them, so their keys
        never land elsewhere meanwhile, where they would outlive a newer version written once the worker
        is back. A worker is suspect as the process that failed (its incarnation), not as the one
        restarted under its id."""
        now = time.monotonic()
        with self._lock:
            skip = {w: inc for w, (until, inc) in self._suspect.items() if until > now}
            if reads:
                skip.update((w, inc) for w, (until, inc) in self._slow.items() if until > now and w not in skip)
        return {w: idx for w, idx in groups.items() if skip.get(w) != live[w].incarnation}

    def send_idle(self, live: Mapping[str, WorkerInfo], groups: Mapping[str, list[int]],
                  call: Callable[[Transport, list[int]], None]) -> set[str]:
        """`call(transport, idx)` at once, in this thread, for each worker of `groups` whose connection
        is open and unused now and that is not suspect (a one-way message: nothing is awaited, and no
        connection is opened or waited for; `call` raises `Busy` where its connection is no longer
        so). The workers it went to: the rest are the caller's to send another way."""
        with self._lock:
            ready = {w: t for w, (inc, t) in self._transports.items() if w in groups and inc == live[w].incarnation}
        sent = set()
        for w, idx in self._askable(live, {w: groups[w] for w in ready}).items():
            try:
                call(ready[w], idx)
            except KVPoolError:  # Busy; or a failed connection, closed: the other way reconnects
                continue
            sent.add(w)
        return sent

    def drop_departed(self, live: Mapping[str, WorkerInfo]) -> None:
        """Close the connections to workers that have not been members for `DEPARTED_S` (one to a
        same-node worker maps its arena: kept open, a departed worker's memory would stay taken for as
        long as this client lives). Not at once: a member missing for a moment (its heartbeats held up
        by a NATS election) keeps its connection, and the calls on it."""
        with self._lock:
            dropped = [self._transports.pop(w)[1] for w in self._departures.gone(self._transports, live)]
        for t in dropped:
            t.close()

    def connected(self) -> dict[str, Transport]:
        """The open transports, by worker id."""
        with self._lock:
            return {w: t for w, (_, t) in self._transports.items()}

    def transport(self, worker_id: str, info: WorkerInfo) -> Transport:
        """The connection to a worker; a new one when the member's entry names another process (a
        worker restarted under the same id: the old connection leads nowhere)."""
        stale: Transport | None = None
        with self._lock:  # one transport per worker, however many threads ask at once
            if self._closed:
                raise PoolUnavailable(self._why_closed)
            known = self._transports.get(worker_id)
            if known is not None and known[0] != info.incarnation:
                stale, known = known[1], None
                del self._transports[worker_id]
            if known is None:
                same_node = info.node_id == self.node_id and unix_socket_usable(info.unix)
                t = connect(info.unix if same_node else info.tcp, self.token, self.timeout_s, self.tls_ca)
                t.expect_id = worker_id  # (a worker restarted there under another id is not this one)
                known = (info.incarnation, t)
                self._transports[worker_id] = known
        if stale is not None:
            stale.close()
        return known[1]

    def failed(self, worker_id: str, incarnation: tuple[Any, ...], err: Exception,
               in_flight: Future[Any] | None = None, *, slow: bool = False) -> None:
        """Treat the worker's process `incarnation` as down for a while (`slow`: as slow, skipped by reads
        only) and drop its connection: at once, or (a call still `in_flight` on it past the deadline) when
        that call ends, never under it. (A call that took an older member list may fail on a process
        restarted since: the new one's connection stays, and it is not suspect.)"""
        with self._lock:
            first = worker_id not in self._warned  # logged once per outage of the worker: retries every
            self._warned.add(worker_id)            # SUSPECT_S would fill an engine's log
            (self._slow if slow else self._suspect)[worker_id] = (time.monotonic() + SUSPECT_S, incarnation)
        (log.warning if first else log.debug)("worker %s failed (%s); treating it as %s for %.0f s%s", worker_id,
                                              err, "slow (reads skip it)" if slow else "down", SUSPECT_S,
                                              "" if first else " (again)")
        self._drop(worker_id, incarnation, in_flight)

    def _drop(self, worker_id: str, incarnation: tuple[Any, ...], in_flight: Future[Any] | None = None) -> None:
        """Drop the connection to the worker's process `incarnation` (the next call opens another): at once,
        or when the call `in_flight` on it ends."""
        with self._lock:
            known = self._transports.get(worker_id)
            if known is None or known[0] != incarnation:
                return
            del self._transports[worker_id]
        if in_flight is None:
            known[1].close()
        else:
            in_flight.add_done_callback(lambda _: known[1].close())

    def each(self, live: Mapping[str, WorkerInfo], groups: Mapping[str, list[int]],
             call: Callable[[Transport, list[int]], T], deadline: float,
             suspects: bool = False, reads: bool = False) -> Iterator[tuple[str, list[int], T]]:
        """(worker, key indices, result) per worker of `groups` that answered by `deadline` (monotonic
        seconds); the workers are asked in parallel, so one call waits for the slowest worker once, not
        for each in turn. A worker that fails, or leaves its call unanswered for `timeout_s`, is marked
        down and skipped; one that misses a shorter deadline, slow. One marked down already is not asked,
        unless `suspects` (a message that must reach it the moment it answers again:
        `kvpool.core.missed_writes`); one marked slow is not asked for `reads` (calls that only read)."""
        used: dict[str, Transport] = {}  # the connection each call took, for `_abandon`
        began: dict[str, float] = {}  # when each call started (it may have waited for a thread)
        gate = threading.Lock()
        abandoned = [False]

        def ask(w: str, idx: list[int]) -> T:
            for attempt in (0, 1):
                t = self.transport(w, live[w])
                with gate:
                    if abandoned[0]:
                        raise PoolUnavailable(f"worker {w}: the call was abandoned at its deadline")
                    used[w] = t
                    began.setdefault(w, time.monotonic())
                entered = sessions_entered()
                try:
                    return call(t, idx)
                except Abandoned:
                    # Another call, past its own (shorter) deadline, gave up on the connection this one
                    # waited for, and dropped it (`_abandon`): where this call sent nothing yet (it entered
                    # no session: a call of several frames may have sent some), once more on a fresh one;
                    # else it fails, the worker only slow (not its fault: writes still go to it).
                    if attempt or abandoned[0] or sessions_entered() != entered:
                        raise
            raise AssertionError("unreachable")

        if self._closed:
            raise PoolUnavailable(self._why_closed)
        if not suspects:
            groups = self._askable(live, groups, reads)
        if not groups:
            return

        budget = deadline - time.monotonic()
        if budget <= 0:
            return
        if len(groups) == 1 and budget >= 0.99 * self.timeout_s:
            # the common case (one owner, the whole budget): no thread hop; the socket timeout bounds it
            ((w, idx),) = groups.items()
            try:
                result = ask(w, idx)
            except PoolUnavailable as e:
                self.failed(w, live[w].incarnation, e, slow=isinstance(e, Abandoned))
                return
            self._answered(w)
            yield w, idx, result
            return
        try:
            futures = {self._pool.submit(ask, w, idx): (w, idx) for w, idx in groups.items()}
        except RuntimeError as e:  # `close` shut the pool down meanwhile (what was submitted fails fast)
            raise PoolUnavailable("the client is closed") from e
        try:
            done, late = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:  # interrupted (Ctrl-C, a signal handler's exception): none may land later
            self._interrupted(futures, gate, abandoned, live, used, began)
            raise
        if late:
            with gate:
                abandoned[0] = True
            self._abandon({f: futures[f][0] for f in late}, live, used, began)
        for f in done:
            w, idx = futures[f]
            try:
                result = f.result()
            except PoolUnavailable as e:
                self.failed(w, live[w].incarnation, e, slow=isinstance(e, Abandoned))
                continue
            self._answered(w)
            yield w, idx, result

    def _interrupted(self, futures: Mapping[Future[Any], tuple[str, list[int]]], gate: threading.Lock,
                     abandoned: list[bool], live: Mapping[str, WorkerInfo], used: Mapping[str, Transport],
                     began: Mapping[str, float]) -> None:
        """The caller was interrupted while its calls ran: those not begun never begin, those under way
        end first (each within `timeout_s`), so that none lands in the caller's buffers later. Their
        connections are not aborted (other threads' calls may be on them, and the workers are not at
        fault), unless the wait itself is interrupted or runs out: then they are, as at a deadline."""
        with gate:
            abandoned[0] = True
        running = [f for f in futures if not f.cancel()]
        try:
            _, running_set = wait(running, timeout=self.timeout_s)
            running = list(running_set)
        finally:
            if running:
                self._abandon({f: futures[f][0] for f in running if not f.done()}, live, used, began, blame=False)

    def _abandon(self, late: dict[Future[Any], str], live: Mapping[str, WorkerInfo],
                 used: Mapping[str, Transport], began: Mapping[str, float], blame: bool = True) -> None:
        """Calls past their deadline: each worker is marked down (slow, where its call ran for less than
        `timeout_s`; not at all unless `blame`: the caller was interrupted) and its connection aborted,
        and this returns once every such call has stopped (at once: its I/O fails), so that none writes
        into the caller's buffers, or sends from them, after the caller has them back."""
        started = []
        now = time.monotonic()
        for f, w in late.items():
            if f.cancel():
                continue  # never started (or cancelled by `close`: `wait` would not see it end)
            started.append(f)
            waited = now - began.get(w, now)
            if blame:
                self.failed(w, live[w].incarnation,
                            PoolTimeout(f"no answer within {waited:.2f} s of the call's {self.timeout_s} s",
                                        limit=self.timeout_s), f, slow=waited < _WHOLE * self.timeout_s)
            else:
                self._drop(w, live[w].incarnation, f)
            t = used.get(w)
            if t is not None:
                t.abort()
        _, running = wait(started, timeout=self.timeout_s)
        if running:  # nothing left to block on once aborted: a defect if seen
            log.error("%d abandoned call(s) still running %.0f s after their connections were aborted",
                      len(running), self.timeout_s)

    def answering(self, others_than: Iterable[str]) -> bool:
        """Whether a worker other than `others_than` answered this client within SUSPECT_S: the pool is
        reachable, whatever those workers are."""
        now, excluded = time.monotonic(), set(others_than)
        return any(now - at < SUSPECT_S for w, at in list(self._answered_at.items()) if w not in excluded)

    def _answered(self, worker_id: str) -> None:
        """The worker answered: a later failure of it is a new outage, logged again; it is no longer slow."""
        self._answered_at[worker_id] = time.monotonic()
        if worker_id in self._warned:
            with self._lock:
                self._warned.discard(worker_id)
                self._slow.pop(worker_id, None)
            log.info("worker %s answers again", worker_id)

    def forked(self) -> None:
        """In a forked child: refuse every call (its threads and the parent's connections are not the
        child's to use; PoolUnavailable tells the caller to make a client of its own)."""
        self._lock = threading.Lock()
        self._closed = True
        self._why_closed = "this client was made in the parent process: make a new PoolClient in the forked child"
        self._transports = {}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            transports = [t for _, t in self._transports.values()]
            self._transports.clear()
        # queued calls still run, and fail at once (closed): a future cancelled here would never be seen
        # to end by `wait` (it only learns of cancellations a worker thread reports)
        self._pool.shutdown(wait=False)
        for t in transports:
            t.close()

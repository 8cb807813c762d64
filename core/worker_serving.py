"""How a worker serves its connections: accept loops, one thread per connection, the deadlines its
watchdog enforces, who is authenticated (Unix peers by SO_PEERCRED, TCP peers by challenge-response,
see `kvpool.core.auth`, inside TLS when the worker has a certificate, see `kvpool.core.tls`), and the
dispatch of each frame to its handler (`kvpool.core.worker_ops`).

A malformed frame closes that connection only, with a logged reason; a connection that closes gives
back its reservations and leases.
"""
from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from . import protocol as P
from .auth import AuthThrottle, peer_pid, peer_uid, same_user
from .cache import BlockRef, TieredCache
from .config import WorkerConfig
from .errors import AuthError, KVPoolError, ProtocolError, StorageError
from .metrics import WorkerMetrics
from .sparse_log import SparseLog
from .tenants import Tenant
from .tls import server_context

__all__ = ["Conn", "ConnectionServing", "shutdown"]

log = logging.getLogger("kvpool.worker")

_SOCK_BUF = 8 << 20  # room for the sender to run ahead while a received chunk is hashed

_PREAUTH_META = 4096
"""Metadata bytes a frame may carry before its connection authenticates (HELLO and AUTH need little)."""

_ALONE_S = 0.01
"""A connection polls for its next request (`ConnectionServing._poll`) only if every request this long
before came on it."""

_POLL_BACKOFF = 6
"""A connection lets at most 2^6 - 1 chances to poll go between two polls that find nothing (`_poll`)."""

_SHM_OPS = frozenset({P.Op.ALLOC, P.Op.COMMIT, P.Op.COMMIT_UNCHECKED, P.Op.ABORT, P.Op.LEASE, P.Op.RELEASE})


class Conn:
    """State of one client connection."""

    def __init__(self, sock: socket.socket, transport: str, authed: bool, peer: str) -> None:
        self.sock = sock
        self.transport = transport
        self.authed = authed
        self.peer = peer  # the source address (TCP) or "uid <n>" (Unix): what failures are counted by
        self.nonce = b""  # the worker's challenge, sent in the pre-auth HELLO reply
        self.holder = 0  # the client process's id, from its HELLO: whose pins its PINs are (kvpool.core.pins)
        self.tenant: Tenant | None = None  # set by AUTH with a tenant's token: keys of its namespace only
        self.refused_keys = 0  # requests refused for naming keys outside the tenant's namespace
        self.over_quota = False  # a put was refused for the tenant's quota (logged once per connection)
        self.since = time.monotonic()
        self.request_since = 0.0  # monotonic time of the current request's first byte; 0 between requests
        self.closing = ""  # why the watchdog shut the connection down
        self.busy = False
        self.may_poll = False  # a same-node client in another process: see ConnectionServing._poll
        self.answered_at = 0.0  # perf_counter() when the last request was answered
        self.in_burst = False  # the last request came within `poll_us` of the answer before it
        self.poll_misses = 0  # polls in a row that found no request within `poll_us`
        self.poll_skips = 0  # chances to poll to let go before the next poll
        self.reserved: dict[int, int] = {}  # offset -> size
        self.leases: dict[int, BlockRef] = {}  # lease id -> block
        self.next_lease = 1
        self.gone = threading.Event()
        """Set once the worker shut the connection (`shut`): its thread's throttle wait ends with it."""

    def shut(self, why: str = "") -> None:
        """Shut the connection down from another thread (`why`: the watchdog's, or a displacement's): its
        thread wakes from a blocked receive, or from the wait of a failed AUTH, and cleans up."""
        if why:
            self.closing = why
        self.gone.set()
        shutdown(self.sock)


class ConnectionServing:
    """The connection half of a `Worker`: it accepts, authenticates and serves; `Worker` binds the
    listeners and sets the fields below before `_serve_in_background`."""

    config: WorkerConfig
    cache: TieredCache
    metrics: WorkerMetrics
    token: str | None
    _tcp: socket.socket
    _unix: socket.socket
    _handlers: dict[int, Callable[[Conn, P.Frame], None]]

    def _init_serving(self) -> None:
        self._stopping = threading.Event()
        self._conns: set[Conn] = set()
        self._conns_lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # one per connection, joined by the drain
        self._helpers: list[threading.Thread] = []  # the worker's other background threads, joined by stop()
        self._pollers = threading.BoundedSemaphore(max(1, len(os.sched_getaffinity(0)) // 2))
        """Connection threads that may poll for their next request at once (`_poll`)."""
        self._last_conn: Conn | None = None  # whose request came last
        self._switched_at = 0.0  # perf_counter() when a request last came on another connection than the one before
        self._acceptors: list[threading.Thread] = []  # one accept loop per listener
        self._accept_errors: dict[str, str] = {}  # transport -> the error last logged
        self._refusing: set[str] = set()  # connection limits already logged as reached
        self._closed_log = SparseLog(log)  # connections the worker shut
        self._storage_log = SparseLog(log)  # changes a full disk would not make durable
        self.throttle = AuthThrottle()
        self._op_metrics: dict[int, tuple[Any, Any]] = {}  # op -> its labelled counter and histogram
        cfg = self.config
        self._tls = server_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
        """TLS on TCP connections (`WorkerConfig.tls_cert`); None: clear text."""

    def _serve_in_background(self) -> None:
        for lsock, transport in ((self._tcp, "tcp"), (self._unix, "shm")):
            t = threading.Thread(target=self._accept_loop, args=(lsock, transport), daemon=True,
                                 name=f"kvpool-accept-{transport}")
            t.start()
            self._acceptors.append(t)
        watchdog = threading.Thread(target=self._watchdog, daemon=True, name="kvpool-watchdog")
        watchdog.start()
        self._helpers.append(watchdog)

    def _stop_accepting(self, timeout: float) -> None:
        """Close the listeners and end their accept loops (`_stopping` is set). A thread blocked in
        accept() is not woken by a close on Linux, and the socket would go on listening under it: a
        shutdown wakes it first."""
        for lsock in (self._tcp, self._unix):
            try:
                lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not listening (yet, or any more)
            lsock.close()
        for t in self._acceptors:
            t.join(timeout)
        self._acceptors.clear()

    def _drain_connections(self, deadline: float) -> None:
        """Shut idle connections, wait for busy ones to finish their request (until `deadline`)."""
        while time.monotonic() < deadline:
            with self._conns_lock:
                idle = [c for c in self._conns if not c.busy]
                busy = len(self._conns) - len(idle)
            for c in idle:
                c.shut()
            if not busy and not idle:
                break
            time.sleep(0.01)
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))

    def _accept_loop(self, lsock: socket.socket, transport: str) -> None:
        """Accept until stop(). An accept error (EMFILE, ENFILE, ENOBUFS, ...) never ends the loop while
        the worker is listed: it is counted, logged once per change, and retried after a back-off. An
        unexpected error admitting a connection closes that connection (logged once per listener) and
        the loop goes on: a listener that died would leave the worker looking healthy, serving no one."""
        backoff = 0.0
        admit_failed = False
        while not self._stopping.is_set():
            try:
                sock, addr = lsock.accept()
            except OSError as e:
                if self._stopping.is_set():
                    return
                backoff = min(1.0, backoff * 2 or 0.01)
                self._accept_failed(transport, e)
                self._stopping.wait(backoff)
                continue
            if backoff:
                backoff = 0.0
                log.info("accepting %s connections again", transport)
                self._accept_errors.pop(transport, None)
            if transport == "shm":
                if not self._unix_peer_ok(sock):
                    continue
                authed, peer = True, "unix"
            else:
                authed, peer = not self.token, str(addr[0])
                if self._tls is not None:
                    try:  # the handshake itself happens in the connection's thread, under its deadlines
                        sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                    except OSError as e:  # e.g. the peer reset the connection already
                        log.debug("cannot start TLS with %s: %s", peer, e)
                        sock.close()
                        continue
            try:
                self._admit(sock, transport, authed, peer)
            except Exception:  # a bug, or a setting that slipped past WorkerConfig's checks
                sock.close()
                log.log(logging.DEBUG if admit_failed else logging.ERROR, "cannot admit a %s connection from %s: "
                        "closed (further failures are logged at debug level)", transport, peer, exc_info=True)
                admit_failed = True

    def _unix_peer_ok(self, sock: socket.socket) -> bool:
        """A Unix-socket peer is served only if the kernel says it is this user (or root); the socket
        file is 0600 too, so this holds even if its folder's permissions are loosened."""
        try:
            uid = peer_uid(sock)
        except OSError as e:
            uid = -1
            log.warning("cannot read a Unix peer's credentials: %s", e)
        if same_user(uid):
            return True
        self.metrics.auth_failures.labels("peer_uid").inc()
        self.throttle.failed(f"uid {uid}", "a Unix-socket peer of another user")
        sock.close()
        return False

    def _admit(self, sock: socket.socket, transport: str, authed: bool, peer: str) -> None:
        if transport == "tcp":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        io_timeout = struct.pack("ll", int(self.config.io_timeout_s), int(self.config.io_timeout_s % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, io_timeout)  # see _next_frame
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, io_timeout)
        conn = Conn(sock, transport, authed, peer)
        conn.may_poll = transport == "shm" and self.config.poll_us > 0 and _other_process(sock)
        if not conn.authed:
            sock.settimeout(self.config.auth_timeout_s)  # lifted by a good AUTH; the watchdog bounds the rest
        t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="kvpool-conn")
        # Counted, made room for and added at once: connections accepted together on two listeners (TCP
        # and Unix) neither both pass the limit nor both displace the same stranger.
        with self._conns_lock:
            # (a stranger the worker shut goes at once: its thread waits on no lock, no disk; an
            # authenticated one shut mid-request may be held up there, and still counts)
            full = sum(c.authed or not c.closing for c in self._conns) >= self.config.max_connections
            waiting = [c for c in self._conns if not c.authed and not c.closing]
            if full and not waiting:
                self._refused(transport, "max_connections")
                sock.close()
                return
            if full or (not authed and len(waiting) >= self.config.max_unauthenticated):
                # The oldest stranger makes room: a client with the token authenticates within a round
                # trip and so outlives any crowd of strangers, who only ever displace each other (and
                # never shut out authenticated clients, a same-node one included, by holding slots).
                oldest = min(waiting, key=lambda c: c.since)
                limit = "max_connections" if full else "max_unauthenticated"
                self._refused(transport, limit)
                oldest.shut(f"displaced by a newer connection ({limit})")
            self._conns.add(conn)
            self._threads.append(t)
        try:
            t.start()
        except RuntimeError:  # no thread to be had (a pids limit): the connection goes, and so does its slot
            with self._conns_lock:
                self._conns.discard(conn)
                self._threads.remove(t)
            raise

    def _storage_refused(self, e: StorageError) -> None:
        """Log a change the SSD tier would not make durable, once a minute at most."""
        self._storage_log.log("a change is not durable: %s", e)

    def connections(self) -> list[Conn]:
        """The connections open now (a copy)."""
        with self._conns_lock:
            return list(self._conns)

    def _refused(self, transport: str, limit: str, why: str = "") -> None:
        """Count (and log the first time) a connection closed because `limit` was reached (`why`: in
        words, where `limit` is no setting's name)."""
        self.metrics.refused.labels(limit).inc()
        if limit not in self._refusing:
            self._refusing.add(limit)
            log.warning("%s connections: %s reached; connections are closed (counted in "
                        "kvpool_refused_connections_total; logged once)", transport,
                        why or f"{limit} ({getattr(self.config, limit)})")

    def _watchdog(self) -> None:
        """Enforce the deadlines that span system calls: a request must be received and answered within
        io_timeout_s of its first byte, a TCP peer with a token to present must authenticate within
        auth_timeout_s of connecting. A late connection is shut down, which wakes its thread out of
        any blocked receive or send; that thread then frees what the connection held."""
        cfg = self.config
        every = max(0.05, min(cfg.io_timeout_s, cfg.auth_timeout_s) / 10)
        while not self._stopping.wait(every):
            now = time.monotonic()
            with self._conns_lock:
                conns = list(self._conns)
            for c in conns:
                if c.closing:
                    continue
                if not c.authed and now - c.since > cfg.auth_timeout_s:
                    why = self._unauthenticated_why()
                elif c.request_since and now - c.request_since > cfg.io_timeout_s:
                    why = f"a request not done within io_timeout_s ({cfg.io_timeout_s} s)"
                else:
                    continue
                if self._late(c, why):
                    c.shut()

    def _unauthenticated_why(self) -> str:
        return f"not authenticated within auth_timeout_s ({self.config.auth_timeout_s} s)"

    def _late(self, conn: Conn, why: str) -> bool:
        """Mark `conn` closed for a deadline (`why`) and count it, once: the watchdog and an unauthenticated
        connection's own receive timeout (`auth_timeout_s`) may both see it late. False if marked already."""
        with self._conns_lock:
            if conn.closing:
                return False
            conn.closing = why
        self.metrics.deadline_closes.labels("auth" if not conn.authed else "io").inc()
        return True

    def _accept_failed(self, transport: str, err: OSError) -> None:
        self.metrics.accept_errors.labels(transport).inc()
        why = f"{type(err).__name__}: {err}"
        if self._accept_errors.get(transport) != why:
            self._accept_errors[transport] = why
            log.warning("cannot accept %s connections (%s); retrying with back-off", transport, why)

    def _serve(self, conn: Conn) -> None:
        self.metrics.connections.labels(conn.transport).inc()
        try:
            if isinstance(conn.sock, ssl.SSLSocket):
                self._tls_handshake(conn, conn.sock)
            while not self._stopping.is_set():
                frame = self._next_frame(conn)  # sets conn.request_since at the request's first byte
                conn.busy = True
                t0 = time.perf_counter()
                self._dispatch(conn, frame)
                conn.answered_at = t1 = time.perf_counter()
                served, latency = self._op_metrics.get(frame.op) or self._metrics_of(frame.op)
                served.inc()
                latency.observe(t1 - t0)
                conn.busy = False
                conn.request_since = 0.0
        except AuthError:
            pass  # a failed AUTH: counted (kvpool_auth_failures_total) and logged by the throttle
        except ProtocolError as e:
            self.metrics.protocol_errors.inc()
            if conn.authed:
                log.warning("closing %s connection: %s", conn.transport, e)
            else:  # a stranger's bytes (a port scan, an HTTP health check): no flood of warnings
                self._closed_log.log("closing %s connection from %s: %s", conn.transport, conn.peer, e)
        except KVPoolError as e:  # e.g. a full disk under REMOVE or CLEAR, or the cache closing under us
            log.warning("closing %s connection: %s: %s", conn.transport, type(e).__name__, e)
        except ssl.SSLError as e:  # a record that fails its MAC (altered on the way), a TLS alert
            log.warning("closed a TLS connection from %s: %s", conn.peer, conn.closing or e)
        except (ConnectionError, OSError) as e:
            if not conn.authed and isinstance(e, TimeoutError):  # its receive timeout: auth_timeout_s
                self._late(conn, self._unauthenticated_why())
            if conn.closing:  # the worker's doing (a deadline, a displacement), not the client's
                self._closed_log.log("closed a %s connection: %s", conn.transport, conn.closing)
        finally:
            conn.busy = False
            self._cleanup(conn)
            self.metrics.connections.labels(conn.transport).dec()

    def _tls_handshake(self, conn: Conn, sock: ssl.SSLSocket) -> None:
        """TLS first, within the deadlines of a request (and of authentication). A failed handshake (a
        client that does not trust our certificate, or speaks clear text) is counted and logged once per
        address, as a failed authentication."""
        conn.request_since = time.monotonic()
        try:
            sock.do_handshake()
        except ssl.SSLEOFError as e:  # closed before a word of TLS (a port probe, a readiness check)
            raise ConnectionError("closed during the TLS handshake") from e
        except ssl.SSLError as e:
            self.metrics.auth_failures.labels("tls").inc()
            self.throttle.failed(conn.peer, f"a failed TLS handshake: {e.reason or e}")
            raise ConnectionError("TLS handshake failed") from e
        conn.request_since = 0.0

    def _wait_tls(self, sock: ssl.SSLSocket) -> None:
        """`_next_frame`'s idle wait on a TLS connection, which has no MSG_PEEK: until a record is
        buffered or the socket turns readable (data or EOF, which the read then reports)."""
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        while not sock.pending() and not poller.poll(int(self.config.io_timeout_s * 1000)):
            if self._stopping.is_set():
                raise ConnectionError("worker stopping")

    def _metrics_of(self, op: int) -> tuple[Any, Any]:
        """The request counter and latency histogram of `op` (labelled once, then kept: a frame's cost)."""
        name = P.Op(op).name.lower()
        self._op_metrics[op] = pair = (self.metrics.ops.labels(name), self.metrics.latency.labels(name))
        return pair

    def _next_frame(self, conn: Conn) -> P.Frame:
        """Wait for the next request for as long as the client idles; from its first byte on, every
        receive and send of the exchange must progress within io_timeout_s (the socket's SO_RCVTIMEO
        and SO_SNDTIMEO) or the connection is dropped, so a stalled peer cannot hold slots or leases."""
        max_meta = P.MAX_META if conn.authed else _PREAUTH_META
        sock = conn.sock
        if isinstance(sock, ssl.SSLSocket):
            self._wait_tls(sock)
            conn.request_since = time.monotonic()
            return P.recv_frame(sock, max_meta)
        # The idle wait is the header's own receive (no MSG_PEEK first): it returns with the first bytes.
        head = bytearray(P.HEADER.size)
        view = memoryview(head)
        got = self._poll(conn, view)
        while got < 0:
            try:
                got = sock.recv_into(view)
            except BlockingIOError:  # SO_RCVTIMEO while idle: keep waiting, unless stopping
                if self._stopping.is_set():
                    raise ConnectionError("worker stopping") from None
        now = time.perf_counter()
        conn.in_burst = now - conn.answered_at < self.config.poll_us * 1e-6
        if conn is not self._last_conn:
            self._last_conn, self._switched_at = conn, now
        if not got:
            raise ConnectionError("closed by the client")
        conn.request_since = time.monotonic()
        if got < len(head):
            P.recv_exactly(sock, view[got:])
        return P.recv_frame(sock, max_meta, head)

    def _poll(self, conn: Conn, view: memoryview) -> int:
        """In a burst, the first bytes of the next request as they arrive within `poll_us` of the last
        answer (0: the client closed), without the thread going to sleep; -1 if none came. Only a
        same-node client in another process (`Conn.may_poll`), in a burst, that had the worker to itself
        for `_ALONE_S`: a polling thread keeps the GIL (and a core) from the worker's other threads, so
        its poll would delay another connection's requests (or those of a client in the worker's own
        process) by up to `poll_us` each (now only the first after such a spell alone); and at most half
        the cores poll. A connection whose polls keep finding nothing (a producer that sends a few
        requests together once a layer: they look like a burst, and the next comes later) polls ever
        less often: after n such polls in a row it lets the next 2^n - 1 chances go (n up to
        `_POLL_BACKOFF`), until a poll finds a request it waited for."""
        if (not conn.may_poll or not conn.in_burst or time.perf_counter() - self._switched_at < _ALONE_S):
            return -1
        if conn.poll_skips:
            conn.poll_skips -= 1
            return -1
        if not self._pollers.acquire(blocking=False):
            return -1
        try:
            until, sock = conn.answered_at + self.config.poll_us * 1e-6, conn.sock
            waited = False
            while time.perf_counter() < until:
                try:
                    got = sock.recv_into(view, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    waited = True
                    continue
                if waited:  # (a request already there came with the one before: it says nothing)
                    conn.poll_misses = 0
                    self.metrics.polled_requests.inc()
                return got
            self.metrics.empty_polls.inc()
            conn.poll_misses = min(conn.poll_misses + 1, _POLL_BACKOFF)
            conn.poll_skips = (1 << conn.poll_misses) - 1
            return -1
        finally:
            self._pollers.release()

    def _cleanup(self, conn: Conn) -> None:
        """Give back what a departed client held: reservations (never committed) and leases."""
        for offset in conn.reserved:
            self.cache.abort(offset)
        for block in conn.leases.values():
            self.cache.release(block)
        conn.reserved.clear()
        conn.leases.clear()
        shutdown(conn.sock)
        conn.sock.close()
        with self._conns_lock:
            self._conns.discard(conn)
            t = threading.current_thread()
            if t in self._threads:
                self._threads.remove(t)

    def _dispatch(self, conn: Conn, frame: P.Frame) -> None:
        handler = self._handlers.get(frame.op)
        if handler is None:
            raise ProtocolError(f"unknown op {frame.op}")
        if not conn.authed and frame.op not in (P.Op.HELLO, P.Op.AUTH):
            P.send_frame(conn.sock, frame.op, P.pack_json({"error": "authenticate first (AUTH with the pool token)"}),
                         status=P.Status.AUTH_REQUIRED, req_id=frame.req_id)
            raise ProtocolError(f"unauthenticated op {frame.op}")
        if frame.data_len and frame.op != P.Op.PUT:
            raise ProtocolError(f"op {frame.op} carries {frame.data_len} data bytes; only PUT carries data")
        if conn.transport == "tcp" and frame.op in _SHM_OPS:
            raise ProtocolError(f"op {frame.op} is for same-node clients over the Unix socket")
        try:
            handler(conn, frame)
        except StorageError as e:  # a change done but not durable (a full disk): said, and the connection kept
            if frame.data_len:  # (a PUT's bytes may be unread: its blocks carry ITEM_STORAGE instead)
                raise
            self._storage_refused(e)
            if frame.op not in P.ONE_WAY:  # (SUPERSEDE, PIN: no reply is read)
                self._reply(conn, frame, P.pack_json({"error": str(e)}), status=P.Status.STORAGE)

    def _reply(self, conn: Conn, frame: P.Frame, meta: bytes = b"", data: list[memoryview] | None = None,
               status: int = P.Status.OK) -> None:
        P.send_frame(conn.sock, frame.op, meta, status=status, req_id=frame.req_id, data=data)

    def _challenge(self, conn: Conn) -> bytes:
        """A fresh nonce for this connection's AUTH (each HELLO replaces the last)."""
        conn.nonce = secrets.token_bytes(32)
        return conn.nonce


def _other_process(sock: socket.socket) -> bool:
    """Whether the Unix-socket peer is another process than this one."""
    try:
        return peer_pid(sock) != os.getpid()
    except OSError:
        return False


def shutdown(sock: socket.socket) -> None:
    """Shut both directions, waking any thread blocked on `sock`. On a TLS socket, the TCP socket
    under it: `SSLSocket.shutdown` would drop its TLS state under a thread still using it."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass

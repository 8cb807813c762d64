"""A blocking NATS connection for the handoff's hot path: announcements out, live messages in.

nats-py is asyncio-only, so `Link` runs it on a loop thread of its own: a message published from the
caller's thread crosses to that loop and through nats-py's writer and flusher tasks, and one received
crosses its reader and subscription tasks and back to the caller's thread. On a 2-core machine that
made a notification about 0.4 ms end to end, where the NATS protocol on a blocking socket takes 0.05 ms
(publisher to subscriber through nats-server). `Wire` speaks the few verbs a handoff needs from the
caller's own thread: HPUB (with a reply subject for JetStream's acknowledgement), SUB/UNSUB, PING,
a request and its one answer (a receiver's purge: `request`); it reads MSG/HMSG, answers the server's
PINGs, and keeps the server's -ERR lines. It authenticates as `kvpool.core.nats_connect` does (the same
credentials: an nkey or a password; TLS from the same CA setting). Everything else (reading a stream
back, admin) stays on nats-py.

Threads: any number may use one Wire. Writes take one lock; of the threads waiting for messages, one
reads the socket at a time and hands the others theirs (a TLS socket is never read and written at
once). A Wire that breaks reconnects at its next use, to the first server of the URL's list that
answers, and subscribes again; `reconnects` counts that, since what was in flight then may be lost:
core NATS delivery is at most once, and its users read the stream's stored copy when it counts.
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import json
import os
import secrets
import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

from kvpool.core import AuthError, NatsCreds, Role, find_creds, redacted_url

from .errors import StreamError, StreamRefused, StreamUnavailable

T = TypeVar("T")

_READ = 256 << 10
"""Bytes one read asks the socket for."""
_MAX_LINE = 64 << 10
"""Longest protocol line (INFO, MSG headers line, -ERR) taken from a server."""
_MAX_PAYLOAD = 1 << 20
"""nats-server's default max_payload: a server's INFO that names none."""
_MAX_ERRORS = 16
"""-ERR lines kept (the newest)."""


@dataclasses.dataclass(frozen=True)
class Msg:
    """A message as delivered on a subscription; `headers` has the status line's code as `Status`."""

    subject: str
    reply: str
    headers: dict[str, str]
    data: bytes


def _servers(url: str) -> list[urllib.parse.SplitResult]:
    out = []
    for part in url.split(","):
        part = part.strip()
        if part:
            out.append(urllib.parse.urlsplit(part if "://" in part else f"nats://{part}"))
    return out


def _header_block(headers: dict[str, str]) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"NATS/1.0\r\n{lines}\r\n".encode()


def _parse_headers(raw: bytes) -> dict[str, str]:
    head, *lines = raw.decode(errors="replace").split("\r\n")
    out: dict[str, str] = {}
    status = head[len("NATS/1.0"):].strip()
    if status:
        code, _, desc = status.partition(" ")
        out["Status"] = code
        if desc:
            out["Description"] = desc
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip()] = value.strip()
    return out


class Wire:
    """One NATS connection used from the caller's threads (see the module's doc). `role`, `creds`,
    `tls`: as `kvpool.core.nats_connect`'s. Connects at once: StreamRefused if the server refuses us,
    StreamUnavailable if none answers within `timeout_s`."""

    def __init__(self, url: str, timeout_s: float = 5.0, *, role: Role = "client",
                 creds: NatsCreds | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.url, self.timeout_s = url, timeout_s
        self._servers = _servers(url)
        if creds is None and not any(s.username for s in self._servers):
            creds = find_creds(role)
        self._creds = creds
        if tls is None and os.environ.get("KVPOOL_NATS_TLS_CA"):
            tls = ssl.create_default_context(cafile=os.environ["KVPOOL_NATS_TLS_CA"])
        self._tls = tls
        self._io = threading.Lock()  # one socket operation at a time
        self._cond = threading.Condition()  # queues, pongs, the reader's role
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._subs: dict[int, str] = {}
        self._inbox = f"_INBOX.{secrets.token_hex(11)}"  # (the reply subjects of `request`, one per request)
        self._queues: dict[int, collections.deque[Msg]] = {}
        self._next_sid = 1
        self._pongs = self._pings = 0
        self._reading = False
        self._polled: tuple[socket.socket, Any] | None = None
        self.errors: collections.deque[str] = collections.deque(maxlen=_MAX_ERRORS)
        """The server's -ERR lines (the newest last): e.g. a publish it denied."""
        self.error_count = 0
        """-ERR lines so far (a waiter in `next` wakes at one)."""
        self.reconnects = 0
        self.max_payload = _MAX_PAYLOAD
        """The largest message (headers and body) the server takes: its INFO's, at the last connect."""
        self._closed = False
        with self._io:
            self._connect()

    # -- connecting --------------------------------------------------------------------------------

    def _connect(self) -> None:
        """Connect to the first server that answers (caller holds `_io`)."""
        last: BaseException | None = None
        for server in self._servers:
            try:
                self._sock = self._handshake(server)
                for sid, subj in self._subs.items():
                    self._send(f"SUB {subj} {sid}\r\n".encode())
                return
            except (StreamRefused, AuthError):
                raise
            except (OSError, ValueError) as e:
                last = e
        raise StreamUnavailable(f"NATS at {redacted_url(self.url)}: no server answered within {self.timeout_s} s "
                                f"({last!r})")

    def _handshake(self, server: urllib.parse.SplitResult) -> socket.socket:
        host, port = server.hostname or "127.0.0.1", server.port or 4222
        sock = socket.create_connection((host, port), timeout=self.timeout_s)
        self._buf.clear()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            info = self._info(self._line(sock))
            self.max_payload = int(info.get("max_payload") or _MAX_PAYLOAD)
            tls = self._tls if self._tls is not None or not info.get("tls_required") else ssl.create_default_context()
            if info.get("tls_required") or (tls is not None and info.get("tls_available")):
                assert tls is not None
                sock = tls.wrap_socket(sock, server_hostname=host)
            elif tls is not None or server.scheme == "tls":
                raise StreamRefused(f"NATS at {host}:{port} offers no TLS, and this client talks only TLS to it")
            sock.sendall(b"CONNECT " + json.dumps(self._connect_options(info, server)).encode() + b"\r\nPING\r\n")
            while not (line := self._line(sock)).startswith(b"PONG"):
                if line.startswith(b"-ERR"):
                    why = line[4:].strip().decode(errors="replace")
                    who = f"as {self._creds.user!r}" if self._creds is not None else "without credentials"
                    raise StreamRefused(f"connect to {redacted_url(self.url)}: NATS refused to let us in {who}: {why}")
            return sock  # what followed the PONG stays in the buffer
        except ssl.SSLCertVerificationError as e:
            sock.close()
            raise StreamRefused(f"connect to {redacted_url(self.url)}: NATS's TLS certificate is not trusted "
                                f"(KVPOOL_NATS_TLS_CA names the CA file to trust): {e}") from e
        except BaseException:
            sock.close()
            raise

    def _line(self, sock: socket.socket) -> bytes:
        """The next protocol line during the handshake (the socket blocks up to the timeout)."""
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > _MAX_LINE:
                raise ConnectionError("a protocol line longer than the limit")
            data = sock.recv(_READ)
            if not data:
                raise ConnectionError("the server closed the connection during the handshake")
            self._buf += data
        line = bytes(self._buf[:end])
        del self._buf[:end + 2]
        return line

    @staticmethod
    def _info(line: bytes) -> dict[str, Any]:
        if not line.startswith(b"INFO "):
            raise ConnectionError(f"not a NATS server: it said {line[:60]!r}")
        info: dict[str, Any] = json.loads(line[5:])
        return info

    def _connect_options(self, info: dict[str, Any], server: urllib.parse.SplitResult) -> dict[str, Any]:
        opts: dict[str, Any] = {"verbose": False, "pedantic": False, "lang": "python3-kvpool-wire", "version": "1",
                                "protocol": 1, "headers": True, "no_responders": True}
        creds = self._creds
        if creds is not None and creds.seed is not None:
            import nkeys

            kp = nkeys.from_seed(bytearray(creds.seed.encode()))
            try:
                opts["nkey"] = kp.public_key.decode()
                opts["sig"] = base64.b64encode(kp.sign(str(info.get("nonce", "")).encode())).decode()
            finally:
                kp.wipe()
        elif creds is not None:
            opts.update(user=creds.user, **{"pass": creds.password or ""})
        elif server.username:
            opts.update(user=urllib.parse.unquote(server.username),
                        **{"pass": urllib.parse.unquote(server.password or "")})
        return opts

    # -- writing -----------------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        """Send on the current socket (caller holds `_io`); a failure drops it (OSError raised)."""
        if self._sock is None:
            raise ConnectionError("not connected")
        try:
            self._sock.sendall(data)
        except OSError:
            self._drop()
            raise

    def _write(self, data: bytes) -> None:
        """Send `data`, reconnecting (once) first if the connection broke."""
        with self._io:
            if self._closed:
                raise StreamUnavailable(f"the connection to {redacted_url(self.url)} is closed")
            if self._sock is None:
                self._reconnect()
            try:
                self._send(data)
            except OSError:
                self._reconnect()
                try:
                    self._send(data)
                except OSError as e:  # a fresh connection failing at once: the server is in trouble
                    raise StreamUnavailable(f"NATS at {redacted_url(self.url)}: sending failed twice: {e!r}") from e

    def _reconnect(self) -> None:
        self._connect()
        with self._cond:  # PINGs lost with the old connection are never answered: count them done
            self._pongs = self._pings
        self.reconnects += 1

    def _drop(self) -> None:
        if self._sock is not None:
            try:  # (a close alone does not wake a thread polling the socket: a shutdown does)
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
            self._sock.close()
            self._sock = None

    def publish(self, subj: str, body: bytes, headers: dict[str, str] | None = None, reply: str = "") -> None:
        """Send one message (with `reply` as its reply subject); returns once the kernel has it."""
        self._write(self._pub(subj, body, headers, reply))

    def request(self, subj: str, body: bytes, timeout: float) -> Msg | None:
        """Send one message with a reply subject of its own and wait up to `timeout` seconds for its one
        answer (a JetStream API call); None as from `next` (none in time, an -ERR). One lost to a broken
        connection (written into a socket the server had closed: a restart while this Wire was idle) is
        sent again once on the new one: a request must be safe to repeat, as JetStream's reads and its
        purge up to a sequence are. A request that nobody serves is answered by the server: `Status` 503
        (no responders)."""
        deadline = time.monotonic() + timeout
        reconnects = self.reconnects
        got = self._request_once(subj, body, timeout)
        if got is None and self.reconnects != reconnects:
            got = self._request_once(subj, body, deadline - time.monotonic())
        return got

    def _request_once(self, subj: str, body: bytes, timeout: float) -> Msg | None:
        sid = self._add_sub(lambda sid: f"{self._inbox}.{sid}")
        inbox = self._subs[sid]
        answered = False
        try:  # (the server drops the subscription after its one message: UNSUB with a count)
            self._write(f"SUB {inbox} {sid}\r\nUNSUB {sid} 1\r\n".encode() + self._pub(subj, body, None, inbox))
            got = self.next(sid, timeout)
            answered = got is not None
            return got
        finally:
            if answered:
                self._forget(sid)
            else:
                self.unsubscribe(sid)

    def _pub(self, subj: str, body: bytes, headers: dict[str, str] | None, reply: str) -> bytes:
        """The protocol bytes of one message (StreamRefused past the server's max_payload)."""
        r = f" {reply}" if reply else ""
        hdr = _header_block(headers) if headers else b""
        if len(hdr) + len(body) > self.max_payload:  # the server would drop the connection, and a resend fail alike
            raise StreamRefused(f"a message of {len(hdr) + len(body)} bytes to {subj!r}: the server takes at most "
                                f"{self.max_payload} (its max_payload)")
        if headers:
            return b"".join((f"HPUB {subj}{r} {len(hdr)} {len(hdr) + len(body)}\r\n".encode(), hdr, body, b"\r\n"))
        return b"".join((f"PUB {subj}{r} {len(body)}\r\n".encode(), body, b"\r\n"))

    def subscribe(self, subj: str) -> int:
        """A subscription to `subj` (its id), in place at the server when this returns."""
        sid = self._add_sub(lambda _: subj)
        self._write(f"SUB {subj} {sid}\r\n".encode())
        self.flush()
        return sid

    def _add_sub(self, subject_of: Callable[[int], str]) -> int:
        """A new subscription id, its subject (`subject_of(sid)`) and queue, before its SUB is sent."""
        with self._cond:
            sid = self._next_sid
            self._next_sid += 1
            self._subs[sid] = subject_of(sid)
            self._queues[sid] = collections.deque()
        return sid

    def _forget(self, sid: int) -> None:
        with self._cond:
            self._subs.pop(sid, None)
            self._queues.pop(sid, None)

    def unsubscribe(self, sid: int) -> None:
        self._forget(sid)
        if not self._closed:
            try:
                self._write(f"UNSUB {sid}\r\n".encode())
            except StreamError:
                pass  # no connection: the subscription went with it

    def flush(self) -> None:
        """Until the server has processed everything sent before (a PING answered); StreamUnavailable if
        it does not answer within the timeout."""
        with self._cond:
            self._pings += 1
            want = self._pings
        reconnects = self.reconnects
        self._write(b"PING\r\n")
        got = self._wait(lambda: True if self._pongs >= want or self.reconnects != reconnects else None,
                         time.monotonic() + self.timeout_s)
        if got is None:
            raise StreamUnavailable(f"NATS at {redacted_url(self.url)} did not answer a PING within {self.timeout_s} s")

    # -- reading -----------------------------------------------------------------------------------

    def next(self, sid: int, timeout: float) -> Msg | None:
        """The next message of subscription `sid`, waiting up to `timeout` seconds; None if none came,
        the subscription is gone, the connection was made again meanwhile (`reconnects`: what was in
        flight may be lost, and the caller may want to send it again), or the server sent an -ERR
        (`errors`: e.g. a publish this user may not make)."""
        reconnects, error_count = self.reconnects, self.error_count

        def ready() -> Msg | bool | None:
            q = self._queues.get(sid)
            if q:
                return q.popleft()
            changed = self.reconnects != reconnects or self.error_count != error_count
            return False if q is None or changed else None
        got = self._wait(ready, time.monotonic() + max(timeout, 0.0))
        return got if isinstance(got, Msg) else None

    def pending(self, sid: int) -> list[Msg]:
        """The messages of `sid` that have arrived, without waiting (what the socket holds is read)."""
        self._wait(lambda: None, 0.0)
        with self._cond:
            q = self._queues.get(sid)
            out = list(q) if q else []
            if q:
                q.clear()
        return out

    def _wait(self, ready: Callable[[], T | None], deadline: float) -> T | None:
        """Until `ready()` (called under `_cond`) returns something, reading the socket when no other
        thread does; None at `deadline`. A deadline already past still reads what the socket holds."""
        first = True
        while True:
            with self._cond:
                while True:
                    got = ready()
                    if got is not None:
                        return got
                    left = deadline - time.monotonic()
                    if left <= 0 and not first:
                        return None
                    if not self._reading:
                        self._reading = True
                        break
                    if left <= 0:
                        return None
                    self._cond.wait(left)
            try:
                self._read(max(left, 0.0))
            finally:
                first = False
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()

    def _read(self, timeout: float) -> None:
        """Read what arrives within `timeout` seconds and hand it out (caller has the reader's role)."""
        sock = self._sock
        if sock is None:
            with self._io:
                if self._closed:
                    return
                try:
                    self._reconnect()
                except (StreamUnavailable, OSError):
                    down = True
                else:
                    down = False
            if down:
                time.sleep(min(timeout, 0.1))  # the next read tries again
                return
            sock = self._sock
            if sock is None:
                return
        pending = sock.pending() if isinstance(sock, ssl.SSLSocket) else 0
        if not pending:
            try:
                readable = self._poller(sock).poll(int(timeout * 1000 + 0.999))
            except (OSError, ValueError):  # closed under us
                readable = []
            if not readable:
                return
        with self._io:
            if sock is not self._sock:
                return
            try:
                data = sock.recv(_READ)
            except (ssl.SSLWantReadError, BlockingIOError, TimeoutError):
                return
            except OSError:
                self._drop()
                return
            if not data:
                self._drop()
                return
            self._buf += data
            try:
                msgs, pongs = self._parse()
            except (ValueError, IndexError, StreamUnavailable, OSError):  # a malformed MSG line; a PONG not sent
                self._drop()  # not the protocol: start over on a fresh connection
                return
        with self._cond:
            self._pongs += pongs
            for sid, msg in msgs:
                q = self._queues.get(sid)
                if q is not None:
                    q.append(msg)

    def _poller(self, sock: socket.socket) -> Any:
        """A poll object for `sock` (not select(): an engine process may hold file descriptors past
        1024), made once per connection (only the thread with the reader's role calls this)."""
        if self._polled is None or self._polled[0] is not sock:
            poll = select.poll()
            poll.register(sock, select.POLLIN)
            self._polled = (sock, poll)
        return self._polled[1]

    def _parse(self) -> tuple[list[tuple[int, Msg]], int]:
        """Complete messages and PONGs in the buffer (caller holds `_io`); PINGs are answered."""
        buf, msgs, pongs, at = self._buf, [], 0, 0
        while True:
            end = buf.find(b"\r\n", at)
            if end < 0:
                if len(buf) - at > _MAX_LINE:
                    raise StreamUnavailable(f"NATS at {redacted_url(self.url)} sent a protocol line longer than the "
                                            "limit")
                break
            line = bytes(buf[at:end])
            op = line[:4].upper()
            if op in (b"MSG ", b"HMSG"):
                parts = line.split()
                hmsg = op == b"HMSG"
                total = int(parts[-1])
                hlen = int(parts[-2]) if hmsg else 0
                reply = parts[3].decode() if len(parts) == (6 if hmsg else 5) else ""
                start = end + 2
                if len(buf) < start + total + 2:
                    break  # the rest of it has not arrived
                hdrs = _parse_headers(bytes(buf[start:start + hlen])) if hmsg else {}
                body = bytes(buf[start + hlen:start + total])
                msgs.append((int(parts[2]), Msg(parts[1].decode(), reply, hdrs, body)))
                at = start + total + 2
                continue
            if op == b"PING":
                self._send(b"PONG\r\n")
            elif op == b"PONG":
                pongs += 1
            elif op == b"-ERR":
                self.errors.append(line[4:].strip().decode(errors="replace"))
                self.error_count += 1
            elif op not in (b"+OK", b"INFO"):
                raise StreamUnavailable(f"NATS at {redacted_url(self.url)} sent a line outside the protocol: "
                                        f"{line[:40]!r}")
            at = end + 2
        del buf[:at]
        return msgs, pongs

    def close(self) -> None:
        with self._io:
            self._closed = True
            self._drop()
        with self._cond:
            self._queues.clear()
            self._cond.notify_all()

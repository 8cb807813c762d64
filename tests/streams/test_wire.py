"""The handoff's blocking NATS connection (`streams.wire.Wire`) and the announcer on it: the protocol
against a scripted server (PINGs answered, a refusal, a broken connection subscribed again), against
nats-server (headers and a message larger than one read, two threads on one wire), and announcements
sent again after a broken connection stored once."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.streams import StreamRefused, StreamUnavailable, stream_info
from kvpool.streams.announcer import Announcer
from kvpool.streams.wire import Wire

_INFO = b'INFO {"server_id":"scripted","max_payload":1048576,"headers":true}\r\n'


class Listening:
    """A loopback listener handing each connection to `take` on a thread of its own."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.take(conn)

    def take(self, conn: socket.socket) -> None:
        raise NotImplementedError


class Scripted(Listening):
    """A NATS server that says INFO, answers PING with PONG (or the first CONNECT with `refuse`), and
    keeps what each connection sent; the test writes to or closes a connection by its index."""

    def __init__(self, refuse: bytes | None = None, deny: bool = False) -> None:
        self.refuse, self.deny = refuse, deny
        self.refuse_pings = False  # set: PINGs go unanswered (a server about to drop the connection)
        self.conns: list[socket.socket] = []
        self.seen: list[bytearray] = []
        super().__init__()

    def take(self, conn: socket.socket) -> None:
        seen = bytearray()
        self.conns.append(conn)
        self.seen.append(seen)
        conn.sendall(_INFO)
        threading.Thread(target=self._serve, args=(conn, seen), daemon=True).start()

    def _serve(self, conn: socket.socket, seen: bytearray) -> None:
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            seen += data
            if self.deny and b"HPUB " in data:
                conn.sendall(b"-ERR 'Permissions Violation for Publish to \"x\"'\r\n")
            for _ in range(data.count(b"PING\r\n")):
                if not self.refuse_pings:
                    conn.sendall(self.refuse if self.refuse is not None and b"CONNECT" in seen else b"PONG\r\n")

    def wait_seen(self, conn: int, what: bytes, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not (len(self.seen) > conn and what in self.seen[conn]):
            assert time.monotonic() < deadline, f"connection {conn} never sent {what!r}: {self.seen}"
            time.sleep(0.01)

    def cut(self, conn: int) -> None:
        self.conns[conn].shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    s = Scripted()
    yield s
    s.close()


def test_a_ping_from_the_server_is_answered_while_a_reader_waits(scripted):
    wire = Wire(scripted.url, 2)
    sid = wire.subscribe("a.b")
    scripted.conns[0].sendall(b"PING\r\n")
    assert wire.next(sid, 0.5) is None
    scripted.wait_seen(0, b"PONG\r\n")
    wire.close()


def test_a_server_refusing_the_connect_is_a_refusal_not_a_hang():
    s = Scripted(refuse=b"-ERR 'Authorization Violation'\r\n")
    try:
        with pytest.raises(StreamRefused, match="Authorization Violation"):
            Wire(s.url, 2)
    finally:
        s.close()


def test_a_broken_connection_reconnects_and_subscribes_again(scripted):
    wire = Wire(scripted.url, 2)
    sid = wire.subscribe("a.b")
    scripted.cut(0)
    assert wire.next(sid, 0.3) is None  # the break is found; the next read connects again
    wire.next(sid, 0.3)
    scripted.wait_seen(1, f"SUB a.b {sid}\r\n".encode())
    assert wire.reconnects == 1
    head = b"NATS/1.0\r\nK: v\r\n\r\n"
    scripted.conns[1].sendall(f"HMSG a.b {sid} _INBOX.x {len(head)} {len(head) + 5}\r\n".encode() + head + b"hello\r\n")
    got = wire.next(sid, 2)
    assert got is not None and (got.data, got.reply, got.headers) == (b"hello", "_INBOX.x", {"K": "v"})
    wire.publish("x.y", b"lost")  # a PING sent just before the connection breaks is never answered ...
    scripted.refuse_pings = True
    with pytest.raises(StreamUnavailable):
        wire.flush()
    scripted.refuse_pings = False
    scripted.cut(1)
    wire.next(sid, 0.3)
    wire.next(sid, 0.3)
    scripted.wait_seen(2, f"SUB a.b {sid}\r\n".encode())
    wire.flush()  # ... and does not hold up the next connection's flushes
    wire.close()


def test_an_announcement_the_server_denies_is_refused_at_once_not_after_the_timeout():
    s = Scripted(deny=True)
    wire = Wire(s.url, 30)
    try:
        ann = Announcer(wire, "s", lambda seq, subj, keys, nbytes: None, lambda keys: None)
        ann.send("kvpool.stream.s.req.r", b"{}", {}, ["k"])
        t = time.monotonic()
        with pytest.raises(StreamRefused, match="may not"):
            ann.flush()
        assert time.monotonic() - t < 10  # (the timeout is 30 s)
    finally:
        wire.close()
        s.close()


def test_a_line_outside_the_protocol_drops_the_connection_for_a_fresh_one(scripted):
    wire = Wire(scripted.url, 2)
    sid = wire.subscribe("a.b")
    scripted.conns[0].sendall(b"BOGUS line\r\n")
    wire.next(sid, 0.3)
    wire.next(sid, 0.3)
    scripted.wait_seen(1, f"SUB a.b {sid}\r\n".encode())
    wire.close()


def test_headers_status_and_a_message_larger_than_one_read(nats):
    pub, sub = Wire(nats.url), Wire(nats.url)
    sid = sub.subscribe("x.y")
    big = bytes(range(256)) * 3500  # ~900 KB: several reads
    pub.publish("x.y", big, {"Kvpool-Kind": "kv"}, reply="r.1")
    pub.publish("x.y", b"")
    got = sub.next(sid, 5)
    assert got is not None and got.data == big and got.headers == {"Kvpool-Kind": "kv"} and got.reply == "r.1"
    empty = sub.next(sid, 5)
    assert empty is not None and empty.data == b"" and empty.headers == {}
    inbox = pub.subscribe("_INBOX.t.*")  # a request nobody serves: the server's 503 status comes back
    pub.publish("no.one.listens", b"?", {"A": "b"}, reply="_INBOX.t.1")
    status = pub.next(inbox, 5)
    assert status is not None and status.headers.get("Status") == "503"
    pub.close()
    sub.close()


def test_two_threads_on_one_wire_each_get_their_own_messages_without_waiting_for_the_other(nats):
    pub, wire = Wire(nats.url), Wire(nats.url)
    quiet, busy = wire.subscribe("quiet"), wire.subscribe("busy")
    waited: list[object] = []
    reader = threading.Thread(target=lambda: waited.append(wire.next(quiet, 5)))
    reader.start()
    time.sleep(0.2)  # the thread reads the socket, waiting for a message that does not come yet
    pub.publish("busy", b"mine")
    t = time.monotonic()
    got = wire.next(busy, 5)
    assert got is not None and got.data == b"mine" and time.monotonic() - t < 2.5  # not after the reader's 5 s
    pub.publish("quiet", b"yours")
    reader.join(5)
    assert [m.data for m in waited] == [b"yours"]  # type: ignore[attr-defined]
    pub.close()
    wire.close()


class Cuttable(Listening):
    """A TCP relay to `target` whose connections the test can cut (both ways, at once); while `deaf` is
    set, what the server sends is dropped (an acknowledgement lost with the connection)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit("//", 1)[1].rsplit(":", 1)
        self.target = (host, int(port))
        self.socks: list[socket.socket] = []
        self.deaf = threading.Event()
        super().__init__()

    def take(self, client: socket.socket) -> None:
        server = socket.create_connection(self.target)
        self.socks += [client, server]
        for a, b, deaf in ((client, server, None), (server, client, self.deaf)):
            threading.Thread(target=self._pump, args=(a, b, deaf), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, deaf: threading.Event | None) -> None:
        try:
            while data := src.recv(65536):
                if deaf is None or not deaf.is_set():
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.deaf.clear()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.socks.clear()

    def close(self) -> None:
        self.cut()
        self._listener.close()


def test_announcements_unacknowledged_when_the_connection_broke_are_sent_again_and_stored_once(nats, make_stream):
    s = make_stream()
    relay = Cuttable(nats.url)
    wire = Wire(relay.url, 5)
    stored: list[tuple[int, str]] = []
    ann = Announcer(wire, s, lambda seq, subj, keys, nbytes: stored.append((seq, subj)), lambda keys: None)
    relay.deaf.set()
    ann.send(f"kvpool.stream.{s}.req.r", json.dumps({"n": 1}).encode(), {}, ["k1"])
    deadline = time.monotonic() + 5
    while stream_info(nats.url, s)["messages"] < 1:  # stored, its acknowledgement in flight or lost
        assert time.monotonic() < deadline
        time.sleep(0.01)
    relay.cut()
    ann.flush()  # finds the break, connects again, sends it again: JetStream knows its message id
    assert stored == [(1, f"kvpool.stream.{s}.req.r")] and wire.reconnects >= 1
    assert stream_info(nats.url, s)["messages"] == 1
    ann.close()
    relay.close()


def test_a_wire_whose_socket_is_past_file_descriptor_1024_still_reads(nats):
    """An engine process may hold a thousand files open: the wire waits with poll(), not select()."""
    hold = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        pub, sub = Wire(nats.url), Wire(nats.url)
        try:
            assert sub._sock is not None and sub._sock.fileno() > 1024
            sid = sub.subscribe("far")
            pub.publish("far", b"away")
            got = sub.next(sid, 5)
            assert got is not None and got.data == b"away"
        finally:
            pub.close()
            sub.close()
    finally:
        for fd in hold:
            os.close(fd)

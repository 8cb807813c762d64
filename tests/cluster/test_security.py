"""Tokens, bind addresses, and malformed input from the network."""
from __future__ import annotations

import contextlib
import socket
import struct
import time

import pytest

from kvpool.core import AuthError, ConfigError, KVPoolError
from kvpool.core import protocol as P
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import InvalidArgument
from kvpool.core.server import Worker


def _worker(tmp_path, **kw) -> Worker:
    return Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), **kw),
                  CacheConfig(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False))


def test_non_loopback_bind_needs_a_token(tmp_path):
    with pytest.raises(ConfigError, match="needs a token"):
        _worker(tmp_path, host="127.0.0.2").cache  # noqa: B018
    w = _worker(tmp_path, host="127.0.0.2", token="s3cret").start()
    try:
        with pytest.raises(KVPoolError, match="requires a token"):
            PoolClient(mode="local", worker=w.address).get("a")
        with pytest.raises(AuthError):
            PoolClient(mode="local", worker=w.address, token="wrong").get("a")
        with PoolClient(mode="local", worker=w.address, token="s3cret") as c:
            c.put("a", b"ok")
            assert c.get("a") == b"ok"
        # no data op before authentication, even from a hand-written client
        with socket.create_connection(("127.0.0.2", w.port), timeout=5) as s:
            P.send_frame(s, P.Op.GET, P.pack_batch([b"a"]))
            reply = P.recv_frame(s)
            assert reply.status == P.Status.AUTH_REQUIRED
    finally:
        w.stop()


def test_a_connection_that_does_not_authenticate_is_closed(tmp_path):
    w = _worker(tmp_path, host="127.0.0.2", token="s3cret", auth_timeout_s=0.5).start()
    try:
        with socket.create_connection(("127.0.0.2", w.port), timeout=5) as idle:
            assert idle.recv(1) == b""  # closed by the worker after its authentication window
        with PoolClient(mode="local", worker=w.address, token="s3cret") as c:
            c.put("a", b"ok")
            time.sleep(1.0)  # authenticated: no window any more
            assert c.get("a") == b"ok"
    finally:
        w.stop()


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _read_until_closed(s: socket.socket) -> None:
    """Read until the worker closes the connection (it may answer first, or reset it); TimeoutError if
    it keeps it open for the socket's 5 s."""
    with contextlib.suppress(ConnectionResetError):
        while s.recv(65536):
            pass


GARBAGE = [
    b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40,  # bad magic
    struct.pack("<4sBBHIIQII", b"KVPW", 9, 4, 0, 1, 0, 0, 0, 0),  # bad version
    struct.pack("<4sBBHIIQII", b"KVPW", 1, 4, 0, 1, 1 << 30, 0, 0, 0),  # huge meta length
    struct.pack("<4sBBHIIQII", b"KVPW", 1, 99, 0, 1, 0, 0, 46947589, 0),  # unknown op
    P.header(P.Op.PUT, 0, 1, P.pack_batch([b"k"], __import__("numpy").array([10], "<i8"),
                                          __import__("numpy").array([0], "<u8"),
                                          __import__("numpy").array([1], "<u8")), 10),  # truncated put
    P.header(P.Op.GET, 0, 1, b"\x05\x00\x00\x00", 0) + b"\x05\x00\x00\x00",  # truncated batch
]


def test_malformed_frames_close_only_that_connection(tmp_path):
    w = _worker(tmp_path).start()
    try:
        with PoolClient(mode="local", worker=w.address) as good:
            good.put("keep", b"value")
            for junk in GARBAGE:
                with _raw(w.port) as s:
                    s.sendall(junk)
                    with contextlib.suppress(OSError):  # the worker may have closed it already
                        s.shutdown(socket.SHUT_WR)
                    _read_until_closed(s)
                assert good.get("keep") == b"value"
            # a connection that dies in the middle of a PUT leaves nothing half-written
            s = _raw(w.port)
            import numpy as np

            meta = P.pack_batch([b"half"], np.array([1 << 20], "<i8"), np.array([0], "<u8"), np.array([1], "<u8"))
            s.sendall(P.header(P.Op.PUT, 0, 1, meta, 1 << 20) + meta + b"y" * 1000)
            s.close()
            assert good.batch_exists(["half", "keep"]) == [False, True]
            assert w.metrics.protocol_errors._value.get() >= 4
    finally:
        w.stop()
    assert w.cache.arena.used_bytes >= 0


def test_same_node_ops_are_refused_over_tcp(tmp_path):
    w = _worker(tmp_path, no_auth=True).start()  # an authenticated peer's view (tests/security: without)
    try:
        import numpy as np

        with _raw(w.port) as s:
            P.send_frame(s, P.Op.ALLOC, P.pack_batch([b"k"], np.array([100], "<i8")))
            assert s.recv(100) == b""  # closed
    finally:
        w.stop()


def _leases(w: Worker) -> int:
    return w.cache.stats().dram_leases


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_peer_that_stalls_mid_request_is_dropped_and_its_leases_freed(tmp_path):
    w = _worker(tmp_path, io_timeout_s=0.5, no_auth=True).start()  # raw peers that need no token
    try:
        keys = [f"b{i}".encode() for i in range(24)]
        with PoolClient(mode="local", worker=w.address) as c:
            c.batch_put(keys, [bytes([i]) * (1 << 20) for i in range(24)])
            # a GET whose reply is never read: the worker cannot send 24 MiB into the buffers
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect(("127.0.0.1", w.port))
            P.send_frame(reader, P.Op.GET, P.pack_batch(keys))
            assert _wait(lambda: _leases(w) > 0, 2.0) or True  # it may already be blocked in send
            assert _wait(lambda: _leases(w) == 0), "a reader that stopped reading still holds leases"
            # a PUT that stops sending its data: dropped, its slot given back
            with _raw(w.port) as writer:
                meta = P.pack_batch([b"stall"], __import__("numpy").array([1 << 20], "<i8"),
                                    __import__("numpy").array([0], "<u8"), __import__("numpy").array([1], "<u8"))
                writer.sendall(P.header(P.Op.PUT, 0, 1, meta, 1 << 20) + meta + b"x" * 1000)
                writer.settimeout(5)
                assert writer.recv(1) == b""  # closed by the worker
            assert c.batch_exists(["stall"]) == [False]
            with pytest.raises(InvalidArgument):
                c.batch_exists("stall")  # one key, not a list of one-character keys
            assert c.exists("stall") is False
            time.sleep(1.0)  # an idle connection outlives io_timeout_s
            assert c.get("b3") == bytes([3]) * (1 << 20)
            reader.close()
    finally:
        w.stop()


def test_connections_beyond_the_limit_are_closed_not_served(tmp_path):
    w = _worker(tmp_path, max_connections=2).start()
    try:
        with PoolClient(mode="local", worker=w.address) as a, PoolClient(mode="local", worker=w.address) as b:
            a.put("k", b"v")
            assert b.get("k") == b"v"
            with _raw(w.port) as third:
                assert third.recv(1) == b""  # closed at once
            assert a.get("k") == b"v"  # the served ones are unaffected
        assert _wait(lambda: len(w._conns) == 0)
        with PoolClient(mode="local", worker=w.address) as c:  # room again
            assert c.get("k") == b"v"
    finally:
        w.stop()

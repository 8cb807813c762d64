"""Adversarial checks of a worker's TCP port before authentication: what an attacker who reaches the
port (any local process, loopback included) can do without the token.

The promise under test (README, "Workers bind 127.0.0.1 ..."): at most `max_unauthenticated`
connections wait to authenticate, a new one displaces the oldest, "so a client with the token always
gets in"; bad input closes that connection only, never the worker."""
from __future__ import annotations

import logging
import socket
import struct
import time
from pathlib import Path

import pytest

from kvpool.core import protocol as P
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.server import Worker
from kvpool.core.sparse_log import SparseLog

SMALL = {"dram_bytes": 32 << 20, "dram_slab_size": 1 << 20, "prefault": False}
TOKEN = "the-pool-token-" + "x" * 40


def _worker(tmp_path: Path, **kw: object) -> Worker:
    return Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), **kw),  # type: ignore[arg-type]
                  CacheConfig(**SMALL))  # type: ignore[arg-type]


def _bad_auth(port: int) -> socket.socket:
    """A connection that sends HELLO and an AUTH with a wrong proof back to back, and stays open."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    auth = P.pack_json({"nonce": "00" * 32, "proof": "11" * 32})
    s.sendall(P.header(P.Op.HELLO, 0, 1, b"", 0) + P.header(P.Op.AUTH, 0, 2, auth, 0) + auth)
    return s


def test_strangers_with_wrong_proofs_cannot_lock_the_token_holder_out(tmp_path: Path) -> None:
    """Connections whose AUTH failed sleep out the throttle's delay (up to 2 s) in their thread while
    still counted against `max_connections`; displacement (max_unauthenticated) marks them closing but
    cannot wake a sleeping thread, so a stranger opening a few connections a second that each fail
    AUTH fills `max_connections` and the token holder is refused. (At the defaults, 1024 and 64, that
    takes ~512 connections a second, from any address that reaches the port.)"""
    w = _worker(tmp_path, token=TOKEN, max_connections=24, max_unauthenticated=4).start()
    held: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # ~40 connections a second: far below what one process can do
            held.append(_bad_auth(w.port))
            time.sleep(0.025)
        with PoolClient(mode="local", worker=w.address, token=TOKEN, timeout_s=5) as c:
            c.put("k", b"v")  # the token holder gets in
            assert c.get("k") == b"v"
    finally:
        for s in held:
            s.close()
        w.stop()


def test_preauth_frames_are_bounded_and_refused_cleanly(tmp_path: Path) -> None:
    """Before authentication: metadata past 4 KiB, data on any op, any op but HELLO/AUTH, AUTH without
    HELLO, a second AUTH: each closes that connection only (no reply from a worker that was told
    nothing), the worker serves on and has read no data of a frame it refused."""
    w = _worker(tmp_path, token=TOKEN).start()
    try:
        def header(op: int, meta_len: int, data_len: int, crc: int = 0) -> bytes:
            return struct.pack("<4sBBHIIQII", P.MAGIC, P.VERSION, op, 0, 1, meta_len, data_len, crc, 0)

        cases = [
            header(P.Op.HELLO, 4097, 0),           # metadata past the pre-auth limit
            header(P.Op.HELLO, 0, 1 << 30),        # data on HELLO
            header(P.Op.PUT, 0, 8 << 30),          # a data op before AUTH (8 GiB it never reads)
            header(P.Op.CLEAR, 0, 0),
            header(P.Op.CHANGES, 0, 0),
            header(P.Op.AUTH, 2, 0, 0) + b"{}",    # AUTH with no HELLO first (and a bad checksum)
        ]
        for raw in cases:
            with socket.create_connection(("127.0.0.1", w.port), timeout=5) as s:
                s.sendall(raw)
                s.settimeout(5)
                got = b""
                try:
                    while chunk := s.recv(65536):
                        got += chunk
                except ConnectionResetError:
                    pass
                # at most an AUTH_REQUIRED/AUTH_FAILED reply; never the worker's description
                assert b"worker_id" not in got and b"arena" not in got, raw[:8]
        with PoolClient(mode="local", worker=w.address, token=TOKEN) as c:
            c.put("k", b"v")
            assert c.get("k") == b"v"
        # the pre-auth HELLO says only that a token is wanted
        with socket.create_connection(("127.0.0.1", w.port), timeout=5) as s:
            P.send_frame(s, P.Op.HELLO, P.pack_json({"holder": 1}))
            assert set(P.unpack_json(P.recv_frame(s).meta)) == {"auth", "nonce"}
    finally:
        w.stop()


def test_a_crowd_of_shut_strangers_is_one_warning_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """What the worker logs of the connections it shuts (displaced strangers, late authentications): one
    warning, then debug lines counted into the next warning, so an attacker cannot flood the log."""
    sparse = SparseLog(logging.getLogger("kvpool.test.sparse"), every_s=0.2)
    with caplog.at_level(logging.WARNING, logger="kvpool.test.sparse"):
        for i in range(50):
            sparse.log("closed a tcp connection: %s", f"displaced {i}")
        time.sleep(0.25)
        sparse.log("closed a tcp connection: %s", "displaced again")
    assert [r.getMessage() for r in caplog.records] == [
        "closed a tcp connection: displaced 0",
        "closed a tcp connection: displaced again (and 49 more like it since the last such warning, at debug level)"]

"""Deadlines that span system calls: a stranger cannot stay unauthenticated by keeping busy, strangers
cannot crowd out token holders, a request that trickles in or whose reply is never read is cut off
after io_timeout_s from its first byte, and what it held is freed."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core.client import PoolClient

from faulthelp import poll

TOKEN = "t0ken"
AUTH_S, IO_S = 1.5, 1.5
SLACK_S = 2.0  # watchdog period, thread wake-up and a busy 2-core machine


def _closed(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes `sock` within `timeout` seconds (reading and dropping what it sends)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not sock.recv(1 << 16):
                return True
        except TimeoutError:
            continue
        except ConnectionError:
            return True
    return False


@pytest.fixture
def guarded(spawn):
    return spawn(extra=["--token", TOKEN], env={"KVPOOL_AUTH_TIMEOUT_S": str(AUTH_S), "KVPOOL_IO_TIMEOUT_S": str(IO_S),
                                                 "KVPOOL_MAX_UNAUTHENTICATED": "8", "KVPOOL_MAX_CONNECTIONS": "16"})


def test_a_busy_stranger_is_still_cut_off_at_auth_timeout(guarded) -> None:
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < AUTH_S + SLACK_S + 3:
            try:
                P.send_frame(s, P.Op.HELLO)  # a HELLO every 0.3 s kept each receive within its timeout
                P.recv_frame(s)
            except (ConnectionError, OSError):
                closed = True
                break
            time.sleep(0.3)
        assert closed and time.monotonic() - t0 <= AUTH_S + SLACK_S


def test_strangers_cannot_crowd_out_token_holders(guarded) -> None:
    strangers = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(20)]
    try:
        for _ in range(5):
            with PoolClient(mode="local", worker=guarded.address, token=TOKEN, timeout_s=5) as c:
                c.put("k", b"v")
                assert c.get("k") == b"v"
    finally:
        for s in strangers:
            s.close()


def test_a_big_frame_before_authentication_is_refused(guarded) -> None:
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        P.send_frame(s, P.Op.HELLO, b"x" * (1 << 20))
        assert _closed(s, 5)
    with PoolClient(mode="local", worker=guarded.address, token=TOKEN) as c:
        assert c.batch_exists(["k"]) == [False]  # the worker is fine


def test_a_trickled_put_is_cut_off_and_its_slot_freed(spawn) -> None:
    w = spawn(dram_bytes="32MiB", env={"KVPOOL_IO_TIMEOUT_S": str(IO_S), "KVPOOL_DRAM_SLAB_SIZE": "8MiB",
                                        "KVPOOL_PREFAULT": "0"})
    size = 8 << 20
    with socket.create_connection(("127.0.0.1", w.port)) as s:
        meta = P.pack_batch([b"slow"], np.array([size], "<i8"), np.array([0], "<u8"), np.array([1], "<u8"))
        s.sendall(P.header(P.Op.PUT, 0, 0, meta, size) + meta)
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < IO_S + SLACK_S + 3:  # one byte every 0.2 s: each send is quick
            try:
                s.sendall(b"x")
            except OSError:
                closed = True
                break
            time.sleep(0.2)
        assert closed and time.monotonic() - t0 <= IO_S + SLACK_S
    with PoolClient(mode="local", worker=w.address) as c:  # its reserved 8 MiB slot is given back
        assert poll(lambda: c.stats().total.dram_bytes == 0, 5)


def test_a_reply_nobody_reads_is_cut_off(spawn) -> None:
    w = spawn(dram_bytes="64MiB", env={"KVPOOL_IO_TIMEOUT_S": str(IO_S), "KVPOOL_DRAM_SLAB_SIZE": "16MiB"})
    with PoolClient(mode="local", worker=w.address) as c:
        c.batch_put([f"big{i}" for i in range(3)], [bytes(16 << 20)] * 3)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", w.port))
        P.send_frame(s, P.Op.GET, P.pack_batch([f"big{i}".encode() for i in range(3)]))
        t0 = time.monotonic()
        time.sleep(IO_S + SLACK_S)  # never read the 48 MiB reply
        s.settimeout(0.1)
        drained = 0
        try:
            while chunk := s.recv(1 << 20):
                drained += len(chunk)
        except (TimeoutError, ConnectionError):
            pass
        assert drained < 48 << 20, "the whole reply arrived: the worker waited for a reader that never read"
        assert time.monotonic() - t0 <= IO_S + 2 * SLACK_S
    with PoolClient(mode="local", worker=w.address) as c:  # its leases are gone: the blocks can be removed
        assert c.batch_remove([f"big{i}" for i in range(3)]) == [True] * 3


def test_a_stalled_same_node_writer_holds_at_most_its_share_of_the_arena(spawn) -> None:
    """ALLOC without COMMIT, then silence (a paused client): it may not reserve the whole arena."""
    w = spawn(dram_bytes="64MiB", env={"KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "0"})
    mib = 1 << 20
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(w.unix_path)
        keys = [f"hog{i}".encode() for i in range(64)]
        P.send_frame(s, P.Op.ALLOC, P.pack_batch(keys, np.full(64, mib, "<i8")))
        reply = P.recv_frame(s)
        held = int((np.frombuffer(reply.meta, "<i8") >= 0).sum())
        assert 0 < held <= 8, f"one connection reserved {held} MiB of a 64 MiB arena"
        with PoolClient(mode="local", worker=w.unix_path) as c:  # others still have room, in big batches too
            names = [f"b{i}" for i in range(40)]
            c.batch_put(names, [bytes([i]) * mib for i in range(40)])
            assert c.get("b39") == bytes([39]) * mib

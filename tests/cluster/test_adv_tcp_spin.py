"""Adversarial checks of clear-text TCP clients spinning for their worker's answers (3055f4b:
`reply_spin.spinning`, called from `Connection._connect` after `socket.create_connection`): the re-wrapped
socket's options and timeout, descriptors on the ways the wrap can fail, TCP gets into the caller's
buffers (scatter receives, large blocks), a cluster with R=2 over TCP
and an owner stopped mid-run, a fork after connecting, and a worker's catch-up over TCP (never spins).
A stopped worker over TCP (time and CPU): tests/core/test_adv_reply_spin.py, with the Unix socket's.

Two failed at 3055f4b, fixed since:
- test_a_bad_spin_setting_over_tcp_leaves_no_connection_open: `reply_spin.spinning` reads
  KVPOOL_SPIN_US only after `create_connection` (core/connection.py `_connect`), and its ConfigError is
  no OSError: the connected socket is never closed (open for as long as the error's traceback lives: a
  future's, a log record's), and the worker holds a connection that never says HELLO.
- test_an_interrupt_while_the_socket_is_rewrapped_leaks_no_descriptor: `spinning` detaches the
  descriptor and hands it to `SpinSocket(...)`; an exception in between (a signal handler's
  KeyboardInterrupt) leaves a descriptor that no object owns: open for the process's life.
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np
import pytest
from spinhelp import counting_spins, random_blocks

from kvpool.core import reply_spin
from kvpool.core.cache import TieredCache
from kvpool.core.catch_up import catch_up
from kvpool.core.client import PoolClient
from kvpool.core.errors import ConfigError
from kvpool.core.procs import WorkerProcess
from kvpool.core.records import WorkerInfo
from kvpool.core.server import Worker
from kvpool.core.transport import connect
from kvpool.core.versions import CLOCK_SKEW_MS

from sigstop import freeze

native = pytest.importorskip("kvpool.core._native")


# ----- helpers ---------------------------------------------------------------------------------------

def _socket_fds() -> set[int]:
    """This process's descriptors that are sockets."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.add(int(name))
        except OSError:
            pass
    return out


def _peer_port(fd: int) -> int | None:
    """The peer port of TCP socket `fd` (None: not a connected TCP socket)."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return int(s.getpeername()[1]) if s.family == socket.AF_INET else None
    except OSError:
        return None
    finally:
        s.close()






# ----- the re-wrapped socket -------------------------------------------------------------------------

def test_the_rewrapped_tcp_socket_keeps_nodelay_its_timeout_and_its_peer(worker: Worker,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    before = _socket_fds()
    t = connect(worker.address, worker.token, 2.5)
    try:
        t.batch_put([b"opt/a"], [b"x" * 1000])
        s = t._sock
        assert isinstance(s, reply_spin.SpinSocket)
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert s.gettimeout() == 2.5 and not os.get_blocking(s.fileno())  # timeout mode, as before the wrap
        assert s.family == socket.AF_INET and s.type == socket.SOCK_STREAM
        assert s.getpeername()[1] == int(worker.address.rpartition(":")[2])
        assert s.spin.spin_us == reply_spin.SPIN_US
        # one descriptor for the connection (the wrap made no second one), none left after close
        mine = [fd for fd in _socket_fds() - before if _peer_port(fd) == s.getpeername()[1]]
        assert mine == [s.fileno()]
    finally:
        t.close()
    assert not [fd for fd in _socket_fds() - before if _peer_port(fd) == int(worker.address.rpartition(":")[2])]


def test_spin_zero_keeps_the_plain_tcp_socket(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_SPIN_US", "0")
    seen = counting_spins(monkeypatch)
    t = connect(worker.address, worker.token, 5.0)
    try:
        assert t.batch_exists([b"k"]) == [False]
        assert type(t._sock) is socket.socket
        assert t._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        t.close()
    assert seen == []


def test_a_bad_spin_setting_over_tcp_leaves_no_connection_open(spawn: Callable[..., WorkerProcess],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad KVPOOL_SPIN_US is the caller's ConfigError (as over a Unix socket), and, as there, nothing
    is left open: the Unix path raises before it makes a socket. Over TCP the socket was connected first
    and is not closed on the way out: it stays open while the error (its traceback) is held."""
    w = spawn()
    monkeypatch.setenv("KVPOOL_SPIN_US", "fast")
    port = int(w.address.rpartition(":")[2])
    t = connect(w.address, None, 5.0)
    err: ConfigError | None = None
    try:
        t.batch_exists([b"k"])
    except ConfigError as e:
        err = e  # held, as a future or a caller keeps it
    assert err is not None and "KVPOOL_SPIN_US" in str(err)
    assert t._sock is None
    still_open = [fd for fd in _socket_fds() if _peer_port(fd) == port]
    with warnings.catch_warnings():  # (the socket's ResourceWarning as it goes: the failure below says it)
        warnings.simplefilter("ignore", ResourceWarning)
        err = None  # (dropped here, not in a later test)
        gc.collect()
    t.close()
    assert still_open == [], f"a connection to the worker left open by the failed connect: fds {still_open}"


def test_an_interrupt_while_the_socket_is_rewrapped_leaks_no_descriptor(spawn: Callable[..., WorkerProcess],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception raised as `SpinSocket.__init__` begins (what a signal handler's KeyboardInterrupt does
    there; injected by a trace function, nothing replaced) fails the call. The descriptor `sock.detach()`
    gave up belongs to no object then: nothing ever closes it, not even once the error is gone."""
    w = spawn()
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    port = int(w.address.rpartition(":")[2])
    t = connect(w.address, None, 5.0)
    init = reply_spin.SpinSocket.__init__.__code__

    def interrupt(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and frame.f_code is init:
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    leaked: list[int] = []
    try:
        sys.settrace(interrupt)
        try:
            with pytest.raises(KeyboardInterrupt):
                t.batch_exists([b"k"])
        finally:
            sys.settrace(None)
        gc.collect()
        leaked = [fd for fd in _socket_fds() if _peer_port(fd) == port]
        assert leaked == [], f"descriptors {leaked} to the worker owned by nothing after an interrupted connect"
        assert t.batch_exists([b"k"]) == [False]  # the next call connects afresh
    finally:
        t.close()
        for fd in leaked:  # (ours to close: no object owns them)
            os.close(fd)


# ----- TCP gets into the caller's buffers ------------------------------------------------------------

def test_tcp_gets_of_large_and_many_small_blocks_land_whole_while_spinning(worker: Worker,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Small blocks (one scatter receive for many), blocks of several MiB (a reply far larger than the
    socket's buffers), misses among them, and a put pipelined over several frames: bytes exact, the
    connection in step after each, and the spin asked on this connection's descriptor only."""
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    seen = counting_spins(monkeypatch)
    small = random_blocks(64, 4 << 10, 1)
    large = random_blocks(3, 3 << 20, 2)
    t = connect(worker.address, worker.token, 5.0)
    try:
        skeys = [f"tcp/s/{i}".encode() for i in range(len(small))]
        lkeys = [f"tcp/l/{i}".encode() for i in range(len(large))]
        t.batch_put(skeys, small)
        t.batch_put(lkeys, large)
        keys = [*skeys[:20], b"tcp/absent", *lkeys, *skeys[20:]]
        outs = [np.zeros(b.nbytes if i != 20 else 16, dtype=np.uint8)
                for i, b in enumerate([*small[:20], np.zeros(16, np.uint8), *large, *small[20:]])]
        sizes = t.batch_get_into(keys, outs)
        want = [b.nbytes for b in small[:20]] + [-1] + [b.nbytes for b in large] + [b.nbytes for b in small[20:]]
        assert sizes == want
        for got, exp in zip([*outs[:20], *outs[21:]], [*small[:20], *large, *small[20:]]):
            assert np.array_equal(got, exp)
        assert t.batch_exists([skeys[0], b"tcp/absent"]) == [True, False]  # in step
        fd = t._sock.fileno()
        assert isinstance(t._sock, reply_spin.SpinSocket)
    finally:
        t.close()
    assert seen and {f for f, _ in seen} == {fd}
    assert all(us <= reply_spin.SPIN_US for _, us in seen)


# ----- a stopped worker ------------------------------------------------------------------------------

# ----- a cluster over TCP ------------------------------------------------------------------------------

def test_a_cluster_over_tcp_with_r2_serves_around_a_stopped_owner_in_time(nats, spawn,  # type: ignore[no-untyped-def]
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Three workers on other nodes (so TCP), R=2, spin of 10 ms: puts and gets in parallel threads to
    several workers; one owner SIGSTOPped: every call ends within its timeout (plus slack), reads come
    from the other replica with the right bytes, and the client's CPU stays low while it waits."""
    workers = [spawn(nats_url=nats.url, node_id=f"node{i}") for i in range(3)]
    monkeypatch.setenv("KVPOOL_SPIN_US", "10000")
    timeout_s = 1.0
    blocks = random_blocks(24, 32 << 10, 3)
    keys = [f"r2/{i}" for i in range(len(blocks))]
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, node_id="client", timeout_s=timeout_s) as c:
        assert c.wait_for_members(lambda m: len(m) == 3, 15), c.members()
        c.batch_put(keys, blocks)
        outs = [np.zeros_like(b) for b in blocks]
        assert c.batch_get_into(keys, outs) == [b.nbytes for b in blocks]
        conns = c.backend.fanout.connected()  # type: ignore[attr-defined]
        assert conns and all(isinstance(t._sock, reply_spin.SpinSocket) for t in conns.values())

        freeze(workers[1].proc.pid)
        try:
            cpu0, wall0 = time.process_time(), time.monotonic()
            for rnd in range(3):
                t0 = time.monotonic()
                outs = [np.zeros_like(b) for b in blocks]
                assert c.batch_get_into(keys, outs) == [b.nbytes for b in blocks]
                assert all(np.array_equal(a, b) for a, b in zip(outs, blocks))
                assert time.monotonic() - t0 < timeout_s + 1.0, rnd
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            assert cpu < 0.5 * wall + 0.2, (cpu, wall)
        finally:
            os.kill(workers[1].proc.pid, signal.SIGCONT)


# ----- fork after connect ----------------------------------------------------------------------------

def test_a_child_forked_after_a_tcp_connect_gets_its_own_answers(worker: Worker,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    blocks = random_blocks(4, 64 << 10, 4)
    keys = [f"fork/{i}".encode() for i in range(4)]
    t = connect(worker.address, worker.token, 5.0)
    try:
        t.batch_put(keys, blocks)
        parent_sock = t._sock
        assert isinstance(parent_sock, reply_spin.SpinSocket)
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own connection, spinning too
            ok = False
            try:
                for _ in range(20):
                    outs = [np.zeros_like(b) for b in blocks]
                    ok = (t.batch_get_into(keys, outs) == [b.nbytes for b in blocks]
                          and all(np.array_equal(a, b) for a, b in zip(outs, blocks))
                          and isinstance(t._sock, reply_spin.SpinSocket) and t._sock is not parent_sock)
                    if not ok:
                        break
                t.close()
            finally:
                os.write(wfd, b"1" if ok else b"0")
                os._exit(0)
        os.close(wfd)
        for _ in range(20):  # the parent, at the same time, on its own socket
            outs = [np.zeros_like(b) for b in blocks]
            assert t.batch_get_into(keys, outs) == [b.nbytes for b in blocks]
            assert all(np.array_equal(a, b) for a, b in zip(outs, blocks))
        _, status = os.waitpid(pid, 0)
        assert os.read(r, 1) == b"1" and status == 0
        os.close(r)
        assert t._sock is parent_sock
    finally:
        t.close()


# ----- a worker's own connections ----------------------------------------------------------------------

def test_a_workers_catch_up_over_tcp_neither_spins_nor_reads_the_setting(worker: Worker,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer on another node is asked over TCP (`catch_up._from_peer`): its connection is made with
    spin=False, which the TCP transport now passes on: no spin, and a bad KVPOOL_SPIN_US is not read."""
    seen = counting_spins(monkeypatch)
    info = WorkerInfo.from_dict(worker.info())
    since = int(time.time() * 1000) + CLOCK_SKEW_MS + 60_000
    for setting in (None, "fast"):
        if setting is None:
            monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
        else:
            monkeypatch.setenv("KVPOOL_SPIN_US", setting)
        cache = TieredCache(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False)
        try:
            assert catch_up(cache, {info.worker_id: info}, since, token=worker.token, node_id="another-node")
        finally:
            cache.close()
    assert seen == []
    t = connect(worker.address, worker.token, 5.0, spin=False)  # as catch-up makes it
    try:
        assert t.batch_exists([b"k"]) == [False]
        assert type(t._sock) is socket.socket
    finally:
        t.close()

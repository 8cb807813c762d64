"""Adversarial checks of a same-node client's spin for its worker's answers (kvpool.core.reply_spin,
`protocol.recv_frame`, `_native.spin_readable`): bytes, timeouts, CPU while a worker is stopped, closes
from other threads, forks, the worker side (which must never spin), and the setting's errors.

Tests that fail at 7c6bfb9 (each names its cause):
- test_spin_readable_error_names_the_spin_it_refused: native/spin.c's PyErr_Format has no %g.
- test_recv_frame_on_a_closed_spinning_socket_fails_as_on_a_plain_one: ReplySpin.wait passes fileno() -1.
- test_a_spin_never_outlasts_the_sockets_timeout[*]: the spin ignores the socket's timeout.
- test_a_workers_catch_up_does_not_spin, test_a_workers_catch_up_ignores_a_bad_spin_setting: the
  worker's catch-up from a same-node peer goes through `connect`, so through `unix_socket()`.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from spinhelp import counting_spins, random_blocks

from kvpool.core import protocol as P
from kvpool.core import reply_spin
from kvpool.core.cache import TieredCache
from kvpool.core.catch_up import catch_up
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import ConfigError, PoolTimeout, PoolUnavailable
from kvpool.core.procs import WorkerProcess
from kvpool.core.records import WorkerInfo
from kvpool.core.server import Worker
from kvpool.core.transport import connect
from kvpool.core.versions import CLOCK_SKEW_MS

from sigstop import freeze

native = pytest.importorskip("kvpool.core._native")


# ----- helpers ---------------------------------------------------------------------------------------

@pytest.fixture
def short_dir() -> Iterator[str]:
    """A short directory (a Unix socket path must stay under 108 bytes)."""
    d = tempfile.mkdtemp(prefix="kvspin", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def worker(short_dir: str) -> Iterator[Worker]:
    w = Worker(WorkerConfig(port=0, unix_path=os.path.join(short_dir, "w.sock")),
               CacheConfig(dram_bytes=64 << 20, dram_slab_size=4 << 20, prefault=False)).start()  # type: ignore[arg-type]
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture
def stoppable(short_dir: str) -> Iterator[WorkerProcess]:
    """A worker in its own process (SIGSTOP-able); continued and stopped at the end whatever happened."""
    w = WorkerProcess(os.path.join(short_dir, "p"), dram_bytes="64MiB").wait_ready()
    try:
        yield w
    finally:
        if w.proc.poll() is None:
            os.kill(w.proc.pid, signal.SIGCONT)
        w.stop()



def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))




# ----- native spin -----------------------------------------------------------------------------------

def test_spin_readable_error_names_the_spin_it_refused() -> None:
    """The refusal names the spin it refused (PyErr_Format has no %g: it printed "%g" literally)."""
    with pytest.raises(ValueError) as e:
        native.spin_readable(0, -1.5)
    assert "%g" not in str(e.value) and "-1.5" in str(e.value)


def test_spin_readable_returns_at_once_when_bytes_wait() -> None:
    """(The shipped test of this says "at once" but does not time it.)"""
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"x")
        t0 = time.perf_counter()
        assert native.spin_readable(a.fileno(), 1_000_000) is True
        assert time.perf_counter() - t0 < 0.1
        assert a.recv(4) == b"x"


def test_spin_readable_on_a_descriptor_closed_during_the_spin_returns() -> None:
    """A socket closed (shut down) from another thread mid-spin ends the spin (EOF), well before its end."""
    a, b = socket.socketpair()
    with a, b:
        threading.Timer(0.05, lambda: a.shutdown(socket.SHUT_RDWR)).start()
        t0 = time.perf_counter()
        assert native.spin_readable(a.fileno(), 1_000_000) is True
        assert time.perf_counter() - t0 < 0.5


# ----- ReplySpin against the socket it spins on ------------------------------------------------------

def test_recv_frame_on_a_closed_spinning_socket_fails_as_on_a_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed SpinSocket (fileno -1) is not spun on: its receive says OSError (EBADF), as a plain
    socket's does, the error `Connection._session` types as PoolUnavailable (the native spin's
    ValueError went to the caller untyped)."""
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    plain = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    plain.close()
    with pytest.raises(OSError):
        P.recv_frame(plain)
    spinning = reply_spin.unix_socket()
    assert isinstance(spinning, reply_spin.SpinSocket)
    spinning.close()
    with pytest.raises(OSError):
        P.recv_frame(spinning)


@pytest.mark.parametrize("timeout", [0.0, 0.001])
def test_a_spin_never_outlasts_the_sockets_timeout(monkeypatch: pytest.MonkeyPatch, timeout: float) -> None:
    """A spin lasts no longer than the socket's timeout (none at all for a non-blocking socket): a
    client whose timeout_s is under the spin gets its PoolTimeout after timeout_s, not spin + timeout_s."""
    monkeypatch.setenv("KVPOOL_SPIN_US", "10000")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    s = reply_spin.SpinSocket(fileno=a.detach(), spin_us=10_000)
    with s, b:
        s.settimeout(timeout)
        t0 = time.perf_counter()
        with pytest.raises((BlockingIOError, TimeoutError)):
            P.recv_frame(s)
        assert time.perf_counter() - t0 < timeout + 0.005


def test_a_connection_spins_again_once_answers_come_quickly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backoff after empty spins ends with the first spin that finds its answer (its count too)."""
    outcomes = iter([False] * 6 + [True] + [True] * 4)
    spun: list[int] = []
    monkeypatch.setattr(reply_spin, "spin_readable", lambda fd, us: (spun.append(fd), next(outcomes))[1])
    a, b = socket.socketpair()
    with a, b:
        spin = reply_spin.ReplySpin(100.0)
        waits = (1 + 1) + (1 + 3) + (1 + 7) + (1 + 15) + (1 + 31) + (1 + 63) + 1 + 4
        for _ in range(waits):
            spin.wait(a)
        assert len(spun) == 6 + 1 + 4  # after the hit, every wait spins again


# ----- a client and a real worker --------------------------------------------------------------------

def test_a_tcp_client_in_clear_text_spins_too(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    seen = counting_spins(monkeypatch)
    t = connect(worker.address, worker.token, 5.0)
    try:
        blocks = random_blocks(8, 16 << 10, 1)
        keys = [f"tcp/{i}".encode() for i in range(8)]
        t.batch_put(keys, blocks)
        out = [np.zeros(16 << 10, dtype=np.uint8) for _ in range(8)]
        assert t.batch_get_into(keys, out) == [16 << 10] * 8
        assert all(np.array_equal(x, y) for x, y in zip(out, blocks))
        assert isinstance(t._sock, reply_spin.SpinSocket) and t._sock.gettimeout() == 5.0
    finally:
        t.close()
    assert seen and any(seen)  # it asked, and answers came while it did


def test_only_the_clients_socket_spins_never_the_workers(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every spin (in this process, which also runs the worker) is on the client's own socket, across
    socket puts, arena puts (with their ask-ahead ALLOC), gets and leases; and the bytes come back whole."""
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    spun_on: list[Any] = []
    real_wait = reply_spin.ReplySpin.wait

    def wait(self: reply_spin.ReplySpin, sock: Any) -> None:
        spun_on.append(sock)
        real_wait(self, sock)

    monkeypatch.setattr(reply_spin.ReplySpin, "wait", wait)
    t = connect(worker.config.unix_path, None, 5.0)
    try:
        for size, n in ((1 << 10, 4), (16 << 10, 64), (256 << 10, 8)):
            for round_ in range(3):  # a run of one shape: the next put's slots are asked for ahead
                blocks = random_blocks(n, size, size + round_)
                keys = [f"s{size}/{round_}/{i}".encode() for i in range(n)]
                t.batch_put(keys, blocks)
                out = [np.zeros(size, dtype=np.uint8) for _ in range(n)]
                assert t.batch_get_into(keys, out) == [size] * n
                assert all(np.array_equal(x, y) for x, y in zip(out, blocks))
        assert t.batch_exists([b"s1024/0/0", b"nope"]) == [True, False]
        assert isinstance(t._sock, reply_spin.SpinSocket)
        assert spun_on and all(s is t._sock for s in spun_on)
    finally:
        t.close()


def test_a_bad_spin_setting_reaches_the_caller_typed(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    path = worker.config.unix_path
    for bad in ("fast", "-5", "1e9", "inf", "nan", " "):
        monkeypatch.setenv("KVPOOL_SPIN_US", bad)
        t = connect(path, None, 5.0)
        try:
            with pytest.raises(ConfigError, match="KVPOOL_SPIN_US"):
                t.batch_exists([b"k"])
        finally:
            t.close()
    monkeypatch.setenv("KVPOOL_SPIN_US", "0")  # never spins: a plain socket
    t = connect(path, None, 5.0)
    try:
        assert t.batch_exists([b"k"]) == [False]
        assert not isinstance(t._sock, reply_spin.SpinSocket)
    finally:
        t.close()


def test_a_workers_catch_up_does_not_spin(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker catching up from a same-node peer (core/catch_up.py) connects as a client does, but its
    receives do not spin: its CPU is its own clients'."""
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    seen = counting_spins(monkeypatch)
    cache = TieredCache(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False)
    try:
        info = WorkerInfo.from_dict(worker.info())
        since = int(time.time() * 1000) + CLOCK_SKEW_MS + 60_000  # (its log reaches back that far)
        assert catch_up(cache, {info.worker_id: info}, since, token=worker.token, node_id=worker.node_id)
    finally:
        cache.close()
    assert seen == []


def test_a_workers_catch_up_ignores_a_bad_spin_setting(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVPOOL_SPIN_US set wrong in a worker's environment (a node-wide setting meant for its clients):
    its catch-up does not read it. It did: the ConfigError of its first exchange was taken for an
    unreachable peer, and the worker dropped every block it kept."""
    monkeypatch.setenv("KVPOOL_SPIN_US", "fast")
    cache = TieredCache(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False)
    try:
        info = WorkerInfo.from_dict(worker.info())
        since = int(time.time() * 1000) + CLOCK_SKEW_MS + 60_000
        assert catch_up(cache, {info.worker_id: info}, since, token=worker.token, node_id=worker.node_id)
    finally:
        cache.close()


# ----- a stopped worker (SIGSTOP) --------------------------------------------------------------------

@pytest.mark.parametrize(("where", "timeout_s", "slack_s", "cpu_share"),
                         [("unix_path", 0.25, 0.15, 0.2), ("address", 0.3, 0.2, 0.25)])
def test_a_stopped_worker_times_out_in_time_and_costs_little_cpu(stoppable: WorkerProcess, where: str,
                                                                 timeout_s: float, slack_s: float, cpu_share: float,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With the longest spin (10 ms), over the Unix socket and over TCP, a call on a stopped worker is
    PoolTimeout within timeout_s (plus the spin, no more), calls again and again on it cost little CPU,
    and so do 8 threads sharing the client; it serves again once the worker runs again."""
    monkeypatch.setenv("KVPOOL_SPIN_US", "10000")
    t = connect(getattr(stoppable, where), None, timeout_s)
    try:
        assert t.batch_exists([b"k"]) == [False]
        assert isinstance(t._sock, reply_spin.SpinSocket)
        freeze(stoppable.proc.pid)
        cpu0, wall0 = time.process_time(), time.monotonic()
        for _ in range(4):
            t0 = time.monotonic()
            with pytest.raises(PoolTimeout):
                t.batch_exists([b"k"])
            assert time.monotonic() - t0 < timeout_s + slack_s
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert cpu < cpu_share * wall, (cpu, wall)

        errors: list[BaseException] = []

        def calls() -> None:
            for _ in range(2):
                try:
                    t.batch_get_into([b"k"], [bytearray(8)])
                except BaseException as e:
                    errors.append(e)

        cpu0, wall0 = time.process_time(), time.monotonic()
        threads = [threading.Thread(target=calls) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert not any(th.is_alive() for th in threads)
        assert len(errors) == 16 and all(isinstance(e, PoolTimeout) for e in errors), errors
        assert cpu < cpu_share * wall, (cpu, wall)

        os.kill(stoppable.proc.pid, signal.SIGCONT)
        assert t.batch_exists([b"k"]) == [False]  # and back once it runs again
    finally:
        t.close()


def test_a_close_from_another_thread_ends_a_call_waiting_on_a_stopped_worker(
        stoppable: WorkerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The call (spinning, then asleep in its receive) fails at once with PoolUnavailable, not after its
    timeout; its descriptor is not closed under it (so not reused by a socket opened meanwhile, whose
    bytes it must never read), and none is left open once it ends."""
    monkeypatch.setenv("KVPOOL_SPIN_US", "10000")
    before = _fds()
    t = connect(stoppable.unix_path, None, 10.0)
    assert t.batch_exists([b"k"]) == [False]
    freeze(stoppable.proc.pid)
    got: list[Any] = []

    def call() -> None:
        try:
            got.append(t.batch_exists([b"k"]))
        except BaseException as e:
            got.append(e)

    th = threading.Thread(target=call)
    th.start()
    time.sleep(0.005)  # (within the spin, most likely)
    t0 = time.monotonic()
    t.close()
    a, b = socket.socketpair()  # would take the number of a descriptor closed under the call
    with a, b:
        b.sendall(P.header(P.Op.EXISTS, 0, 1, b"\x01" + b"\x00" * 8, 0) + b"\x01" + b"\x00" * 8)
        th.join(5)
    assert not th.is_alive()
    assert time.monotonic() - t0 < 2.0
    assert len(got) == 1 and isinstance(got[0], PoolUnavailable) and not isinstance(got[0], PoolTimeout), got
    t.shut()
    assert _fds() - before == set()


# ----- fork ------------------------------------------------------------------------------------------

def test_a_forked_child_and_its_parent_each_get_their_own_answers(worker: Worker,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    t = connect(worker.config.unix_path, None, 5.0)
    try:
        parent = random_blocks(16, 16 << 10, 5)
        t.batch_put([f"p/{i}".encode() for i in range(16)], parent)
        assert isinstance(t._sock, reply_spin.SpinSocket)
        pid = os.fork()
        if pid == 0:  # the child: its own connection (the parent's socket let go), its own answers
            code = 1
            try:
                child = random_blocks(16, 16 << 10, 6)
                t.batch_put([f"c/{i}".encode() for i in range(16)], child)
                out = [np.zeros(16 << 10, dtype=np.uint8) for _ in range(16)]
                ok = t.batch_get_into([f"p/{i}".encode() for i in range(16)], out) == [16 << 10] * 16
                ok = ok and all(np.array_equal(x, y) for x, y in zip(out, parent))
                ok = ok and isinstance(t._sock, reply_spin.SpinSocket)
                code = 0 if ok else 2
            finally:
                os._exit(code)
        for _ in range(20):  # the parent keeps using its socket meanwhile
            out = [np.zeros(16 << 10, dtype=np.uint8) for _ in range(16)]
            assert t.batch_get_into([f"p/{i}".encode() for i in range(16)], out) == [16 << 10] * 16
            assert all(np.array_equal(x, y) for x, y in zip(out, parent))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        child = random_blocks(16, 16 << 10, 6)
        out = [np.zeros(16 << 10, dtype=np.uint8) for _ in range(16)]
        assert t.batch_get_into([f"c/{i}".encode() for i in range(16)], out) == [16 << 10] * 16
        assert all(np.array_equal(x, y) for x, y in zip(out, child))
    finally:
        t.close()


def test_many_threads_on_one_client_get_their_own_bytes(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    t = connect(worker.config.unix_path, None, 10.0)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for r in range(10):
                blocks = random_blocks(4, 8 << 10, 1000 * i + r)
                keys = [f"t{i}/{r}/{j}".encode() for j in range(4)]
                t.batch_put(keys, blocks)
                out = [np.zeros(8 << 10, dtype=np.uint8) for _ in range(4)]
                assert t.batch_get_into(keys, out) == [8 << 10] * 4
                assert all(np.array_equal(x, y) for x, y in zip(out, blocks))
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not any(th.is_alive() for th in threads)
        assert errors == []
    finally:
        t.close()


"""A same-node client's spin for its worker's answers (kvpool.core.reply_spin): the native ask that does
not sleep, the backoff of a connection whose spins find nothing, the setting, and a client that spins
getting the bytes it put."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.core import reply_spin
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import ConfigError
from kvpool.core.server import Worker
from kvpool.core.transport import connect

native = pytest.importorskip("kvpool.core._native")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_spin_readable_waits_out_its_spin_on_a_quiet_socket(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    t0 = time.perf_counter()
    assert native.spin_readable(a.fileno(), 20_000) is False
    assert time.perf_counter() - t0 >= 0.019


def test_spin_readable_sees_bytes_and_leaves_them_to_the_receive(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.sendall(b"answer")
    assert native.spin_readable(a.fileno(), 1_000_000) is True  # at once, not after a second
    assert a.recv(16) == b"answer"


def test_spin_readable_says_readable_once_the_peer_is_gone(pair: tuple[socket.socket, socket.socket]) -> None:
    """The close is the caller's receive's to report (ConnectionError there), not a spin to the end."""
    a, b = pair
    b.close()
    t0 = time.perf_counter()
    assert native.spin_readable(a.fileno(), 1_000_000) is True
    assert time.perf_counter() - t0 < 0.5
    assert a.recv(1) == b""


@pytest.mark.parametrize("args", [(-1, 10.0), (0, -1.0), (0, 2e6), (0, float("nan"))])
def test_spin_readable_refuses_a_bad_descriptor_or_spin(args: tuple[int, float]) -> None:
    with pytest.raises(ValueError, match="spin_readable"):
        native.spin_readable(*args)


def test_a_connection_whose_spins_find_nothing_spins_ever_less_often(
        monkeypatch: pytest.MonkeyPatch, pair: tuple[socket.socket, socket.socket]) -> None:
    answers: list[bool] = []
    calls: list[int] = []

    def fake(fd: int, spin_us: float) -> bool:
        calls.append(len(waits) - 1)  # the index of the wait that spun
        return answers.pop(0)

    monkeypatch.setattr(reply_spin, "spin_readable", fake)
    spin = reply_spin.ReplySpin(100.0)
    waits: list[int] = []
    answers += [False, False, False, True, True]
    for i in range(1 + 1 + 1 + 3 + 1 + 7 + 1 + 1):
        waits.append(i)
        spin.wait(pair[0])
    # a miss, one skipped; a miss, three skipped; a miss, seven skipped; a hit; a hit (no skip after it)
    assert calls == [0, 2, 6, 14, 15]

    answers += [False] * 20
    calls.clear()
    spin = reply_spin.ReplySpin(100.0)
    for i in range(sum(1 << n for n in range(reply_spin.BACKOFF + 2))):
        waits.append(i)
        spin.wait(pair[0])
    gaps = np.diff(calls).tolist()
    assert gaps[:reply_spin.BACKOFF] == [1 << n for n in range(1, reply_spin.BACKOFF + 1)]
    assert len(gaps) > reply_spin.BACKOFF and set(gaps[reply_spin.BACKOFF:]) == {1 << reply_spin.BACKOFF}  # capped


def test_the_setting_picks_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    with reply_spin.unix_socket() as s:
        assert isinstance(s, reply_spin.SpinSocket) and s.spin.spin_us == reply_spin.SPIN_US
    monkeypatch.setenv("KVPOOL_SPIN_US", "40")
    with reply_spin.unix_socket() as s:
        assert isinstance(s, reply_spin.SpinSocket) and s.spin.spin_us == 40.0
    monkeypatch.setenv("KVPOOL_SPIN_US", "0")
    with reply_spin.unix_socket() as s:
        assert not isinstance(s, reply_spin.SpinSocket) and s.family == socket.AF_UNIX
    for bad in ("fast", "-1", "20000", "nan"):
        monkeypatch.setenv("KVPOOL_SPIN_US", bad)
        with pytest.raises(ConfigError, match="KVPOOL_SPIN_US"):
            reply_spin.unix_socket()


def test_a_spinning_socket_duplicates_as_sockets_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """`socket.dup` makes one of the socket's own class with socket.socket's arguments."""
    monkeypatch.setenv("KVPOOL_SPIN_US", "40")
    with reply_spin.unix_socket() as s, s.dup() as d:
        assert isinstance(d, reply_spin.SpinSocket) and d.spin.spin_us == 40.0 and d.fileno() != s.fileno()


def test_a_client_without_the_extension_sleeps_in_its_receives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    monkeypatch.setattr(reply_spin, "spin_readable", None)
    with reply_spin.unix_socket() as s:
        assert not isinstance(s, reply_spin.SpinSocket)


def test_a_same_node_client_spins_for_its_answers_and_gets_what_it_put(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    seen: list[bool] = []
    real = native.spin_readable

    def counting(fd: int, spin_us: float) -> bool:
        got = real(fd, spin_us)
        seen.append(got)
        return bool(got)

    monkeypatch.setattr(reply_spin, "spin_readable", counting)
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock")),
               CacheConfig(dram_bytes=64 << 20, dram_slab_size=4 << 20, prefault=False)).start()  # type: ignore[arg-type]
    try:
        t = connect(str(tmp_path / "w.sock"), None, 5.0)
        try:
            rng = np.random.default_rng(7)
            blocks = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in range(32)]
            keys = [f"spin/{i}".encode() for i in range(32)]
            t.batch_put(keys, blocks)
            out = [np.zeros(64 << 10, dtype=np.uint8) for _ in range(32)]
            assert t.batch_get_into(keys, out) == [64 << 10] * 32
            assert all(np.array_equal(a, b) for a, b in zip(out, blocks))
            assert isinstance(t._sock, reply_spin.SpinSocket)
        finally:
            t.close()
    finally:
        w.stop()
    assert seen and any(seen)  # it asked, and answers came while it did

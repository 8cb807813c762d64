"""Challenge-response between clients and workers: the token never crosses the wire, a worker that
cannot prove it holds the token gets neither the token nor data (the client treats it as absent),
wrong tokens are throttled and counted, and the token file is made, kept private and found."""
from __future__ import annotations

import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from kvpool.core import protocol as P
from kvpool.core.auth import AuthThrottle
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import AuthError, ConfigError, PoolUnavailable
from kvpool.core.server import Worker

SMALL = {"dram_bytes": 32 << 20, "dram_slab_size": 1 << 20, "prefault": False}
TOKEN = "the-pool-token-" + "x" * 40
DATA = b"client data that must not reach a fake worker " * 64


def _worker(tmp_path: Path, **kw: object) -> Worker:
    return Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), **kw),  # type: ignore[arg-type]
                  CacheConfig(**SMALL))  # type: ignore[arg-type]


class FakeWorker:
    """A TCP peer posing as a worker that does not know the token: it answers HELLO (with a nonce,
    or claiming no authentication) and accepts any AUTH with a made-up proof; it records every
    byte it receives."""

    def __init__(self, asks_auth: bool) -> None:
        self.asks_auth = asks_auth
        self.received = bytearray()
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            with c:
                c.settimeout(5)
                try:
                    while True:
                        f = P.recv_frame(c)
                        self.received += f.meta
                        if f.data_len:
                            view = memoryview(bytearray(f.data_len))
                            P.recv_exactly(c, view)
                            self.received += view
                        info = {"worker_id": "fake", "tcp": self.address, "max_block": 1 << 20}
                        if f.op == P.Op.HELLO:
                            reply = {"auth": True, "nonce": "ab" * 32} if self.asks_auth else {**info, "auth": False}
                        elif f.op == P.Op.AUTH:
                            reply = {**info, "proof": "00" * 32}
                        else:
                            reply = {}
                        P.send_frame(c, f.op, P.pack_json(reply), req_id=f.req_id)
                except (OSError, ConnectionError, P.ProtocolError):
                    pass

    def close(self) -> None:
        self.srv.close()


@pytest.mark.parametrize("asks_auth", [True, False], ids=["fake-proof", "claims-no-auth"])
def test_a_fake_worker_gets_neither_the_token_nor_data(asks_auth: bool) -> None:
    fake = FakeWorker(asks_auth)
    try:
        with PoolClient(mode="local", worker=fake.address, token=TOKEN, timeout_s=5) as c:
            with pytest.raises(PoolUnavailable, match="treated as absent"):
                c.put("k", DATA)
            with pytest.raises(PoolUnavailable, match="treated as absent"):
                c.get("k")
        assert TOKEN.encode() not in fake.received
        assert DATA[:32] not in fake.received
    finally:
        fake.close()


def test_the_token_never_crosses_the_wire_and_both_sides_prove_it(tmp_path: Path) -> None:
    w = _worker(tmp_path, token=TOKEN).start()
    try:
        with socket.create_connection(("127.0.0.1", w.port), timeout=5) as s:
            P.send_frame(s, P.Op.HELLO)
            hello = P.unpack_json(P.recv_frame(s).meta)
        assert sorted(hello) == ["auth", "nonce"]  # no pid, arena, socket path or sizes before AUTH
        with socket.create_connection(("127.0.0.1", w.port), timeout=5) as s:  # the old token-in-clear AUTH
            P.send_frame(s, P.Op.HELLO)
            P.recv_frame(s)
            P.send_frame(s, P.Op.AUTH, P.pack_json({"token": TOKEN}))
            assert P.recv_frame(s).status == P.Status.AUTH_FAILED
        with PoolClient(mode="local", worker=w.address, token=TOKEN) as c:
            c.put("k", b"v")
            assert c.get("k") == b"v"
            assert c.stats().total.dram_bytes > 0
    finally:
        w.stop()


def test_malformed_proofs_fail_cleanly(tmp_path: Path) -> None:
    """Lone surrogates, non-hex and missing fields in AUTH: an AUTH_FAILED answer, the worker serves on."""
    w = _worker(tmp_path, token=TOKEN).start()
    try:
        for meta in (b'{"nonce": "\\ud800", "proof": "\\udc00"}', b'{"proof": 5}', b'{}', b'[1]'):
            with socket.create_connection(("127.0.0.1", w.port), timeout=10) as s:
                P.send_frame(s, P.Op.HELLO)
                P.recv_frame(s)
                P.send_frame(s, P.Op.AUTH, meta)
                try:
                    status = P.recv_frame(s).status
                except ConnectionError:
                    status = -1  # closed at once (not an object)
                assert status in (P.Status.AUTH_FAILED, -1), meta
        with PoolClient(mode="local", worker=w.address, token=TOKEN) as c:
            c.put("k", b"v")
        # the three proofs that fail are failed authentications; the list is no AUTH at all
        assert w.metrics.auth_failures.labels("token")._value.get() == 3
        assert w.metrics.protocol_errors._value.get() == 1
    finally:
        w.stop()


def test_a_hello_naming_a_malformed_pin_holder_is_refused_and_the_worker_serves_on(tmp_path: Path) -> None:
    """A HELLO may name the client process's pin holder (kvpool.core.pins): anything but an id of 63
    bits is a protocol error that ends that connection only."""
    w = _worker(tmp_path, token=TOKEN).start()
    try:
        for meta in (b'{"holder": "x"}', b'{"holder": -1}', b'{"holder": 9223372036854775808}',
                     b'{"holder": true}', b'{"holder": 1.5}', b'[1]'):
            with socket.create_connection(("127.0.0.1", w.port), timeout=10) as s:
                P.send_frame(s, P.Op.HELLO, meta)
                with pytest.raises(ConnectionError):
                    P.recv_frame(s)
        with PoolClient(mode="local", worker=w.address, token=TOKEN) as c:
            c.put("k", b"v", pin_s=5)
            assert c.get("k") == b"v"
        assert w.metrics.protocol_errors._value.get() == 6
    finally:
        w.stop()


def test_wrong_tokens_are_throttled_counted_and_do_not_delay_the_right_one(tmp_path: Path) -> None:
    w = _worker(tmp_path, token=TOKEN).start()
    try:
        t0 = time.monotonic()
        for _ in range(6):
            with pytest.raises(AuthError):
                PoolClient(mode="local", worker=w.address, token="guess", timeout_s=10).get("k")
        spent = time.monotonic() - t0
        expected = sum(min(AuthThrottle.MAX_S, AuthThrottle.BASE_S * 2 ** i) for i in range(6))
        assert spent >= expected * 0.9, f"6 wrong tokens answered in {spent:.2f} s"
        assert w.metrics.auth_failures.labels("token")._value.get() == 6
        t0 = time.monotonic()
        with PoolClient(mode="local", worker=w.address, token=TOKEN) as c:
            c.put("k", b"v")
        assert time.monotonic() - t0 < 0.5
    finally:
        w.stop()


def test_the_token_file_is_made_private_shared_and_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(state))
    monkeypatch.delenv("KVPOOL_TOKEN_FILE")
    a = _worker(tmp_path / "a").start()
    b = _worker(tmp_path / "b").start()
    try:
        token = state / "token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(state.stat().st_mode) == 0o700
        assert a.token == b.token == token.read_text().strip() and len(a.token or "") == 64
        with PoolClient(mode="local", worker=a.address) as c:  # found in the state folder
            c.put("k", b"v")
        monkeypatch.setenv("KVPOOL_TOKEN", "from-env-wins")
        with pytest.raises(AuthError):
            PoolClient(mode="local", worker=b.address).get("k")
        with PoolClient(mode="local", worker=b.address, token=a.token) as c:  # explicit wins over env
            assert c.get("k") is None
    finally:
        a.stop()
        b.stop()


def test_no_auth_is_an_explicit_loopback_only_opt_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="loopback"):
        _worker(tmp_path, host="127.0.0.2", no_auth=True)
    with pytest.raises(ConfigError, match="choose one"):
        _worker(tmp_path, token=TOKEN, no_auth=True)
    w = _worker(tmp_path, no_auth=True).start()
    try:
        assert not (tmp_path / "kvpool-token").exists()  # no token made
        with PoolClient(mode="local", worker=w.address) as c:
            c.put("k", b"v")
        # a client holding a token talks only to workers that prove they share it
        with pytest.raises(PoolUnavailable, match="does not authenticate"):
            PoolClient(mode="local", worker=w.address, token=TOKEN).get("k")
        monkeypatch.setenv("KVPOOL_NO_AUTH", "1")  # unless this user opted out too
        with PoolClient(mode="local", worker=w.address, token=TOKEN) as c:
            assert c.get("k") == b"v"
    finally:
        w.stop()

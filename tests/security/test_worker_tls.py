"""TLS on a worker's TCP port (`--tls-cert/--tls-key`, clients `tls_ca`/`KVPOOL_TLS_CA`), with a CA
made in the test: block bytes and keys cross the wire encrypted (checked on a relay that records
them), the token's challenge-response still decides who gets in, and a client talks only to a worker
whose certificate verifies for the address it dials; no side falls back to clear text."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from tlshelp import make_ca, make_cert

from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import AuthError, ConfigError, PoolUnavailable
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.core.server import Worker

SMALL = {"dram_bytes": 32 << 20, "dram_slab_size": 1 << 20, "prefault": False}
SECRET = b"plain-text-marker-" * 64  # what must not be seen on the wire
KEY = "tls/key-that-must-not-be-seen"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca = make_ca(tmp_path / "pki")
    cert, key = make_cert(ca, "worker")
    other_ca = make_ca(tmp_path / "pki", "other-ca")
    return {"ca": ca, "cert": cert, "key": key, "other_ca": other_ca}


@pytest.fixture
def tls_worker(pki: dict[str, Path]) -> Iterator[Worker]:
    w = Worker(WorkerConfig(port=0, tls_cert=str(pki["cert"]), tls_key=str(pki["key"])), CacheConfig(**SMALL)).start()
    try:
        yield w
    finally:
        w.stop()


class Relay:
    """A TCP relay to `target` that keeps every byte it carries, both ways; with `tamper_after`, it
    flips one bit of the client's stream once that many bytes have passed (an attacker on the path)."""

    def __init__(self, target: tuple[str, int], tamper_after: int | None = None) -> None:
        self.target = target
        self.tamper_after = tamper_after
        self.tampered = False
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._listener.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            self._socks += [a, b]
            for src, dst, upstream in ((a, b, True), (b, a, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, upstream), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        passed = 0
        try:
            while chunk := src.recv(1 << 16):
                with self._lock:
                    self.seen += chunk
                passed += len(chunk)
                if upstream and self.tamper_after is not None and passed > self.tamper_after and not self.tampered:
                    chunk = bytearray(chunk)
                    chunk[len(chunk) // 2] ^= 0x01
                    self.tampered = True
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            s.close()
        for t in self._threads:
            t.join(5)


@pytest.fixture
def relay() -> Iterator[Callable[..., Relay]]:
    made: list[Relay] = []

    def _relay(address: str, tamper_after: int | None = None) -> Relay:
        host, port = address.rsplit(":", 1)
        made.append(Relay((host, int(port)), tamper_after))
        return made[-1]

    yield _relay
    for r in made:
        r.close()


def test_blocks_and_keys_cross_encrypted(tls_worker: Worker, pki: dict[str, Path],
                                         relay: Callable[..., Relay]) -> None:
    wire = relay(tls_worker.address)
    blocks = [np.frombuffer(SECRET * 8, dtype=np.uint8) for _ in range(3)]
    keys = [f"{KEY}/{i}" for i in range(3)]
    with PoolClient(mode="local", worker=wire.address, tls_ca=str(pki["ca"])) as c:
        c.put(KEY, SECRET)
        assert c.get(KEY) == SECRET
        c.batch_put(keys, blocks)
        out = [np.zeros(len(SECRET) * 8, dtype=np.uint8) for _ in keys]
        assert c.batch_get_into(keys, out) == [len(SECRET) * 8] * 3
        assert all((o == b).all() for o, b in zip(out, blocks))
    assert len(wire.seen) > 3 * len(SECRET) * 8  # the bytes went through the relay...
    assert SECRET[:32] not in wire.seen and KEY.encode() not in wire.seen  # ...and not in clear
    assert b"worker_id" not in wire.seen  # nor the worker's description (HELLO/AUTH replies)


def test_a_tls_connection_never_spins(tls_worker: Worker, pki: dict[str, Path],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A TLS socket's bytes are records, not answers: its client sleeps in its receives
    (`kvpool.core.reply_spin`), and its calls go on as ever."""
    from kvpool.core import reply_spin
    from kvpool.core.transport import connect

    monkeypatch.delenv("KVPOOL_SPIN_US", raising=False)
    spins: list[int] = []
    monkeypatch.setattr(reply_spin, "spin_readable", lambda fd, us: spins.append(fd) or True)
    t = connect(tls_worker.address, tls_worker.token, 5.0, str(pki["ca"]))
    try:
        t.batch_put([b"tls/spin"], [SECRET])
        out = bytearray(len(SECRET))
        assert t.batch_get_into([b"tls/spin"], [out]) == [len(SECRET)] and bytes(out) == SECRET
        assert not isinstance(t._sock, reply_spin.SpinSocket)
    finally:
        t.close()
    assert spins == []


def test_an_altered_record_closes_the_connection(tls_worker: Worker, pki: dict[str, Path],
                                                relay: Callable[..., Relay]) -> None:
    wire = relay(tls_worker.address, tamper_after=16 << 10)  # past the handshake, inside the put's data
    with PoolClient(mode="local", worker=wire.address, tls_ca=str(pki["ca"])) as c, pytest.raises(PoolUnavailable):
        c.put(KEY, SECRET * 64)
    assert wire.tampered
    with PoolClient(mode="local", worker=tls_worker.address, tls_ca=str(pki["ca"])) as c:
        assert c.get(KEY) is None  # nothing of the altered put was stored


def test_the_token_still_decides(tls_worker: Worker, pki: dict[str, Path]) -> None:
    """TLS does not replace authentication: a client with the CA but a wrong token is refused."""
    with PoolClient(mode="local", worker=tls_worker.address, tls_ca=str(pki["ca"]), token="wrong-" * 8) as c, \
            pytest.raises(AuthError):
        c.get(KEY)
    assert tls_worker.metrics.auth_failures.labels("token")._value.get() == 1


def test_untrusted_or_misnamed_certificate_is_absent(tls_worker: Worker, pki: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with PoolClient(mode="local", worker=tls_worker.address, tls_ca=str(pki["other_ca"])) as c, \
            pytest.raises(PoolUnavailable, match="does not verify against the CA"):
        c.get(KEY)
    # the right CA, but a certificate for another name than the one dialled
    cert, key = make_cert(pki["ca"], "elsewhere", san="DNS:elsewhere.example")
    w = Worker(WorkerConfig(port=0, tls_cert=str(cert), tls_key=str(key)), CacheConfig(**SMALL)).start()
    try:
        monkeypatch.setenv("KVPOOL_TLS_CA", str(pki["ca"]))  # the environment's CA, as a deployment sets it
        with PoolClient(mode="local", worker=w.address) as c, pytest.raises(PoolUnavailable, match="does not verify"):
            c.get(KEY)
    finally:
        w.stop()
    assert tls_worker.metrics.auth_failures.labels("tls")._value.get() >= 1  # counted on the worker


def test_no_fallback_to_clear_text(tls_worker: Worker, pki: dict[str, Path]) -> None:
    # a client without a CA cannot talk to a TLS worker (and is told why) ...
    with PoolClient(mode="local", worker=tls_worker.address) as c, \
            pytest.raises(PoolUnavailable, match="KVPOOL_TLS_CA"):
        c.get(KEY)
    # ... and a client with one sends nothing to a worker in clear text
    plain = Worker(WorkerConfig(port=0), CacheConfig(**SMALL)).start()
    try:
        with PoolClient(mode="local", worker=plain.address, tls_ca=str(pki["ca"])) as c, \
                pytest.raises(PoolUnavailable, match="no TLS handshake"):
            c.put(KEY, SECRET)
        assert plain.cache.stats().dram_bytes == 0
    finally:
        plain.stop()
    with PoolClient(mode="local", worker=tls_worker.address, tls_ca=str(pki["ca"])) as c:  # the worker serves on
        c.put(KEY, b"still serving")
        assert c.get(KEY) == b"still serving"


def test_tls_needs_a_certificate_and_its_key(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="both a certificate and its key"):
        WorkerConfig(tls_cert=str(pki["cert"]))
    with pytest.raises(ConfigError, match="cannot load the worker's TLS certificate"):
        Worker(WorkerConfig(port=0, tls_cert=str(pki["cert"]), tls_key=str(tmp_path / "missing.key")),
               CacheConfig(**SMALL))
    with pytest.raises(ConfigError, match="cannot load the TLS CA file"):
        PoolClient(mode="local", worker="127.0.0.1:1", tls_ca=str(tmp_path / "missing.pem"))


def test_cluster_over_tls(spawn: Callable[..., WorkerProcess], nats: NatsServer, pki: dict[str, Path]) -> None:
    """`kvpool worker --tls-cert/--tls-key` in a cluster; a client on another node reaches it over TLS."""
    spawn(nats_url=nats.url, extra=["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])])
    with PoolClient(mode="cluster", nats_url=nats.url, tls_ca=str(pki["ca"]), node_id="another-node") as c:
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        c.put(KEY, SECRET)
        assert c.get(KEY) == SECRET
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="another-node", timeout_s=2) as c:  # no CA
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        assert c.get(KEY) is None  # the worker is absent to it: a miss, never clear text


@pytest.mark.parametrize("no_auth", [False, True])
def test_a_stalled_tls_handshake_is_dropped(pki: dict[str, Path], no_auth: bool) -> None:
    """A peer that starts TLS and stalls holds a thread only until its deadline (auth_timeout_s with a
    token, io_timeout_s without): the worker closes the connection and serves others meanwhile."""
    cfg = WorkerConfig(port=0, tls_cert=str(pki["cert"]), tls_key=str(pki["key"]), no_auth=no_auth,
                       auth_timeout_s=0.5, io_timeout_s=0.5)
    w = Worker(cfg, CacheConfig(**SMALL)).start()
    try:
        with socket.create_connection(("127.0.0.1", w.port), timeout=20) as s:
            s.sendall(b"\x16\x03\x01\x02\x00")  # the start of a ClientHello record, never finished
            with PoolClient(mode="local", worker=w.address, tls_ca=str(pki["ca"])) as c:
                c.put(KEY, b"served meanwhile")
                assert c.get(KEY) == b"served meanwhile"
            assert s.recv(1) == b""  # closed by the worker
    finally:
        w.stop()

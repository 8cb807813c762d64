"""NATS secured by default: per-role users on a real nats-server, as `kvpool up` runs it.

Each test is an attack from the issue-11 report (an anonymous client joining the cluster and writing
fake members) or a path that must keep working with credentials (workers register, clients watch and
use streams), against a real nats-server with `nats_creds.authorization`."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nats as nats_py
import pytest

from kvpool.core import AuthError
from kvpool.core.cluster import BUCKET, Membership
from kvpool.core.events import EventFeed
from kvpool.core.nats_creds import NatsCreds, authorization, creds_path, ensure_creds, find_creds, load_creds
from kvpool.core.nats_server import NatsServer, free_port
from kvpool.core.procs import WorkerProcess
from kvpool.streams import Consumer, Producer, StreamConfig, StreamRefused, create_stream


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private state dir for this test: where `kvpool up` keeps credentials and clients find them."""
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def secured(state: Path) -> Iterator[NatsServer]:
    """nats-server with the per-role users of `kvpool up`, credentials in the state dir."""
    creds = ensure_creds()
    server = NatsServer(state / "nats", port=0, authorization=authorization(creds)).start()
    yield server
    server.stop()


def _info() -> dict[str, object]:
    return {"tcp": "127.0.0.1:1", "node_id": "n"}


async def _raw(url: str, creds: NatsCreds) -> nats_py.NATS:
    return await nats_py.connect(url, allow_reconnect=False, connect_timeout=2, **creds.connect_options())


def _anonymous_refusal(url: str) -> str:
    """What nats-server answers a client with no credentials (nats-py's own error, its socket closed)."""
    async def attempt() -> str:
        nc = nats_py.NATS()
        try:
            await nc.connect(url, allow_reconnect=False, connect_timeout=2)
        except Exception as e:
            if nc._transport is not None:
                nc._transport.close()
            return str(e)
        await nc.close()
        return "connected"

    return asyncio.run(attempt())


def test_anonymous_join_is_refused_at_once(secured: NatsServer, state: Path) -> None:
    os.unlink(creds_path("client"))  # a user without the credentials: none in its state dir
    t0 = time.monotonic()
    with pytest.raises(AuthError, match="without credentials"):
        Membership(secured.url, connect_timeout_s=5)
    assert time.monotonic() - t0 < 3, "refused credentials must fail at once, not after the timeout"
    with pytest.raises(AuthError, match="refused"):
        Membership(secured.url, creds=NatsCreds("kvpool-client", "wrong"))
    # nats-py itself, anonymous: the server says Authorization Violation
    assert "authorization violation" in _anonymous_refusal(secured.url).lower()
    assert "authentication error" in (secured.store_dir / "nats-server.log").read_text()  # the server's log line


def test_client_cannot_write_a_fake_member(secured: NatsServer) -> None:
    worker = Membership(secured.url, role="worker")  # the worker's user made the bucket
    worker.register("real", _info, heartbeat_s=1)
    client = Membership(secured.url, role="client")
    try:
        with pytest.raises(AuthError, match="may not register"):
            client.register("fake", _info, heartbeat_s=1)

        async def attack() -> list[str]:
            creds = find_creds("client")
            assert creds is not None
            nc = await _raw(secured.url, creds)
            js = nc.jetstream(timeout=1)
            kv = await js.key_value(BUCKET)
            with pytest.raises(nats_py.errors.TimeoutError):  # the server drops the write
                await kv.put("fake2", b'{"tcp": "127.0.0.1:2"}')
            with pytest.raises(nats_py.errors.TimeoutError):  # nor may it delete the bucket
                await js.delete_stream(f"KV_{BUCKET}")
            with pytest.raises(nats_py.errors.TimeoutError):  # nor empty it
                await js.purge_stream(f"KV_{BUCKET}")
            # a stream config may republish onto any subject as the server: clients may not make streams
            from nats.js.api import RePublish
            from nats.js.api import StreamConfig as NatsStreamConfig

            with pytest.raises(nats_py.errors.TimeoutError):
                await js.add_stream(NatsStreamConfig(name="EVIL", subjects=["kvpool.stream.EVIL.>"],
                                                     republish=RePublish(src="kvpool.stream.EVIL.x",
                                                                         dest=f"$KV.{BUCKET}.fake3")))
            keys = list(await kv.keys())
            await nc.close()
            return keys

        assert sorted(asyncio.run(attack())) == ["real"]
        log = (secured.store_dir / "nats-server.log").read_text()
        assert 'Publish Violation - Subject "$KV.kvpool_members.fake"' in log
        client.watch()
        assert client.wait_for(lambda m: "real" in m, 5)
        assert set(client.members()) == {"real"}
    finally:
        client.close()
        worker.close()


def test_worker_process_registers_with_its_credentials(secured: NatsServer, spawn: object, tmp_path: Path) -> None:
    w = WorkerProcess(tmp_path / "w", nats_url=secured.url, dram_bytes="64MiB",
                      env={"KVPOOL_NATS_CREDS": str(creds_path("worker"))})
    try:
        w.wait_ready()
        client = Membership(secured.url)  # role client, its credentials found in the state dir
        try:
            client.watch()
            assert client.wait_for(lambda m: len(m) == 1, 10)
            assert next(iter(client.members().values())).tcp == w.address
        finally:
            client.close()
    finally:
        w.stop(timeout=5)


def test_worker_without_credentials_fails_with_auth_error(secured: NatsServer, tmp_path: Path) -> None:
    w = WorkerProcess(tmp_path / "w", nats_url=secured.url, dram_bytes="64MiB")  # its own empty state dir
    try:
        assert w.proc.wait(30) != 0
        assert "AuthError" in w.log_tail(8000) and "without credentials" in w.log_tail(8000)
    finally:
        w.stop(timeout=5)


def test_clients_find_credentials_and_use_streams(secured: NatsServer, state: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    create_stream(secured.url, "jobs", StreamConfig(memory=True))  # the admin user, found in the state dir
    with Producer("jobs", secured.url) as p:  # the client user
        p.publish({"op": "x"})
    with Consumer("jobs", secured.url, group="g") as c:
        msg = c.receive(timeout=5)
        assert msg is not None and msg.json() == {"op": "x"}
        msg.ack()
    # a machine handed only the client credentials may use streams, not configure them
    monkeypatch.setenv("KVPOOL_NATS_CREDS", str(creds_path("client")))
    with pytest.raises(StreamRefused, match="may not"):
        create_stream(secured.url, "other")
    # (a URL with a password user's credentials in it: tests/security/test_nats_nkeys.py)
    monkeypatch.delenv("KVPOOL_NATS_CREDS")
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(state / "elsewhere"))
    with pytest.raises(StreamRefused, match="refused"):  # and without any: refused, as a stream error
        Producer("jobs", secured.url)
    with pytest.raises(AuthError):
        EventFeed(secured.url, timeout_s=2)


def _runs_as_nobody() -> bool:
    return os.geteuid() == 0 and shutil.which("runuser") is not None


def test_kvpool_up_secures_nats(tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = free_port()
    env = {**os.environ, "KVPOOL_STATE_DIR": str(state)}
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "up", "--port", "0", "--nats-port", str(port),
                             "--dram-bytes", "64MiB"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out = ""
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while "Ctrl-C" not in out and time.monotonic() < deadline and proc.poll() is None:
            out += proc.stdout.readline()
        assert "kvpool is up" in out, out
        assert f"KVPOOL_NATS_CREDS={state / 'nats' / 'client.json'}" in out
        folder = state / "nats"
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        for role in ("worker", "client", "admin"):
            f = folder / f"{role}.json"
            assert stat.S_IMODE(f.stat().st_mode) == 0o600
            assert set(json.loads(f.read_text())) == {"user", "nkey_seed"}
        assert stat.S_IMODE((folder / "nats-server.conf").stat().st_mode) == 0o600
        url = f"nats://127.0.0.1:{port}"
        assert "authorization violation" in _anonymous_refusal(url).lower()
        client = Membership(url, creds=load_creds(folder / "client.json"))
        try:
            client.watch()
            assert client.wait_for(lambda m: len(m) == 1, 10)  # `up`'s worker registered as the worker user
        finally:
            client.close()
        if _runs_as_nobody():  # another local user cannot read the credentials
            r = subprocess.run(["runuser", "-u", "nobody", "--", "cat", str(folder / "client.json")],
                               capture_output=True, text=True)
            assert r.returncode != 0 and "Permission denied" in r.stderr
    finally:
        proc.terminate()
        proc.wait(20)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls_with_credentials(state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = NatsServer(state / "nats", port=0, authorization=authorization(ensure_creds()),
                        tls=(str(cert), str(key))).start()
    try:
        with pytest.raises(AuthError, match="certificate is not trusted"):  # a client not trusting it: not in
            Membership(server.url, connect_timeout_s=2)
        monkeypatch.setenv("KVPOOL_NATS_TLS_CA", str(cert))
        worker = Membership(server.url, role="worker")
        try:
            worker.register("w", _info, heartbeat_s=1)
            client = Membership(server.url)
            client.watch()
            assert client.wait_for(lambda m: "w" in m, 5)
            client.close()
        finally:
            worker.close()
    finally:
        server.stop()


def test_handoff_as_the_client_user(secured: NatsServer) -> None:
    """Prefill -> decode over a stream with the client user: publish, consume, and the purge at the end."""
    import numpy as np

    from kvpool.core import PoolClient
    from kvpool.streams import HandoffReceiver

    create_stream(secured.url, "handoff", StreamConfig(memory=True))
    blocks = [np.full(4096, layer, dtype=np.uint8) for layer in range(3)]
    with PoolClient(mode="embedded", dram_bytes=64 << 20, dram_slab_size=1 << 20) as pool:
        with Producer("handoff", secured.url, pool=pool) as p:
            for layer in range(3):
                p.publish_kv("r1", layer, [f"r1/L{layer}"], [blocks[layer]])
            p.end_request("r1", 3)
        with HandoffReceiver("handoff", secured.url, pool) as rx:
            got = [(layer, bytes(bufs[0])) for layer, _, bufs in rx.iter_layers("r1", timeout=10)]
    assert got == [(layer, blocks[layer].tobytes()) for layer in range(3)]


def test_a_client_that_trusts_only_tls_sends_no_credentials_to_a_server_that_offers_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server in the middle whose INFO leaves out tls_required: nats-py alone would send it the CONNECT
    (a password, or an nkey's signature over a nonce it passed on) in clear text."""
    from tlshelp import make_ca

    from kvpool.core.client import PoolClient
    from kvpool.core.errors import KVPoolError

    monkeypatch.setenv("KVPOOL_NATS_TLS_CA", str(make_ca(tmp_path)))
    creds = ensure_creds(tmp_path / "creds", nkeys=False)["client"]
    monkeypatch.setenv("KVPOOL_NATS_CREDS", str(creds.path))
    fake = socket.create_server(("127.0.0.1", 0))
    firsts: list[bytes] = []

    def serve() -> None:
        fake.settimeout(10)
        with contextlib.suppress(OSError):
            conn, _ = fake.accept()
            with conn:
                conn.sendall(b'INFO {"server_id":"FAKE","version":"2.10.0","proto":1,"headers":true,'
                             b'"max_payload":1048576,"auth_required":true,"nonce":"mine"}\r\n')
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    firsts.append(conn.recv(4096))

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with pytest.raises(KVPoolError), PoolClient(mode="cluster", nats_url=f"nats://127.0.0.1:"
                                                    f"{fake.getsockname()[1]}", timeout_s=2):
            pass
    finally:
        thread.join(15)
        fake.close()
    assert firsts and not firsts[0].startswith(b"CONNECT")  # a TLS handshake (0x16 ...), not our credentials
    assert str(creds.password).encode() not in firsts[0]


def test_streams_command_takes_the_credentials_it_is_given(secured: NatsServer, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvpool streams --nats-creds FILE`: every connection of the command uses FILE, not what the state
    dir holds (there, `create` finds the admin's): a client's may not create a stream, the admin's may."""
    import argparse

    from kvpool.streams.cli import add_parser

    def run(*argv: str) -> int:
        parser = argparse.ArgumentParser(prog="kvpool")
        add_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["streams", "--nats-url", secured.url, *argv])
        return int(args.func(args))

    monkeypatch.delenv("KVPOOL_NATS_CREDS", raising=False)  # the option sets it (for this process)
    with pytest.raises(StreamRefused, match="may not"):
        run("--nats-creds", str(creds_path("client")), "create", "by-client")
    assert run("--nats-creds", str(creds_path("admin")), "create", "by-admin") == 0
    assert json.loads(capsys.readouterr().out)["name"] == "by-admin"

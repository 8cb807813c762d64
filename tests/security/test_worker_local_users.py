"""Another Unix user on the same machine (`nobody`, a child that setuid's to it) against a worker
on 127.0.0.1: without the token it reads nothing, clears nothing and learns nothing from HELLO; it
cannot read the token file, the SSD files, or talk through the worker's Unix socket even when the
socket's permissions are loosened (SO_PEERCRED); and a client never talks to a Unix socket that
another user serves."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from workerhelp import NOBODY, as_nobody, need_root, open_folder

from kvpool.core import protocol as P
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import PoolUnavailable
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport

SMALL = {"dram_bytes": 32 << 20, "dram_slab_size": 1 << 20, "prefault": False}


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """State folder and token file inside a folder anyone may enter: only their own modes protect them."""
    with open_folder() as folder:
        monkeypatch.setenv("KVPOOL_STATE_DIR", str(folder / "state"))
        monkeypatch.setenv("KVPOOL_TOKEN_FILE", str(folder / "token"))
        yield folder


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_nobody_cannot_read_clear_or_learn_over_loopback(state: Path) -> None:
    need_root()
    w = Worker(WorkerConfig(port=0), CacheConfig(**SMALL)).start()
    try:
        token = state / "token"
        assert _mode(token) == 0o600 and _mode(state / "state") == 0o700
        with PoolClient(mode="local", worker=w.address) as c:  # this user's client finds the token file
            c.put("secret", b"another user's bytes")
        got = as_nobody("""
            import socket
            from kvpool.core import protocol as P
            from kvpool.core.client import PoolClient
        """, """
            out = {}
            for what, token in (("get", None), ("get_guess", "guess")):
                try:
                    with PoolClient(mode="local", worker=sys.argv[1], token=token) as c:
                        out[what] = repr(c.get("secret"))
                except Exception as e:
                    out[what] = type(e).__name__
            try:
                with PoolClient(mode="local", worker=sys.argv[1], token="guess") as c:
                    c.clear()
                out["clear"] = "cleared"
            except Exception as e:
                out["clear"] = type(e).__name__
            host, port = sys.argv[1].rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as s:
                P.send_frame(s, P.Op.CLEAR)
                out["raw_clear"] = P.recv_frame(s).status
            with socket.create_connection((host, int(port)), timeout=10) as s:
                P.send_frame(s, P.Op.HELLO)
                out["hello"] = sorted(P.unpack_json(P.recv_frame(s).meta))
            try:
                open(sys.argv[2]).read()
                out["token_file"] = "read"
            except PermissionError:
                out["token_file"] = "denied"
            print(json.dumps(out))
        """, w.address, str(token))
        assert got == {"get": "AuthError", "get_guess": "AuthError", "clear": "AuthError",
                       "raw_clear": P.Status.AUTH_REQUIRED, "hello": ["auth", "nonce"], "token_file": "denied"}
        with PoolClient(mode="local", worker=w.address) as c:
            assert c.get("secret") == b"another user's bytes"
        assert w.metrics.auth_failures.labels("token")._value.get() >= 2
    finally:
        w.stop()


def test_nobody_cannot_read_the_ssd_files(state: Path) -> None:
    need_root()
    ssd = state / "ssd"
    ssd.mkdir(mode=0o755)  # as an older version left it
    ssd.chmod(0o755)
    w = Worker(WorkerConfig(port=0), CacheConfig(**SMALL, ssd_path=str(ssd), ssd_map_size=64 << 20)).start()
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            c.put("on-disk", b"S" * 4096)
        w.cache.flush()
        assert _mode(ssd) == 0o700
        for name in ("data.mdb", "lock.mdb", "kvpool-worker-id"):
            assert _mode(ssd / name) == 0o600, name
        assert b"S" * 4096 in (ssd / "data.mdb").read_bytes()
        got = as_nobody("", """
            out = {}
            for name in ("data.mdb", "lock.mdb", "kvpool-worker-id"):
                try:
                    open(os.path.join(sys.argv[1], name), "rb").read(1)
                    out[name] = "read"
                except PermissionError:
                    out[name] = "denied"
            print(json.dumps(out))
        """, str(ssd))
        assert got == {"data.mdb": "denied", "lock.mdb": "denied", "kvpool-worker-id": "denied"}
    finally:
        w.stop()
    os.chmod(ssd / "data.mdb", 0o644)  # a reopened tier tightens files an older version made
    w = Worker(WorkerConfig(port=0), CacheConfig(**SMALL, ssd_path=str(ssd), ssd_map_size=64 << 20)).start()
    try:
        assert _mode(ssd / "data.mdb") == 0o600
    finally:
        w.stop()


def test_a_unix_peer_of_another_user_is_refused_even_through_an_open_socket(state: Path) -> None:
    need_root()
    w = Worker(WorkerConfig(port=0, unix_path=str(state / "w.sock")), CacheConfig(**SMALL)).start()
    try:
        os.chmod(w.unix_path, 0o666)  # permissions loosened by mistake: the peer check still holds
        got = as_nobody("import socket\nfrom kvpool.core import protocol as P", """
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(sys.argv[1])
            try:
                P.send_frame(s, P.Op.HELLO)
                out = "answered" if s.recv(64) else "closed"
            except OSError as e:
                out = "closed"
            print(json.dumps(out))
        """, w.unix_path)
        assert got == "closed"
        assert w.metrics.auth_failures.labels("peer_uid")._value.get() == 1
        with PoolClient(mode="local", worker=w.unix_path) as c:  # this user's still get in
            c.put("k", b"v")
            assert c.get("k") == b"v"
    finally:
        w.stop()


def test_a_client_does_not_talk_to_a_unix_socket_another_user_serves(state: Path) -> None:
    need_root()
    folder = state / "nobody"
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    path = folder / "fake.sock"
    code = textwrap.dedent("""
        import os, socket, sys
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(sys.argv[1])
        os.chmod(sys.argv[1], 0o666)
        srv.listen(1)
        print("ready", flush=True)
        c, _ = srv.accept()
        c.settimeout(5)
        try:
            got = c.recv(1 << 16)
        except OSError:
            got = b""
        print(len(got), flush=True)
    """)
    fake = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
        t = ShmTransport(str(path), timeout_s=5)
        with pytest.raises(PoolUnavailable, match="uid 65534"):
            t.hello()
        t.close()
        assert fake.stdout.readline().strip() == "0"  # not even a HELLO reached it
    finally:
        fake.kill()
        fake.wait()
        if fake.stdout is not None:
            fake.stdout.close()

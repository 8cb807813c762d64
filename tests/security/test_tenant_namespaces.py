"""Tenant tokens against a real `kvpool worker --tenants FILE` process: a tenant reads, writes, pins and
clears only keys of its namespace `<tenant>/` (anything else is refused whole with NamespaceError),
its bytes stored are held to its quota (QuotaExceeded, freed by a remove), a tenant token never works
as another tenant's or as the pool token, and the pool token keeps full access."""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from workerhelp import as_nobody, need_root

from kvpool.core import protocol as P
from kvpool.core.auth import token_path
from kvpool.core.blocks import checksum
from kvpool.core.client import PoolClient
from kvpool.core.errors import AuthError, CapacityError, ConfigError, NamespaceError, PoolUnavailable, QuotaExceeded
from kvpool.core.procs import WorkerProcess
from kvpool.core.tenants import load_tenants
from kvpool.core.transport import connect

A_TOKEN = "tenant-a-token-" + "a" * 32
B_TOKEN = "tenant-b-token-" + "b" * 32
QUOTA = 64 << 10
BLOCK = b"x" * (16 << 10)


def _tenants_file(folder: Path, table: dict[str, object], mode: int = 0o600) -> Path:
    path = folder / "tenants.json"
    path.write_text(json.dumps(table))
    path.chmod(mode)
    return path


@pytest.fixture
def worker(tmp_path: Path, spawn: Callable[..., WorkerProcess]) -> Iterator[WorkerProcess]:
    path = _tenants_file(tmp_path, {"a": {"token": A_TOKEN, "quota_bytes": QUOTA}, "b": {"token": B_TOKEN}})
    yield spawn(extra=["--tenants", str(path)])


def _client(w: WorkerProcess, token: str | None = None) -> PoolClient:
    return PoolClient(mode="local", worker=w.address, token=token, timeout_s=5)


def _pool_token() -> str:
    return token_path().read_text().strip()


def test_a_tenant_touches_only_its_namespace(worker: WorkerProcess) -> None:
    with _client(worker, B_TOKEN) as b:
        b.put("b/secret", b"tenant b's bytes")
    with _client(worker, _pool_token()) as admin:
        admin.put("shared/key", b"the pool's bytes")
    with _client(worker, A_TOKEN) as a:
        a.put("a/mine", b"tenant a's bytes")
        assert a.get("a/mine") == b"tenant a's bytes"
        for attempt in (lambda: a.get("b/secret"), lambda: a.exists("b/secret"), lambda: a.remove("b/secret"),
                        lambda: a.prefix_match(["b/secret"]), lambda: a.put("b/secret", b"forged"),
                        lambda: a.get("shared/key"), lambda: a.remove("shared/key"),
                        lambda: a.batch_exists(["a/mine", "b/secret"]),  # one outside key refuses the batch
                        lambda: a.get("a"), lambda: a.get("a/"), lambda: a.clear("b/"), lambda: a.clear("a")):
            with pytest.raises(NamespaceError) as e:
                attempt()
            assert isinstance(e.value, AuthError)
        a.pin("b/secret", 60)  # PIN has no reply: refused quietly, nothing pinned
        assert a.get("a/mine") == b"tenant a's bytes"  # the connection still works after refusals
        a.clear()  # a tenant's clear is its namespace's
        assert not a.exists("a/mine")
    with _client(worker, _pool_token()) as admin:  # nothing of b's or the pool's was read, changed or cleared
        assert admin.get("b/secret") == b"tenant b's bytes"
        assert admin.get("shared/key") == b"the pool's bytes"
        s = admin.stats().total
        assert s.pins == 0 and s.pending_pins == 0  # a's pin of b's key was dropped
    log = worker.log_tail(1 << 16)
    assert "outside its namespace 'a/'" in log


def test_the_pool_token_keeps_full_access(worker: WorkerProcess) -> None:
    with _client(worker, A_TOKEN) as a:
        a.put("a/1", b"one")
    with _client(worker, _pool_token()) as admin:
        assert admin.get("a/1") == b"one"
        admin.put("b/2", b"two")
        admin.clear("a/")
        assert not admin.exists("a/1") and admin.exists("b/2")
        admin.clear()
        assert not admin.exists("b/2")


def test_a_tenant_token_is_no_other_tenants(worker: WorkerProcess) -> None:
    with _client(worker, B_TOKEN) as b:
        b.put("b/k", b"b")
    with _client(worker, A_TOKEN) as a, pytest.raises(NamespaceError):
        a.get("b/k")
    with _client(worker, "not-a-token-" + "z" * 30) as stranger, pytest.raises((AuthError, PoolUnavailable)):
        stranger.get("b/k")
    with _client(worker, A_TOKEN[:-1] + "b") as near, pytest.raises((AuthError, PoolUnavailable)):
        near.get("a/k")


def test_the_quota_refuses_the_put_past_it_and_a_remove_frees_room(worker: WorkerProcess) -> None:
    with _client(worker, A_TOKEN) as a:
        for i in range(QUOTA // len(BLOCK)):
            a.put(f"a/{i}", BLOCK)
        with pytest.raises(QuotaExceeded) as e:
            a.put("a/over", BLOCK)
        assert isinstance(e.value, CapacityError) and e.value.key == b"a/over" and e.value.size == len(BLOCK)
        assert not a.exists("a/over")
        a.put("a/0", BLOCK)  # replacing a block within the quota is fine
        assert a.remove("a/1")
        a.put("a/over", BLOCK)  # a remove frees its bytes
        assert a.get("a/over") == BLOCK
        a.clear()
        for i in range(QUOTA // len(BLOCK)):  # so does a clear
            a.put(f"a/{i}", BLOCK)
    with _client(worker, B_TOKEN) as b:  # b has no quota; a's does not limit it
        for i in range(2 * QUOTA // len(BLOCK)):
            b.put(f"b/{i}", BLOCK)
    assert "would pass its quota" in worker.log_tail(1 << 16)


def test_nobody_with_a_tenant_token_cannot_reach_another_tenant(worker: WorkerProcess) -> None:
    need_root()
    with _client(worker, B_TOKEN) as b:
        b.put("b/secret", b"tenant b's bytes")
    got = as_nobody("""
        from kvpool.core.client import PoolClient
        from kvpool.core.errors import NamespaceError
    """, """
        out = {}
        with PoolClient(mode="local", worker=sys.argv[1], token=sys.argv[2], timeout_s=5) as c:
            c.put("a/own", b"mine")
            out["own"] = c.get("a/own").decode()
            for name, call in (("get", lambda: c.get("b/secret")), ("clear", lambda: c.clear("b/")),
                               ("remove", lambda: c.remove("b/secret"))):
                try:
                    call()
                    out[name] = "allowed"
                except NamespaceError:
                    out[name] = "NamespaceError"
            c.clear()
        print(json.dumps(out))
    """, worker.address, A_TOKEN)
    assert got == {"own": "mine", "get": "NamespaceError", "clear": "NamespaceError", "remove": "NamespaceError"}
    with _client(worker, B_TOKEN) as b:
        assert b.get("b/secret") == b"tenant b's bytes"


def test_a_forged_frame_outside_the_namespace_gets_forbidden(worker: WorkerProcess) -> None:
    """Below the client: a raw PUT naming another tenant's key is read whole, refused, and the
    connection still serves."""
    conn = connect(worker.address, A_TOKEN, 5)
    try:
        meta = P.pack_batch([b"b/k"], np.array([6], dtype="<i8"), np.array([checksum(b"forged")], dtype="<u8"),
                            np.array([1], dtype="<u8"))
        with conn._session():
            sock = conn._sock
            assert sock is not None
            P.send_frame(sock, P.Op.PUT, meta, data=[memoryview(b"forged")])
            reply = P.recv_frame(sock)
            assert reply.status == P.Status.FORBIDDEN
            P.send_frame(sock, P.Op.EXISTS, P.pack_batch([b"a/none"]))
            assert P.recv_frame(sock).status == P.Status.OK  # the same connection still serves
    finally:
        conn.close()
    with _client(worker, B_TOKEN) as b:
        assert not b.exists("b/k")


def test_the_tenants_file_must_be_private_and_sound(tmp_path: Path) -> None:
    ok = {"a": {"token": A_TOKEN, "quota_bytes": 10}}
    assert load_tenants(_tenants_file(tmp_path, ok))["a"].quota_bytes == 10
    with pytest.raises(ConfigError, match="0600"):
        load_tenants(_tenants_file(tmp_path, ok, 0o644))
    for bad in ({"a/b": {"token": A_TOKEN}}, {"a": {"token": "short"}}, {"a": {"token": A_TOKEN, "quota_bytes": -1}},
                {"a": {"token": A_TOKEN}, "b": {"token": A_TOKEN}}, {"": {"token": A_TOKEN}}):
        with pytest.raises(ConfigError):
            load_tenants(_tenants_file(tmp_path, bad))
    with pytest.raises(ConfigError, match="pool token"):
        load_tenants(_tenants_file(tmp_path, ok), pool_token=A_TOKEN)
    os.chmod(tmp_path / "tenants.json", 0o600)


def test_a_worker_refuses_a_world_readable_tenants_file(tmp_path: Path, spawn: Callable[..., WorkerProcess]) -> None:
    path = _tenants_file(tmp_path, {"a": {"token": A_TOKEN}}, 0o644)
    with pytest.raises(PoolUnavailable, match="0600"):
        spawn(extra=["--tenants", str(path)])


def test_a_restarted_worker_counts_the_tenant_blocks_on_its_ssd(tmp_path: Path) -> None:
    path = _tenants_file(tmp_path, {"a": {"token": A_TOKEN, "quota_bytes": QUOTA}})
    for attempt in range(2):
        w = WorkerProcess(tmp_path / "w", ssd=True, dram_bytes="64MiB", extra=["--tenants", str(path)]).wait_ready()
        try:
            with _client(w, A_TOKEN) as a:
                if attempt == 0:
                    for i in range(QUOTA // len(BLOCK)):
                        a.put(f"a/{i}", BLOCK)
                else:  # the blocks came back from SSD, and still fill the quota
                    assert a.get("a/0") == BLOCK
                    with pytest.raises(QuotaExceeded):
                        a.put("a/over", BLOCK)
        finally:
            w.stop(timeout=10)


def test_a_refused_frame_of_a_put_leaves_no_reply_for_the_next(worker: WorkerProcess) -> None:
    """A batch sent in several frames whose first is refused: the error is raised as that frame's answer
    arrives, the later frames' answers still due. The connection is dropped with them (a NamespaceError
    is an AuthError), so the next put does not take one of them for its own."""
    block = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    keys = ["a/not-b's"] + [f"b/k{i}" for i in range(11)]  # 12 MiB: frames of 3 MiB, the first refused
    with _client(worker, B_TOKEN) as b:
        with pytest.raises(NamespaceError):
            b.batch_put(keys, [block] * len(keys))
        b.put("b/after", b"the next put's bytes")
        assert b.get("b/after") == b"the next put's bytes"

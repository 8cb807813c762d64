"""Adversarial checks of tenant tokens through the ops the client API does not send the way an attacker
would: raw SUPERSEDE, PIN (one-way: refused silently), CHANGES (a peer's op), a CLEAR whose prefix
lacks the namespace's slash, and puts raced from many connections at once against the quota.
(tests/security/test_tenant_namespaces.py covers GET/EXISTS/REMOVE/CLEAR/PUT through the client.)"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import QuotaExceeded
from kvpool.core.server import Worker
from kvpool.core.transport import connect

POOL = "the-pool-token-" + "p" * 40
A_TOKEN = "tenant-a-token-" + "a" * 32
B_TOKEN = "tenant-b-token-" + "b" * 32
QUOTA = 64 << 10
BLOCK = b"x" * (8 << 10)


@pytest.fixture
def worker(tmp_path: Path) -> Worker:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"a": {"token": A_TOKEN, "quota_bytes": QUOTA}, "b": {"token": B_TOKEN}}))
    tenants.chmod(0o600)
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), token=POOL, tenants_file=str(tenants)),
               CacheConfig(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False)).start()
    yield w  # type: ignore[misc]
    w.stop()


def _raw(w: Worker, token: str):  # type: ignore[no-untyped-def]
    return connect(w.address, token, 5)


def test_a_tenant_cannot_supersede_pin_or_list_changes_outside_its_namespace(worker: Worker) -> None:
    with PoolClient(mode="local", worker=worker.address, token=B_TOKEN) as b:
        b.put("b/k", b"tenant b's block", pin_s=60)
    pins = worker.cache._dram.pins
    assert pins.holds(b"b/k")
    conn = _raw(worker, A_TOKEN)
    try:
        with conn._session():
            sock = conn._sock
            assert sock is not None
            far = np.array([(1 << 63) - 1], dtype="<u8")
            P.send_frame(sock, P.Op.SUPERSEDE, P.pack_batch([b"b/k"], far))  # one-way: dropped
            P.send_frame(sock, P.Op.PIN, P.pack_batch([b"b/k"], np.array([-1.0], "<f8")))  # an unpin of b's
            P.send_frame(sock, P.Op.CHANGES, P.pack_json({"since_ms": 0}))
            reply = P.recv_frame(sock)
            assert reply.status == P.Status.FORBIDDEN and b"b/k" not in reply.meta
            P.send_frame(sock, P.Op.CLEAR, P.pack_batch([b"a"]))  # "a" is not "a/": it would cover "ab/..."
            assert P.recv_frame(sock).status == P.Status.FORBIDDEN
            P.send_frame(sock, P.Op.PREFIX, P.pack_batch([b"a/x", b"b/k"]))
            assert P.recv_frame(sock).status == P.Status.FORBIDDEN
            P.send_frame(sock, P.Op.STATS)
            stats = P.unpack_json(P.recv_frame(sock).meta)
            assert b"b/k" not in json.dumps(stats).encode() and stats["tenant"]["tenant"] == "a"
    finally:
        conn.close()
    with PoolClient(mode="local", worker=worker.address, token=B_TOKEN) as b:
        assert b.get("b/k") == b"tenant b's block"
    assert pins.holds(b"b/k")


def test_puts_raced_from_many_connections_stay_within_the_quota(worker: Worker) -> None:
    stored: list[str] = []
    lock = threading.Lock()

    def writer(n: int) -> None:
        with PoolClient(mode="local", worker=worker.address, token=A_TOKEN, timeout_s=10) as a:
            for i in range(QUOTA // len(BLOCK)):
                key = f"a/{n}/{i}"
                try:
                    a.put(key, BLOCK)
                except QuotaExceeded:
                    continue
                with lock:
                    stored.append(key)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(stored) * len(BLOCK) <= QUOTA
    assert worker.tenant_usage.usage(worker.tenants["a"])["used_bytes"] <= QUOTA
    with PoolClient(mode="local", worker=worker.address, token=A_TOKEN) as a:
        assert sum(a.batch_exists(stored)) == len(stored)

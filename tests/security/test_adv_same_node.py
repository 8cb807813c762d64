"""Adversarial checks of a worker against a malicious or buggy client on its own node (its Unix socket,
raw frames of `kvpool.core.protocol`) and against tenants (tenant tokens over TCP): what one client
holds (reservations, connections) must not starve the worker's other clients.

Each test names the bug it shows; each fails on the code it was written against."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from rawhelp import A_TOKEN, B_TOKEN, MIB, POOL, SMALL, tcp_socket, tenant_worker, unix_socket

from kvpool.core import protocol as P
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.server import Worker


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    w = tenant_worker(tmp_path)
    yield w
    w.stop()




def _stalled_put(sock: socket.socket, prefix: bytes, n: int) -> None:
    """The header and metadata of a PUT of `n` blocks of 1 MiB, and none of its bytes (a client that
    stalls, or is paused, mid-put)."""
    keys = [prefix + b"%d" % i for i in range(n)]
    meta = P.pack_batch(keys, np.full(n, MIB, "<i8"), np.zeros(n, "<u8"), np.zeros(n, "<u8"))
    sock.sendall(P.header(P.Op.PUT, 0, 1, meta, n * MIB) + meta)


# Bug: a PUT frame reserves a slot for every one of its blocks before any byte arrives
# (worker_ops._put -> cache.reserve_many), with no per-connection bound: one stalled PUT header holds
# the whole arena for io_timeout_s (30 s) and every other client's put fails with CapacityError meanwhile.
# Over the Unix socket this breaks README's "a same-node connection holds at most 1/8 of the arena reserved
# and not yet committed" (ALLOC keeps to it, PUT does not); over TCP a tenant does it with no bytes sent.
@pytest.mark.parametrize("via", ["same-node", "tenant"])
def test_a_stalled_put_header_does_not_reserve_the_whole_arena(worker: Worker, via: str) -> None:
    hog = unix_socket(worker) if via == "same-node" else tcp_socket(worker, B_TOKEN)
    try:
        _stalled_put(hog, b"b/hog", 40)  # 40 MiB claimed of a 32 MiB arena
        time.sleep(0.5)  # the worker has read the header by now
        held = worker.cache.stats().dram_bytes
        honest = worker.unix_path if via == "same-node" else worker.address
        outcome: object = True
        with PoolClient(mode="local", worker=honest, token=None if via == "same-node" else A_TOKEN,
                        timeout_s=5) as c:
            keys = [f"a/honest{i}" for i in range(4)]
            try:
                c.batch_put(keys, [bytes([i]) * MIB for i in range(4)])  # 4 MiB: an eighth of the arena
                assert c.get("a/honest3") == bytes([3]) * MIB
            except Exception as e:  # what the honest client gets is the finding
                outcome = repr(e)
        assert held <= 2 * worker.max_reserve and outcome is True, (
            f"one stalled PUT holds {held >> 20} MiB of slots reserved (max_reserve {worker.max_reserve >> 20} MiB); "
            f"an honest put meanwhile: {outcome}")
    finally:
        hog.close()


# Bug: max_connections (worker_serving._admit) counts every authenticated connection alike, Unix and TCP,
# tenants included, and idle connections may wait for ever: one tenant holding max_connections idle TCP
# connections locks every other client out (other tenants, the pool token, the worker's own user's
# same-node clients), for as long as it likes. Only strangers are kept from this (max_unauthenticated).
def test_one_tenant_cannot_lock_every_other_client_out_with_idle_connections(tmp_path: Path) -> None:
    w = tenant_worker(tmp_path, max_connections=8)
    hogs: list[socket.socket] = []
    try:
        for _ in range(8):
            try:
                hogs.append(tcp_socket(w, B_TOKEN))
            except Exception:  # refused: a per-tenant bound, what this test asks for
                break
        served: dict[str, object] = {}
        for who, address, token in (("same-node", w.unix_path, None), ("pool token", w.address, POOL),
                                    ("tenant a", w.address, A_TOKEN)):
            try:
                with PoolClient(mode="local", worker=address, token=token, timeout_s=5) as c:
                    c.put("a/k", b"v")
                    served[who] = c.get("a/k") == b"v"
            except Exception as e:
                served[who] = repr(e)
        assert served == {"same-node": True, "pool token": True, "tenant a": True}, (
            f"tenant b holds {len(hogs)} idle connections; the others got: {served}")
    finally:
        for s in hogs:
            s.close()
        w.stop()


# Bug: a tenant's quota counts the bytes it asks for (tenants.TenantUsage.charge), not the arena it takes:
# a 0-byte block costs 0 of the quota yet a 256-byte slot (RESERVE_FLOOR, the arena's smallest) and an index
# entry, so a tenant with a quota of 64 KiB stores unlimited blocks and evicts every other tenant's from DRAM
# (the hole `_alloc` closed for reservations by charging RESERVE_FLOOR a block). README: "quota_bytes bounds
# the bytes of the tenant's blocks on the worker"; "a tenant token ... stores at most its quota".
def test_a_tenants_empty_blocks_do_not_escape_its_quota(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"a": {"token": A_TOKEN, "quota_bytes": 64 << 10}, "b": {"token": B_TOKEN}}))
    tenants.chmod(0o600)
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), token=POOL,
                            tenants_file=str(tenants)), CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    try:
        b_keys = [f"b/{i}" for i in range(24)]
        with PoolClient(mode="local", worker=w.address, token=B_TOKEN, timeout_s=5) as b:
            b.batch_put(b_keys, [bytes([i]) * MIB for i in range(24)])  # 3/4 of the arena
        with PoolClient(mode="local", worker=w.address, token=A_TOKEN, timeout_s=30) as a:
            keys = [f"a/{i}" for i in range(P.MAX_BATCH)]  # 65,536 empty blocks: 16 MiB of 256-byte slots
            try:
                a.batch_put(keys, [b""] * len(keys))
            except Exception:  # QuotaExceeded (a CapacityError): the quota holds
                pass
            stored = sum(a.batch_exists(keys))
        with PoolClient(mode="local", worker=w.address, token=B_TOKEN, timeout_s=5) as b:
            kept = sum(b.batch_exists(b_keys))
        assert kept == len(b_keys), (
            f"tenant a (quota 64 KiB) stored {stored} empty blocks ({stored * P.RESERVE_FLOOR >> 20} MiB of slots) "
            f"and evicted {len(b_keys) - kept} of tenant b's 24 blocks of 1 MiB")
    finally:
        w.stop()

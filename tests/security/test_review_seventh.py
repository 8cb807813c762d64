"""Seventh review: adversarial checks of the day's fixes to the worker's PUT (slots reserved a run at a
time within `max_reserve`), the tenants' connection caps and the tenants' quota floor.

Each test names the bug it shows; each fails on the code it was written against."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from rawhelp import A_TOKEN, B_TOKEN, MIB, POOL, SMALL, tcp_socket, tenant_worker, tenants_file, unix_socket

from kvpool.core import protocol as P
from kvpool.core.blocks import checksum
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.nats_server import NatsServer
from kvpool.core.server import Worker


def _put_header(sock: socket.socket, keys: list[bytes], blocks: list[bytes]) -> None:
    """A PUT frame's header and metadata (correct sizes and checksums), none of its bytes."""
    n = len(keys)
    meta = P.pack_batch(keys, np.array([len(b) for b in blocks], "<i8"),
                        np.array([checksum(b) for b in blocks], "<u8"), np.zeros(n, "<u8"))
    sock.sendall(P.header(P.Op.PUT, 0, 1, meta, sum(len(b) for b in blocks)) + meta)


def _until(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    w = tenant_worker(tmp_path)
    yield w
    w.stop()


# Bug: a PUT's runs are reserved within max_reserve (worker_ops._put_runs) without counting what the same
# connection holds ALLOCated and not committed (conn.reserved, which _alloc's budget subtracts): a same-node
# connection that ALLOCs its share then stalls a PUT header holds twice README's "at most 1/8 of the arena
# reserved and not yet committed".
def test_alloc_then_a_stalled_put_stays_within_the_connections_share(worker: Worker) -> None:
    s = unix_socket(worker)
    try:
        n = 3  # 3 x (1 MiB + 256) within max_reserve (4 MiB)
        keys = [b"alloc%d" % i for i in range(n)]
        s.sendall(P.header(P.Op.ALLOC, 0, 1, meta := P.pack_batch(keys, np.full(n, MIB, "<i8")), 0) + meta)
        reply = P.recv_frame(s)
        offsets = np.frombuffer(reply.meta, "<i8")
        assert reply.status == P.Status.OK and (offsets >= 0).all(), offsets
        blocks = [bytes([i]) * MIB for i in range(4)]
        _put_header(s, [b"put%d" % i for i in range(4)], blocks)  # its first run: 3 MiB more
        time.sleep(0.5)  # the worker has read the header and reserved the run
        held = worker.cache.stats().dram_bytes
        assert held <= worker.max_reserve, (
            f"one same-node connection holds {held / MIB:.2f} MiB reserved and uncommitted (ALLOC, then a "
            f"stalled PUT); max_reserve is {worker.max_reserve / MIB:.2f} MiB")
    finally:
        s.close()


# Bug: a tenant's PUT is charged for its whole frame up front and settled only when the frame ends
# (worker_ops._put's finally), while each run's blocks reach `used` as that run commits: while a frame's
# later runs are awaited (up to io_timeout_s), its committed runs count twice, and the tenant's other puts
# are refused QuotaExceeded though what it stores and has under way stays within quota_bytes.
def test_a_frames_committed_runs_do_not_count_twice_against_the_quota(tmp_path: Path) -> None:
    quota = 12 * MIB
    w = tenant_worker(tmp_path, {"a": {"token": A_TOKEN, "quota_bytes": quota}})
    hog = tcp_socket(w, A_TOKEN)
    try:
        blocks = [bytes([i]) * MIB for i in range(8)]
        _put_header(hog, [b"a/big%d" % i for i in range(8)], blocks)  # 8 MiB charged: runs of 3 blocks
        hog.sendall(b"".join(blocks[:3]))  # the first run's bytes; the rest later (a slow link)
        assert _until(lambda: w.tenant_usage.usage(w.tenants["a"])["used_bytes"] == 3 * MIB)
        outcome: object = True
        with PoolClient(mode="local", worker=w.address, token=A_TOKEN, timeout_s=10) as a:
            try:  # 8 MiB under way + 3 MiB: 11 MiB of a 12 MiB quota
                a.batch_put([f"a/small{i}" for i in range(3)], [bytes([9]) * MIB] * 3)
            except Exception as e:
                outcome = repr(e)
        assert outcome is True, f"tenant a (quota 12 MiB, 8 MiB under way) putting 3 MiB more: {outcome}"
    finally:
        hog.close()
        w.stop()


# Bug: a tenant's connection refused for its share of max_connections (worker_ops._auth -> _tenant_crowd)
# is an AuthError, which a cluster client's fan-out does not take for an unreachable worker (fanout.FanOut.each
# catches PoolUnavailable only): one worker at the tenant's cap fails the tenant's whole batch with AuthError,
# the blocks its other workers hold included, where README promises "in cluster mode a dead or unreachable
# worker is a miss" (and a connection refused for max_connections itself is one).
def test_one_workers_tenant_cap_is_a_miss_not_a_failed_cluster_call(tmp_path: Path, nats: NatsServer) -> None:
    table = {"a": {"token": A_TOKEN}}
    workers = [Worker(WorkerConfig(port=0, unix_path=str(tmp_path / f"w{i}.sock"), token=POOL, nats_url=nats.url,
                                   node_id="another-node", worker_id=f"w{i}", heartbeat_s=0.5, max_connections=8,
                                   tenants_file=tenants_file(tmp_path, table)), CacheConfig(**SMALL)).start()
               for i in range(2)]
    hog: socket.socket | None = None
    try:
        keys = [f"a/k{i}" for i in range(16)]
        with PoolClient(mode="cluster", nats_url=nats.url, token=POOL, timeout_s=5) as pool:
            assert pool.wait_for_members(lambda m: len(m) == 2, 15)
            pool.batch_put(keys, [k.encode() for k in keys])
        on_w1 = {k for k in keys if workers[1].cache.get(k.encode()) is not None}
        assert on_w1 and len(on_w1) < len(keys)  # both workers hold some
        hog = tcp_socket(workers[0], A_TOKEN)  # tenant a's one connection to w0 (max_connections 8: its cap is 1)
        with PoolClient(mode="cluster", nats_url=nats.url, token=A_TOKEN, timeout_s=5) as a:
            assert a.wait_for_members(lambda m: len(m) == 2, 15)
            try:
                got: object = a.batch_exists(keys)
            except Exception as e:
                got = repr(e)
        assert isinstance(got, list) and {k for k, v in zip(keys, got) if v} >= on_w1, (
            f"tenant a's cluster batch_exists while w0 refuses it a connection (w1 holds {len(on_w1)} of the "
            f"keys): {got}")
    finally:
        if hog is not None:
            hog.close()
        for w in workers:
            w.stop()


# Bug: the worker id file's check (state_files._WORKER_ID, [A-Za-z0-9_.:@-]{1,128}) passes ids that are no
# key of the member bucket (NATS KV keys: [-/_=.A-Za-z0-9], no empty token): a damaged or hand-written id
# like `node:1` is not the StorageError naming the file that 3ceb8ea promises, but a PoolUnavailable
# blaming NATS ("cannot register 'node:1' at nats://..."; `a..b` after 30 s of retries, as if JetStream were down).
def test_an_id_file_the_member_bucket_cannot_take_is_a_storage_error(tmp_path: Path, nats: NatsServer) -> None:
    from kvpool.core.errors import StorageError
    ssd = tmp_path / "ssd"
    ssd.mkdir(mode=0o700)
    (ssd / "kvpool-worker-id").write_text("node:1\n")
    cfg = WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), nats_url=nats.url)
    try:
        w = Worker(cfg, CacheConfig(**SMALL, ssd_path=str(ssd))).start()  # type: ignore[arg-type]
    except Exception as e:
        got: object = e
    else:
        w.stop()
        got = f"started as {w.worker_id!r}"
    assert isinstance(got, StorageError) and "kvpool-worker-id" in str(got), (
        f"a worker whose id file holds 'node:1' (no member bucket key) got: {got!r}")


# Bug (low severity): state_files.stored_worker_id opens the id file O_RDONLY without O_NONBLOCK, so a FIFO in
# its place (3ceb8ea handles a folder, a link) blocks the worker's start for ever instead of a StorageError.
def test_a_fifo_in_place_of_the_id_file_is_a_storage_error_not_a_hang(tmp_path: Path) -> None:
    import os
    import threading

    from kvpool.core.errors import StorageError
    from kvpool.core.state_files import stored_worker_id
    path = tmp_path / "kvpool-worker-id"
    os.mkfifo(path, 0o600)
    out: list[object] = []

    def read() -> None:
        try:
            out.append(stored_worker_id(path))
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    hung = t.is_alive()
    if hung:  # let the blocked open go: a writer comes and goes
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not hung and isinstance(out[0], StorageError), f"hung: {hung}; got {out}"


# Bug: README (7789540): "one tenant's idle connections cannot shut out the others, nor the pool token's and
# same-node clients". worker_serving._admit refuses any new connection once authenticated plus waiting ones
# reach max_connections, before a waiting one is displaced (max_unauthenticated, 64 by default, is no
# smaller than max_connections here): a tenant holding its one connection and 7 that never AUTH (nothing
# but a TCP connect each, renewed every auth_timeout_s) shuts out same-node and pool-token clients.
def test_a_tenants_unauthenticated_connections_do_not_shut_out_the_rest(tmp_path: Path) -> None:
    w = tenant_worker(tmp_path, max_connections=8)
    hogs: list[socket.socket] = []
    try:
        hogs.append(tcp_socket(w, B_TOKEN))  # its share: max_connections / 8
        for _ in range(7):
            hogs.append(socket.create_connection(("127.0.0.1", w.port), timeout=10))
        assert _until(lambda: len(w.connections()) == 8)
        served: dict[str, object] = {}
        for who, address, token in (("same-node", w.unix_path, None), ("pool token", w.address, POOL)):
            try:
                with PoolClient(mode="local", worker=address, token=token, timeout_s=5) as c:
                    c.put("a/k", b"v")
                    served[who] = c.get("a/k") == b"v"
            except Exception as e:
                served[who] = repr(e)
        assert served == {"same-node": True, "pool token": True}, (
            f"tenant b holds 1 connection and 7 unauthenticated ones; the others got: {served}")
    finally:
        for s in hogs:
            s.close()
        w.stop()

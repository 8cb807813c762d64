"""Review of 1150f86 (a cluster put takes each owner's answer block by block), 8db2380 (device tier) and
4185bed (operations: config checks, the accept loop surviving a failed admission, `kvpool up` refusing
`--nats-url`): each test fails on a real bug."""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from fullhelp import A_TOKEN, POOL, SMALL, clock_put_back, held_newer_elsewhere, stop  # noqa: F401 (clock_put_back: autouse)

from kvpool.core import KVPoolError, cli
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import QuotaExceeded
from kvpool.core.nats_server import NatsServer
from kvpool.core.server import Worker


def _ssd_worker(tmp_path: Path, **worker: Any) -> Worker:
    return Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), no_auth=True, **worker),
                  CacheConfig(**SMALL, ssd_path=str(tmp_path / "ssd"), ssd_sync=False,  # type: ignore[arg-type]
                              ssd_map_size=64 << 20)).start()






# Bug (1150f86): ClusterBackend._put_as_of (core/cluster_backend.py) now takes an owner's refusals block by
# block, and any batch partly stored is a PartialPut: with one copy (R=1) and one owner, a tenant's batch
# that passes its quota half way is "N of M blocks were stored by no live worker that answered (one that did
# not answer in time may still store them)", a PoolUnavailable (HostIO: RPC_FAIL, "the pool cannot be
# reached"), where the same worker answering the same statuses in local mode raises QuotaExceeded, and
# where this commit's parent raised it too (README: "a block the worker refuses (CorruptBlock,
# CapacityError, QuotaExceeded) fails alone: the call raises the first failed block's error").
def test_a_tenant_put_past_its_quota_in_cluster_mode_raises_quota_exceeded_as_in_local_mode(
        tmp_path: Path, nats: NatsServer) -> None:
    """A tenant writes 8 blocks of 256 bytes with a quota of 1 KiB through a cluster client (one worker,
    one copy): the first four are stored, and the call says why the others were not, QuotaExceeded naming
    the first of them, not an outage of the pool."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"a": {"token": A_TOKEN, "quota_bytes": 1024}}))
    tenants.chmod(0o600)
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), token=POOL, tenants_file=str(tenants),
                            nats_url=nats.url, heartbeat_s=0.5, node_id="another-node"),  # (tenants are TCP's)
               CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="cluster", nats_url=nats.url, token=A_TOKEN, timeout_s=5) as a:
            assert a.wait_for_members(lambda m: len(m) == 1, 15)
            keys = [f"a/k{i}" for i in range(8)]
            try:
                a.batch_put(keys, [bytes([i]) * 256 for i in range(8)])
                got: object = "no error"
            except KVPoolError as e:
                got = e
            assert [a.exists(k) for k in keys] == [True] * 4 + [False] * 4
        assert isinstance(got, QuotaExceeded) and got.key == b"a/k4", \
            f"a put past the tenant's quota (one worker, one copy) raised {got!r}"
    finally:
        stop(w)


# Bug (worker_ops.py:205-212 and :481-484, left by 1150f86): a commit whose full disk refuses to delete
# the older SSD copy a block replaced raises StorageError from TieredCache._admit_many's `finally`
# (delete_replaced) after the batch is committed; the worker then answers ITEM_STORAGE ("stored, not
# durable") for every block of the run not refused, those it did NOT store because it holds a newer
# version (ITEM_SUPERSEDED) included. The client takes them for stored and never puts them again above
# that version (1150f86's "one held newer is put again before the full disk's StorageError is raised").
def test_a_later_cluster_put_replaces_a_block_held_newer_when_the_same_commit_meets_a_full_disk(
        tmp_path: Path, nats: NatsServer) -> None:
    """A user rewrites k1 (its older copy on SSD, the disk full) and k2 (another writer whose clock runs
    ahead put it before) in one batch: the put may say the change is not durable, but reading k2 back
    must give what this later put wrote, as it does when the disk is not full."""
    w = _ssd_worker(tmp_path, nats_url=nats.url, heartbeat_s=0.5)
    ssd = w.cache._stack.ssd
    try:
        with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as c:
            assert c.wait_for_members(lambda m: len(m) == 1, 15)
            c.put("k1", b"1" * 64)
            w.cache.flush()  # k1's older copy on SSD: replacing it deletes that copy
            held_newer_elsewhere(w, "k2", b"O" * 64)
            ssd.delete_stale = lambda *a, **k: False  # the disk is full: the older copy cannot go
            try:
                c.batch_put(["k1", "k2"], [b"N" * 64, b"M" * 64])
            except KVPoolError:
                pass  # StorageError: k1's change is not durable (said; the test is about k2)
            finally:
                del ssd.delete_stale
            got = c.get("k2")
        assert got == b"M" * 64, f"k2 reads {got[:4]!r}...: the earlier put, not this later one"
    finally:
        stop(w)


# Bug (connection.py:392, Connection.batch_put; left by 1150f86, which fixed the cluster client only):
# `put_as_of` raises the first failed block's error (put_outcome), the StorageError of a block stored
# not durable included, before the blocks the worker holds newer (ITEM_SUPERSEDED, told in the same
# answer) are put again above that version: a local-mode put over a full disk leaves them unwritten.
def test_a_local_put_over_a_full_disk_still_replaces_a_block_held_newer(tmp_path: Path, arena_only: None) -> None:
    """Same-node client, blocks of 512 KiB (each its own part: the worker answers k1 ITEM_STORAGE and
    k2 ITEM_SUPERSEDED): k2, written before by another writer whose clock runs ahead, must read back as
    this later put wrote it, full disk or not."""
    block = 512 << 10
    w = _ssd_worker(tmp_path)
    ssd = w.cache._stack.ssd
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=5) as c:
            c.put("k1", b"1" * 64)
            w.cache.flush()
            held_newer_elsewhere(w, "k2", b"O" * block)
            ssd.delete_stale = lambda *a, **k: False
            try:
                c.batch_put(["k1", "k2"], [b"N" * block, b"M" * block])
            except KVPoolError:
                pass  # StorageError: k1's change is not durable
            finally:
                del ssd.delete_stale
            got = c.get("k2")
        assert got == b"M" * block, f"k2 reads {got[:4]!r}...: the earlier put, not this later one"
    finally:
        stop(w)


def _failing_conn_threads(monkeypatch: pytest.MonkeyPatch, n: int) -> list[int]:
    """The next `n` connection threads a worker starts fail to start (no thread left: a pids cgroup, ulimit
    -u), as `Thread.start` fails then; returns the count still to fail."""
    real = threading.Thread.start
    left = [n]

    def start(self: threading.Thread) -> None:
        if self.name == "kvpool-conn" and left[0] > 0:
            left[0] -= 1
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return left


def _connect_until_failed(w: Worker, left: list[int]) -> None:
    while left[0]:
        try:
            with PoolClient(mode="local", worker=w.address, timeout_s=2) as c:
                c.put("x", b"x")
        except KVPoolError:
            pass  # closed by the worker: its thread could not start


# Bug (4185bed, worker_serving.py _accept_loop/_admit): the accept loop now survives an exception from
# `_admit`, closing the socket, but `_admit` raises from `t.start()` AFTER adding the Conn to `_conns` and
# the thread to `_threads`: the dead connection stays counted toward max_connections for good (the worker
# refuses everyone once as many admissions failed), ...
def test_a_connection_whose_thread_could_not_start_does_not_keep_its_slot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two connections fail (no thread could be started for them) on a worker of max_connections=2; once
    threads can be started again, a client is served."""
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), no_auth=True, max_connections=2),
               CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    try:
        _connect_until_failed(w, _failing_conn_threads(monkeypatch, 2))
        try:
            with PoolClient(mode="local", worker=w.address, timeout_s=2) as c:
                c.put("k", b"v" * 64)
                got: object = c.get("k")
        except KVPoolError as e:
            got = e
        assert got == b"v" * 64, f"a worker serving no one refuses a client: {got!r}"
    finally:
        stop(w, timeout=0.5)


# ... and stop() waits its whole timeout for that connection to go (_drain_connections), then raises
# RuntimeError("cannot join thread before it is started") joining its thread: the cache is neither flushed
# nor closed (its shared-memory arena stays in /dev/shm), the worker is not deregistered cleanly.
def test_a_worker_stops_cleanly_after_a_connection_thread_failed_to_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One connection's thread cannot be started; the worker's stop then completes without an error."""
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), no_auth=True),
               CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    _connect_until_failed(w, _failing_conn_threads(monkeypatch, 1))
    err = stop(w, timeout=0.5)
    assert err is None, f"worker.stop() raised {err!r}"


# Bug (4185bed, config.py WorkerConfig.__post_init__): the new timeout check takes any finite number above
# 0, but `_admit` packs io_timeout_s into a C `long` (struct.pack("ll", ...)) for SO_RCVTIMEO/SO_SNDTIMEO:
# from 2**63 s (9.2e18) it raises struct.error, which the accept loop now swallows per connection. A
# worker started with io_timeout_s=1e19 ("never") starts, registers, looks healthy, and closes every
# connection it accepts.
def test_an_io_timeout_the_config_accepts_lets_clients_in(tmp_path: Path) -> None:
    """io_timeout_s=1e19 is either refused when the worker is configured (ConfigError) or the worker
    serves its clients."""
    try:
        cfg = WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), no_auth=True, io_timeout_s=1e19)
    except KVPoolError:
        return  # refused: what a user can act on
    w = Worker(cfg, CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    try:
        try:
            with PoolClient(mode="local", worker=w.address, timeout_s=2) as c:
                c.put("k", b"v")
                got: object = c.get("k")
        except KVPoolError as e:
            got = e
        assert got == b"v", f"io_timeout_s=1e19 passed WorkerConfig; the worker then refuses every client: {got!r}"
    finally:
        stop(w)


# Bug (4185bed, cli.py _secrets_out_of_sight): the command is taken to be the first argument not starting
# with '-' ("the top level's options take no value"), but a secret-bearing option given before the command
# has a value: `kvpool --nats-url nats://u:p@host:4222 up` takes the URL for the command, moves it to
# KVPOOL_NATS_URL and runs `kvpool up` again, which starts its own NATS and ignores it in silence (what
# 4185bed makes `kvpool up --nats-url ...` refuse; argparse alone would refuse it too).
def test_kvpool_up_refuses_a_nats_url_given_before_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvpool --nats-url nats://kvpool:hunter2@10.0.0.1:4222 up` is a usage error, as `kvpool up --nats-url
    ...` is, not a `kvpool up` that starts its own NATS and ignores the URL it was given."""
    ran: dict[str, Any] = {}

    def execve(path: str, args: list[str], env: dict[str, str]) -> None:
        ran["args"] = args
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(sys, "argv", ["kvpool", "--nats-url", "nats://kvpool:hunter2@10.0.0.1:4222", "up"])
    with pytest.raises(SystemExit):
        cli.main()
    if "args" in ran:  # run again with the URL in its environment: what that run parses
        rerun = ran["args"][3:]
        try:
            cli.build_parser().parse_args(rerun)
            refused = False
        except SystemExit:
            refused = True
        assert refused, f"`kvpool up` runs again as {rerun} (the URL in KVPOOL_NATS_URL, which up ignores)"

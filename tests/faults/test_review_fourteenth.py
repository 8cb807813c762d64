"""Review of 3f9977f (puts on a full disk: blocks held newer put again before the StorageError; a cluster
put's refusals deferred; config timeouts bounded; `kvpool --nats-url URL up` refused): each test fails on
a real bug."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from fullhelp import A_TOKEN, POOL, SMALL, clock_put_back, held_newer_elsewhere, stop  # noqa: F401 (clock_put_back: autouse)

from kvpool.core import KVPoolError, cli
from kvpool.core.client import PoolClient
from kvpool.core.cluster import rank
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import PartialPut, PoolUnavailable, QuotaExceeded
from kvpool.core.nats_server import NatsServer
from kvpool.core.server import Worker
from kvpool.core.transport import TcpTransport


# Bug (connection.py:393-401, Connection.batch_put): the blocks the worker held newer are put again
# (`put_as_of`) before the first refusal of the first answer is raised; that re-put raises its own
# StorageError (the re-put block's older SSD copy a full disk kept) straight out, so the refusal of
# another block of the batch (QuotaExceeded, CapacityError, CorruptBlock: "nothing was stored") is lost
# and the caller is told StorageError ("stored, not durable") for a batch one block of which is not
# stored at all. The cluster client (cluster_backend.py batch_put) defers both and raises the refusal.
def test_a_refused_block_is_still_reported_when_the_reput_of_a_block_held_newer_meets_a_full_disk(
        tmp_path: Path) -> None:
    """A tenant (quota 1 KiB) puts a/big (2 KiB: over its quota) and a/k1 (which another writer whose
    clock runs ahead wrote last, its older SSD copy kept by a full disk) in one batch over TCP: a/big is
    not stored, so the call must raise QuotaExceeded naming it, not a StorageError that says the batch
    was stored."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"a": {"token": A_TOKEN, "quota_bytes": 1024}}))
    tenants.chmod(0o600)
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), token=POOL, tenants_file=str(tenants)),
               CacheConfig(**SMALL, ssd_path=str(tmp_path / "ssd"), ssd_sync=False,  # type: ignore[arg-type]
                           ssd_map_size=64 << 20)).start()
    ssd = w.cache._stack.ssd
    try:
        with PoolClient(mode="local", worker=w.address, token=A_TOKEN, timeout_s=5) as c:
            c.put("a/k1", b"1" * 64)
            w.cache.flush()  # a/k1's copy on SSD
            ssd.delete_stale = lambda *a, **k: False  # the disk is full: older copies cannot go
            try:
                held_newer_elsewhere(w, "a/k1", b"O" * 64)
                try:
                    c.batch_put(["a/big", "a/k1"], [b"B" * 2048, b"M" * 64])
                    got: object = "no error"
                except KVPoolError as e:
                    got = e
            finally:
                del ssd.delete_stale
            stored_big = c.exists("a/big")
        assert not stored_big
        assert isinstance(got, QuotaExceeded) and got.key == b"a/big", \
            f"a/big was not stored, yet the put raised {got!r}"
    finally:
        stop(w)


# Bug (cluster_backend.py:249-259, ClusterBackend.batch_put): the refusal of a block every owner refused is
# now kept in `deferred` for after the re-put of the blocks held newer; a re-put whose owner does not
# answer raises PartialPut from there, `failed` naming the re-put blocks only, and the deferred refusal is
# dropped: the block refused is reported stored (not in `failed`). Before 3f9977f the first pass raised
# PartialPut(failed=[refused, held newer]) at once.
def test_a_block_every_owner_refused_is_among_the_failed_when_the_reput_meets_a_lost_worker(
        tmp_path: Path, nats: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant (quota 1 KiB, one copy, two workers) puts a/big (over its quota) and a key another writer
    whose clock runs ahead wrote last, both owned by one worker, which is lost before the second key's
    put again: whatever the call raises, it must not tell a/big stored (QuotaExceeded for it, or a
    PartialPut whose `failed` names it)."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"a": {"token": A_TOKEN, "quota_bytes": 1024}}))
    tenants.chmod(0o600)
    ws = [Worker(WorkerConfig(port=0, unix_path=str(tmp_path / f"w{i}.sock"), token=POOL, tenants_file=str(tenants),
                              nats_url=nats.url, heartbeat_s=0.5, node_id="another-node"),
                 CacheConfig(**SMALL)).start() for i in range(2)]  # type: ignore[arg-type]
    try:
        with PoolClient(mode="cluster", nats_url=nats.url, token=A_TOKEN, timeout_s=5) as c:
            assert c.wait_for_members(lambda m: len(m) == 2, 15)
            ids = sorted(c.members())
            first = {w.worker_id: w for w in ws}
            owner = lambda k: rank(k.encode(), ids)[0]  # noqa: E731
            keys = [f"a/k{i}" for i in range(64)]
            big = next(k for k in keys if owner(k) == ids[0])
            held = next(k for k in keys if owner(k) == ids[0] and k != big)
            elsewhere = next(k for k in keys if owner(k) == ids[1])
            held_newer_elsewhere(first[ids[0]], held, b"O" * 64)
            c.put(elsewhere, b"e" * 64)  # the other worker answers: the pool is reachable
            real = TcpTransport.put_statuses

            def put_statuses(self: TcpTransport, keys: Any, *a: Any) -> list[int]:
                if list(keys) == [held.encode()]:  # the put again: its worker is lost meanwhile
                    raise PoolUnavailable("the worker closed the connection")
                return real(self, keys, *a)

            monkeypatch.setattr(TcpTransport, "put_statuses", put_statuses)
            try:
                c.batch_put([big, held], [b"B" * 2048, b"M" * 64])
                got: object = "no error"
            except KVPoolError as e:
                got = e
        told = (isinstance(got, QuotaExceeded) and got.key == big.encode()) or \
            (isinstance(got, PartialPut) and 0 in got.failed)
        assert told, f"{big} was stored nowhere (over quota), yet the put raised {got!r} " \
                     f"(failed={getattr(got, 'failed', None)})"
    finally:
        for w in ws:
            stop(w)


# Bug (cli.py:307-308 with nats_creds.py:141-151 redacted_url): a --nats-url before the command (new in
# 3f9977f), or given to `up`, is left on the command line for the parser to refuse, "its password
# replaced by ***" by redacted_url; but redacted_url only redacts a URL with a scheme, and a URL without
# one ("user:password@host:4222", which nats-py takes: it adds nats://) keeps its password, which
# argparse prints in its error (and the process's argv shows). Before 3f9977f `kvpool --nats-url
# user:pw@host status` moved it to the environment.
@pytest.mark.parametrize("argv", [
    ["--nats-url", "kvpool:hunter2@10.0.0.1:4222", "status"],
    ["up", "--nats-url", "kvpool:hunter2@10.0.0.1:4222"],
], ids=["before-the-command", "up"])
def test_a_nats_password_without_a_scheme_is_never_printed_by_a_refused_command_line(
        argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvpool --nats-url kvpool:hunter2@10.0.0.1:4222 status` (or `kvpool up --nats-url ...`) may be
    refused, but neither its error nor the command line it runs with shows the password."""
    ran: dict[str, Any] = {}

    def execve(path: str, args: list[str], env: dict[str, str]) -> None:
        ran["args"] = args
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(sys, "argv", ["kvpool", *argv])
    with pytest.raises(SystemExit):
        cli.main()
    err = capsys.readouterr().err
    assert "hunter2" not in err, f"the refusal prints the password: {err.strip().splitlines()[-1]}"
    assert "hunter2" not in " ".join(ran.get("args", [])), f"run again as {ran['args']}"

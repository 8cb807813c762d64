"""Sixth adversarial review: the fixes of 20d9956 (Mooncake exact sizes, buffers.readable), ef6f76b
(PartialFailure of removes and clears), 400f2fb (a full disk refuses removes, clears and overwrites) and
f9614d9 (an SSD map smaller than its file)."""
from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path

import pytest

from kvpool.core import KVPoolError
from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from faulthelp import SMALL_DRAM, block, fill_then_full_disk, is_block_of


# Bug: a remove (or an overwriting put) refused on a full disk (StorageError: "not durable") has already
# unindexed the SSD copy (TierStack.remove / commit: ssd.forget, then delete_stale_now raises), so the
# caller's retry finds nothing on SSD to delete, skips delete_stale_now, and is acknowledged while the old
# copy is still in LMDB, queued in memory only: a kill -9 then serves the removed key / the older version.
@pytest.mark.parametrize("change", ["remove", "overwrite"])
def test_a_retry_of_a_change_refused_on_a_full_disk_is_not_acknowledged_until_durable(tmp_path: Path,
                                                                                      change: str) -> None:
    state = tmp_path / "w"
    worker = dict(ssd=True, dram_bytes="4MiB", env=SMALL_DRAM)
    size = 64 << 10
    keys = [f"d{i}" for i in range(300)]
    w = WorkerProcess(state, **worker).wait_ready()  # type: ignore[arg-type]
    acknowledged: list[str] = []
    refused = 0
    try:
        on_ssd = fill_then_full_disk(w, keys)
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            assert len(on_ssd) > 20, len(on_ssd)
        for _ in range(30):  # a client retries a refused change, as an engine would
            with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
                try:
                    if change == "remove":
                        c.batch_remove(on_ssd)  # (returns: every key is gone, as far as the pool says)
                    else:
                        c.batch_put(on_ssd, [block(k, size, 1) for k in on_ssd])
                    acknowledged = on_ssd
                    break
                except KVPoolError:
                    refused += 1
    finally:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.kill()
    assert refused >= 1, "the first try was acknowledged (test_adv_survival's bug, not this one)"
    if not acknowledged:  # every retry refused while the disk stays full: honest, nothing to undo
        assert refused == 30
        return
    w = WorkerProcess(state, **worker).wait_ready()  # type: ignore[arg-type]  (the disk has room again)
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            got = {k: c.get(k) for k in acknowledged}
    finally:
        w.stop()
    undone = [k for k, g in got.items() if g is not None and not is_block_of(k, g, 1)]
    assert undone == [], (f"{len(undone)} of {len(acknowledged)} keys whose retried "
                          f"{'removal' if change == 'remove' else 'overwrite'} was acknowledged served their "
                          f"older block after a kill -9 (after {refused} refusals)")


FAST_TTL = {"KVPOOL_MEMBER_TTL_S": "3", "KVPOOL_HEARTBEAT_S": "0.5"}


def _stale_or_back(c: PoolClient, newest: dict[str, int], removed: set[str]) -> tuple[int, list[str]]:
    """(hits, keys read at an older version or back though removed) of `newest`'s keys through `c`."""
    hits, wrong = 0, []
    for k, v in newest.items():
        g = c.get(k)
        if g is None:
            continue
        hits += 1
        if k in removed or not is_block_of(k, g, v):
            wrong.append(k)
    return hits, wrong


# Bug: a worker back from an absence that cannot learn what its peers changed meanwhile drops every block
# (Worker._catch_up -> cache.drop_all, logged "dropping its blocks (misses, never outdated bytes)"). On a
# full disk TierStack.clear now clears SSD first (400f2fb) and store.clear() raises before anything is
# dropped; the caller (Worker._rejoin / _settle) swallows the KVPoolError as "closed under it (stopping)"
# and lifts the fence: the worker serves every block it could not vouch for, the overwritten and removed
# keys at their old bytes (before 400f2fb DRAM and the SSD index were dropped before the raise: misses).
def test_a_worker_that_cannot_catch_up_on_a_full_disk_serves_no_outdated_bytes(nats, spawn) -> None:
    from kvpool.core.cluster import rank

    from faulthelp import poll, wait_members, worker_id
    from sigstop import freeze

    size = 64 << 10
    victim = spawn(nats_url=nats.url, node_id="node0", ssd=True, dram_bytes="4MiB", env={**FAST_TTL, **SMALL_DRAM})
    peer = spawn(nats_url=nats.url, node_id="node1", env=FAST_TTL)
    ids = [worker_id(victim), worker_id(peer)]
    keys = [f"h{i}" for i in range(240)]
    mine = [k for k in keys if rank(k.encode(), ids)[0] == ids[0]]
    newest = dict.fromkeys(mine, 0)
    removed: set[str] = set()
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="client", timeout_s=2.0) as c:
        wait_members(c, 2)
        for i in range(0, len(keys), 20):
            c.batch_put(keys[i:i + 20], [block(k, size) for k in keys[i:i + 20]])
        time.sleep(0.5)  # (the demoter's last batch)
        full = (Path(victim.state_dir) / "ssd" / "data.mdb").stat().st_size
        resource.prlimit(victim.proc.pid, resource.RLIMIT_FSIZE, (full, full))  # the victim's disk is full
        freeze(victim.proc.pid)
        try:
            wait_members(c, 1)  # the client dropped the victim: its keys go to the peer
            overwritten, gone = mine[0:80:4], mine[2:80:4]
            c.batch_put(overwritten, [block(k, size, 1) for k in overwritten])
            c.batch_remove(gone)
            newest.update(dict.fromkeys(overwritten, 1))
            removed.update(gone)
            peer.kill()  # the peer cannot tell the victim what changed (gone: its entry lapses meanwhile)
            time.sleep(float(FAST_TTL["KVPOOL_MEMBER_TTL_S"]) + 1)
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        decided = ("could not learn every change", "keeping its blocks", "outdated blocks dropped")
        assert poll(lambda: any(d in victim.log_tail() for d in decided), 20), victim.log_tail()
    seen: list[tuple[int, list[str]]] = []
    with PoolClient(mode="local", worker=victim.address, timeout_s=5) as direct:
        # (each of its fences, a stall's and a lapse's, ends with a catch-up that cannot reach the peer)
        poll(lambda: bool(seen.append(_stale_or_back(direct, newest, removed)) or seen[-1][1]), 5, every=0.5)
    hits, wrong = seen[-1]
    assert wrong == [], (f"{len(wrong)} of {len(mine)} keys served outdated or removed bytes ({hits} hits) by a "
                         f"worker that could not catch up: {victim.log_tail()[-1500:]}")


# Bug: a remove (or an overwriting put) refused on a full disk is a StorageError (an OSError) in the
# worker, which drops the connection: the adapters' HostIO takes it as an outage of the pool (status_of:
# PoolUnavailable / OSError -> RPC_FAIL, `_failed` starts one), so every later call of every engine
# thread reports RPC_FAIL / a miss for retry_s without asking the pool, though the worker serves: the
# blinding that ef6f76b removed for an unanswered delete, back for a full disk.
def test_a_remove_refused_on_a_full_disk_does_not_blind_the_mooncake_drop_in(tmp_path: Path) -> None:
    import numpy as np

    from kvpool.backends.mooncake_compat import MooncakeDistributedStore

    state = tmp_path / "w"
    size = 64 << 10
    keys = [f"d{i}" for i in range(300)]
    w = WorkerProcess(state, ssd=True, dram_bytes="4MiB", env=SMALL_DRAM).wait_ready()
    store = MooncakeDistributedStore()
    try:
        on_ssd = fill_then_full_disk(w, keys)
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            warm = keys[-1]
            assert c.get(warm) == block(warm, size)
        assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", w.address) == 0
        buf = np.zeros(size, dtype=np.uint8)
        assert store.register_buffer(buf.ctypes.data, size) == 0
        assert store.get_into(warm, buf.ctypes.data, size) == size
        refused = store.batch_remove(on_ssd)
        assert set(refused) != {0}, "the removes were acknowledged (nothing refused: nothing to check)"
        got = store.get_into(warm, buf.ctypes.data, size)  # the worker serves it all along
        assert got == size and bytes(buf) == block(warm, size), (
            f"a read right after a remove the full disk refused ({sorted(set(refused))}) answered {got}: the "
            "drop-in took the refusal for an outage of the pool")
    finally:
        store.close()
        w.kill()


def _odd_values() -> list[object]:
    import torch

    return [torch.empty(64, dtype=torch.uint8, device="meta"), torch.zeros(64, dtype=torch.uint8).untyped_storage(),
            torch.Size([64])]


# Bug: 20d9956 promises that a meta tensor (and any value that is not bytes-like) as a block's data is
# InvalidArgument, the drop-in's put -600; but a meta tensor passes _flat_bytes' try and fails in
# `flat.cpu()` after it (raw NotImplementedError, buffers.py _torch_host_bytes), and any other object of a
# torch module (a torch.UntypedStorage, a torch.Size) is taken for a tensor (`_is_torch` tests the module
# name) and raises a raw AttributeError (`.device` / `.detach`) into the engine.
@pytest.mark.parametrize("i", range(3), ids=["meta_tensor", "untyped_storage", "torch_size"])
def test_mooncake_put_of_a_meta_tensor_or_a_torch_non_tensor_is_a_status(monkeypatch: pytest.MonkeyPatch,
                                                                         i: int) -> None:
    from kvpool.backends._hostio import Status
    from kvpool.backends.mooncake_compat import MooncakeDistributedStore

    monkeypatch.setenv("KVPOOL_DRAM_SLAB_SIZE", "2MiB")
    monkeypatch.setenv("KVPOOL_PREFAULT", "false")
    value = _odd_values()[i]
    store = MooncakeDistributedStore()
    try:
        assert store.setup("h", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", "embedded") == 0
        assert store.put("k", value) == Status.INVALID_PARAMS
        assert store.put_batch(["k"], [value]) == Status.INVALID_PARAMS
    finally:
        store.close()


# Bug: the read side of 20d9956's fix: a destination that is an object or datetime64 array, a torch storage
# or a torch.Size raises a raw TypeError / ValueError / AttributeError out of buffers.Destination /
# destination_views (`memoryview(buf)`, `.view(np.uint8)`, `.is_contiguous()`, `.device`), not a
# KVPoolError (BufferSizeError / InvalidArgument) as a read-only or strided destination is.
@pytest.mark.parametrize("i", range(4), ids=["datetime64", "object", "untyped_storage", "torch_size"])
def test_a_get_into_a_destination_that_holds_no_plain_bytes_is_a_typed_error(i: int) -> None:
    import numpy as np

    dest = [np.empty(8, dtype="datetime64[s]"), np.empty(8, dtype=object), *_odd_values()[1:]][i]
    with PoolClient(mode="embedded", dram_bytes=4 << 20, dram_slab_size=1 << 20, prefault=False) as c:
        c.put("k", b"x" * 64)
        with pytest.raises(KVPoolError):
            c.batch_get_into(["k"], [dest])


_FULL_DISK_CLEAR = """
import os, resource, signal, sys, time
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit is EFBIG, as a full disk's ENOSPC)
from kvpool.core.client import PoolClient
c = PoolClient(mode="embedded", ssd_path=sys.argv[1], dram_bytes=4 << 20, dram_slab_size=1 << 20, prefault=False,
               ssd_map_size=256 << 20)
for i in range(0, 120, 20):
    c.batch_put([f"k{j}" for j in range(i, i + 20)], [os.urandom(64 << 10) for _ in range(20)])
c.backend.cache.flush()
full = os.stat(os.path.join(sys.argv[1], "data.mdb")).st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (full, resource.RLIM_INFINITY))  # the disk is full from here
try:
    c.clear()
    print("RESULT acknowledged")
except Exception as e:
    print("RESULT", type(e).__name__, e)
os._exit(0)
"""


# Bug: the README ("What survives what", the SSD tier fills) says a clear the full disk refuses is a
# StorageError, as a remove's is; an embedded pool's clear raises CapacityError (SsdStore.clear's
# `_write` translates LMDB's failure so, and TierStack.clear passes it on), which the adapters' HostIO
# reports as NO_AVAILABLE_HANDLE ("no room in the pool"), a remove's refusal as RPC_FAIL.
def test_an_embedded_clear_refused_on_a_full_disk_is_a_storage_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FULL_DISK_CLEAR, str(tmp_path / "ssd")], capture_output=True,
                         text=True, timeout=60)
    result = next((line for line in out.stdout.splitlines() if line.startswith("RESULT")), out.stderr[-2000:])
    assert result == "RESULT acknowledged" or result.startswith("RESULT StorageError"), result

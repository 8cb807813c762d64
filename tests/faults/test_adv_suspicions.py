"""Adversarial checks of earlier reviews' suspicions around a full disk (StorageError / ITEM_STORAGE):
a cluster put's missed-write bookkeeping, HostIO's per-item fallback, and an embedded put's pin."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kvpool.core import KVPoolError, PoolUnavailable
from kvpool.core.client import PoolClient

from faulthelp import SMALL_DRAM, block, fill_then_full_disk, is_block_of, poll, wait_members, worker_id

SIZE = 64 << 10
NO_ROOM = 8192
"""RLIMIT_FSIZE past a full disk: LMDB can write no page but its two meta pages, so every deletion of an
older SSD copy is refused (fill_then_full_disk's limit, at data.mdb's size, leaves some free pages)."""


def _no_room(pid: int) -> None:
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (NO_ROOM, NO_ROOM))


# Bug: with replicas, an owner's ITEM_STORAGE answer (stored, but a full disk kept the older SSD copy) is a
# StorageError raised out of the transport's put_as_of (connection.put_outcome -> raise_item). FanOut.each
# catches only PoolUnavailable, so it escapes `ClusterBackend._put_as_of` before `self._missed(...)`: the
# owner this client had taken as down (suspect) is never owed the removal of its older copy. It keeps it,
# and once the owner that took the write loses the block (evicted: the full disk takes no demotion), every
# reader is served the older bytes.
def test_an_owner_left_out_of_a_put_that_a_full_disk_refused_is_still_told_to_drop_its_older_copy(nats, spawn) \
        -> None:
    """A user rewrites a block (R=2) while this client cannot reach one owner and the other owner's disk is
    full: the put is refused as not durable (StorageError), but was applied; the unreachable owner must be
    owed the removal of its older copy, or that copy is served once the newer one is evicted."""
    full = spawn(nats_url=nats.url, node_id="n0", ssd=True, dram_bytes="4MiB", env=SMALL_DRAM)
    other = spawn(nats_url=nats.url, node_id="n1", dram_bytes="16MiB", env=SMALL_DRAM)
    keys = [f"d{i}" for i in range(300)]
    on_ssd = fill_then_full_disk(full, keys)
    _no_room(full.proc.pid)
    key = on_ssd[0]
    with PoolClient(mode="local", worker=other.address, timeout_s=10) as direct:
        direct.put(key, block(key, SIZE, 0))  # the other owner's copy: older than the rewrite below
    other_id = worker_id(other)
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, timeout_s=5, node_id="client") as c:
        wait_members(c, 2)
        # this client's last call to `other` failed (a partition between the two): it is taken as down
        c.backend.fanout.failed(other_id, c.members()[other_id].incarnation, PoolUnavailable("cut off"))
        try:
            c.put(key, block(key, SIZE, 1))
        except KVPoolError:
            pass  # StorageError: stored on `full`, not durable there; said, and no more is asked of it
        owed = c.backend.missed.pending()
        # the removal owed goes to `other` at once (its delivery asks suspects too): given time to land
        poll(lambda: c.backend.missed.pending() == 0 and c.backend.missed.delivered > 0, 3.0)
    with PoolClient(mode="local", worker=full.address, timeout_s=10) as direct:
        for i in range(0, 120, 20):  # the newer block is evicted (the full disk takes no demotion)
            direct.batch_put([f"e{i + j}" for j in range(20)], [block(f"e{i + j}", SIZE) for j in range(20)])
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, timeout_s=5, node_id="reader") as r:
        wait_members(r, 2)
        got = r.get(key)
    assert owed >= 1, "the owner left out of the put is owed nothing (the StorageError escaped _put_as_of)"
    assert got is None or is_block_of(key, got, 1), "a reader was served the block's older version"


# Bug: HostIO._per_item (backends/_hostio.py) takes an error that names a key (`KVPoolError.key`) as that
# key's fault: it fails that key alone and puts the rest of the batch again. A full disk's StorageError
# names the first block answered ITEM_STORAGE, but the worker answers ITEM_STORAGE for every block of the
# run (worker_ops: status[status == 0] = ITEM_STORAGE), all of them stored already: each retry is refused
# for its first key again, so a batch of n keys costs n calls and n(n+1)/2 block puts.
def test_a_full_disk_does_not_make_a_backend_batch_put_quadratic(tmp_path: Path) -> None:
    """An engine (FastDeploy store) writes a batch over blocks a worker has on SSD while its disk is full:
    the batch is answered in a bounded number of pool calls, not one call per key re-sending the rest."""
    import numpy as np

    from kvpool.backends.fastdeploy import KVPoolStore
    from kvpool.core.procs import WorkerProcess

    w = WorkerProcess(tmp_path / "w", ssd=True, dram_bytes="4MiB", env=SMALL_DRAM).wait_ready()  # type: ignore[arg-type]
    try:
        on_ssd = fill_then_full_disk(w, [f"m/tp1/d{i}" for i in range(300)])
        _no_room(w.proc.pid)
        names = [k[len("m/tp1/"):] for k in on_ssd][:40]
        n = len(names)
        assert n >= 20, n
        src = np.zeros(n * SIZE, dtype=np.uint8)
        ptr = int(src.ctypes.data)
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as pool:
            store = KVPoolStore("m", client=pool)
            store.register_buffer(ptr, src.nbytes)
            calls: list[int] = []
            real = pool.batch_put
            pool.batch_put = lambda k, b, **kw: (calls.append(len(k)), real(k, b, **kw))[1]  # type: ignore[method-assign]
            store.batch_set(names, [ptr + i * SIZE for i in range(n)], [SIZE] * n)
    finally:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.kill()
    assert len(calls) <= 3 and sum(calls) <= 2 * n, \
        f"{len(calls)} pool calls putting {sum(calls)} blocks for a batch of {n} keys ({calls[:5]}...)"


# An embedded cache on a disk with no room: fill its SSD tier, then overwrite a block that is on SSD only
# with a pin (`pin_s`), then push enough other blocks through DRAM to evict anything unpinned.
EMBEDDED = textwrap.dedent("""
    import json, os, resource, signal, sys, time
    sys.path.insert(0, sys.argv[2])
    from faulthelp import block
    from kvpool.core.cache import TieredCache
    from kvpool.core.errors import StorageError
    path, size = sys.argv[1], 64 << 10
    c = TieredCache(dram_bytes=4 << 20, dram_slab_size=1 << 20, prefault=False, ssd_path=path)
    keys = [f"d{i}" for i in range(120)]
    for k in keys:  # 7.5 MiB through a 4 MiB arena: most go to SSD
        c.put(k, block(k, size))
    time.sleep(0.5)  # (the demoter's last batch)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    key = next(k for k in keys if c.exists(k) and k.encode() not in c._dram.blocks)
    try:
        c.put(key, block(key, size, 1), pin_s=600)
        refused = ""
    except StorageError as e:
        refused = str(e)
    for i in range(120):  # 7.5 MiB more: every unpinned block of the first ones leaves DRAM
        c.put(f"x{i}", block(f"x{i}", size))
    got = c.get(key)
    print(json.dumps({"refused": refused, "got": None if got is None else got == block(key, size, 1)}))
    c.close()
""")


# Bug: TieredCache._commit (core/cache.py) pins the block only after `self._stack.delete_replaced()`; on a
# full disk that raises StorageError ("not durable: it holds until a restart") with the block committed and
# served, and the pin is skipped: the block is evicted like any other. A worker pins it (its PIN frame is a
# pending pin, claimed at commit), so only the embedded pool loses the pin; a retry fails the same way.
def test_a_pinned_put_refused_as_not_durable_on_a_full_disk_keeps_its_pin(tmp_path: Path) -> None:
    """An embedded-pool user puts a block with pin_s=600 over an SSD copy while the disk is full: the put
    says it is stored but not durable (StorageError); the block must still be pinned in DRAM, not be
    evicted seconds later by ordinary traffic."""
    here = str(Path(__file__).parent)
    run = subprocess.run([sys.executable, "-c", EMBEDDED, str(tmp_path / "ssd"), here], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["refused"], "the disk was not full: the overwrite was not refused (test setup)"
    assert out["got"] is True, f"the pinned block was evicted after its put was refused as not durable: {out}"

"""Adversarial checks of what survives what: a worker (or an embedded pool) with an SSD tier, killed or
stopped at chosen points, or started on state files and an LMDB environment damaged on disk. The
promise (README, "What survives what" and "The tiers"): never wrong or outdated bytes, never a crash
or a crash loop at start, a typed error where a start must refuse its state."""
from __future__ import annotations

import os
import resource
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvpool.core import KVPoolError, PoolUnavailable
from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from faulthelp import SMALL_DRAM, block, fill_then_full_disk, inproc_worker, is_block_of

_PAGE = 4096
_P_BRANCH, _P_LEAF = 0x01, 0x02


def _leaf_pages(data: bytes) -> list[int]:
    """The LMDB leaf pages of a data.mdb (a page header: pgno u64, pad u16, flags u16)."""
    out = []
    for pg in range(2, len(data) // _PAGE):
        pgno, _pad, flags = struct.unpack_from("<QHH", data, pg * _PAGE)
        if pgno == pg and flags == _P_LEAF:
            out.append(pg)
    return out


def _fill_small_and_stop(state: Path, keys: list[str], size: int) -> None:
    """A worker's SSD tier of many small blocks (inline in LMDB's leaf pages), stopped cleanly."""
    w = WorkerProcess(state, ssd=True, dram_bytes="16MiB", env=SMALL_DRAM).wait_ready()
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            for i in range(0, len(keys), 100):
                c.batch_put(keys[i:i + 100], [block(k, size) for k in keys[i:i + 100]])
    finally:
        assert w.stop() == 0, w.log_tail()  # SIGTERM: DRAM flushed to the SSD tier


# Bug: a worker-id file beside the SSD tier that is not UTF-8 (a bit flip, a torn sector), or a folder in
# its place, kills every start with a raw UnicodeDecodeError / IsADirectoryError traceback
# (state_files.stored_worker_id reads outside its try), a crash loop.
@pytest.mark.parametrize("damage", ["not_utf8", "a_folder"])
def test_a_worker_id_file_of_garbage_is_a_typed_error_or_a_new_id_never_a_traceback(tmp_path: Path,
                                                                                     damage: str) -> None:
    ssd = tmp_path / "ssd"
    w = inproc_worker(tmp_path, ssd_path=str(ssd), dram_bytes=4 << 20, dram_slab_size=1 << 20,
                      ssd_map_size=64 << 20)
    w.stop()
    id_file = ssd / "kvpool-worker-id"
    if damage == "not_utf8":
        id_file.write_bytes(b"\xff\xfe\x00\x9c garbage \x80")
    else:
        id_file.unlink()
        id_file.mkdir()
    try:
        w = inproc_worker(tmp_path, ssd_path=str(ssd), dram_bytes=4 << 20, dram_slab_size=1 << 20,
                          ssd_map_size=64 << 20)
    except Exception as e:  # (what escapes is the point)
        assert isinstance(e, KVPoolError), f"a damaged worker-id file escaped as {type(e).__name__}: {e}"
    else:
        w.stop()


# Bug: an LMDB leaf page whose header is damaged (two bits of its flags) kills the worker with SIGABRT
# (an LMDB assertion in mdb_cursor_next) in the start's header scan (ssd_index.scan), at every start:
# a crash loop, where the README promises a StorageError at a start that must scan (with the index of a
# clean stop kept, the first start serves and a read of the damaged page may end it; the next start
# scans, and must refuse the tier, not die).
@pytest.mark.parametrize("index", ["gone", "kept"])
def test_a_damaged_lmdb_page_is_a_storage_error_or_a_miss_never_a_crash(tmp_path: Path, index: str) -> None:
    state = tmp_path / "w"
    keys = [f"p{i:04d}" for i in range(600)]
    _fill_small_and_stop(state, keys, 500)
    data_file = state / "ssd" / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    leaves = _leaf_pages(raw)
    assert len(leaves) > 10, "expected a B-tree of many leaf pages"
    struct.pack_into("<H", raw, leaves[len(leaves) // 2] * _PAGE + 10, _P_BRANCH)
    data_file.write_bytes(raw)
    if index == "gone":
        (state / "ssd" / "kvpool-index").unlink()  # as after a kill -9: the start scans every header
    for attempt in range(2):  # and the next start does the same
        w = WorkerProcess(state, ssd=True, dram_bytes="16MiB", env=SMALL_DRAM)
        try:
            w.wait_ready()
        except PoolUnavailable as e:
            assert w.proc.returncode not in (-signal.SIGABRT, -signal.SIGBUS, -signal.SIGSEGV), \
                f"start {attempt + 1}: the worker died of signal {-w.proc.returncode}: {w.log_tail(600)}"
            assert "StorageError" in str(e), e
            continue
        died = False
        try:
            with PoolClient(mode="local", worker=w.address, timeout_s=5) as c:
                for k in keys:
                    try:
                        got = c.get(k)
                    except PoolUnavailable as e:
                        # A start from the index a clean stop saved walks no page (README): a read that
                        # meets the damage may end that worker, once. The index is consumed at start, so
                        # the next start scans, and refuses the tier (above): never a crash loop.
                        assert index == "kept" and attempt == 0, \
                            f"reading {k}: {e}; the worker's exit status {w.proc.wait(5)}: {w.log_tail(300)}"
                        died = True
                        break
                    assert got is None or got == block(k, 500), f"wrong bytes for {k}"
            assert died or w.proc.poll() is None, f"the worker died (rc {w.proc.returncode}) reading a damaged tier"
        finally:
            w.kill()


_AHEAD_WRITER = """
import sys, time
_real = time.time
time.time = lambda: _real() + 1.9  # this run's clock is 1.9 s ahead (within versions.CLOCK_SKEW_MS)
from kvpool.core.client import PoolClient
c = PoolClient(mode="embedded", ssd_path=sys.argv[1], dram_bytes=4 << 20, dram_slab_size=1 << 20, prefault=False,
               ssd_map_size=64 << 20)
c.put("k", b"old" * 1000)
c.backend.cache.flush()  # (README: an embedded cache keeps every block over a clean close after flush())
c.close()
"""


# Bug: a restart does not merge the versions of the blocks it finds on SSD into its clock (versions.CLOCK),
# nor does an embedded read: where the last run's clock ran ahead (by less than CLOCK_SKEW_MS; a clock
# stepped back at a reboot), a put that follows a read of the block is stamped older than it (versions.py
# promises above), is silently dropped (TieredCache._enter), and the older bytes stay served.
def test_a_put_after_a_restart_replaces_a_block_the_last_run_stamped_ahead(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    subprocess.run([sys.executable, "-c", _AHEAD_WRITER, str(ssd)], check=True, timeout=60)
    with PoolClient(mode="embedded", ssd_path=str(ssd), dram_bytes=4 << 20, dram_slab_size=1 << 20,
                    prefault=False, ssd_map_size=64 << 20) as c:
        assert c.get("k") == b"old" * 1000
        c.put("k", b"new" * 1000)
        assert c.get("k") == b"new" * 1000, "the put after the restart returned, and the older block is served"


# Bug: with the disk full (a quota: LMDB cannot take a page), a remove, or a put that replaces a block on
# SSD, returns as done while the SSD copy it had to delete stays (queued: tier_stack.remove /
# delete_replaced -> SsdTier.delete_stale returns False, and the caller acknowledges anyway). A kill -9
# then brings every removed key back, or the replaced older version, after the restart: the README
# promises misses ("keys ... removed meanwhile: misses"; "a kill -9 after the put leaves a miss, never
# the older version").
@pytest.mark.parametrize("change", ["remove", "overwrite"])
def test_a_change_acknowledged_on_a_full_disk_is_not_undone_by_a_kill_9(tmp_path: Path, change: str) -> None:
    state = tmp_path / "w"
    worker = dict(ssd=True, dram_bytes="4MiB", env=SMALL_DRAM)
    size = 64 << 10
    keys = [f"d{i}" for i in range(300)]
    w = WorkerProcess(state, **worker).wait_ready()  # type: ignore[arg-type]
    try:
        on_ssd = fill_then_full_disk(w, keys)
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            assert len(on_ssd) > 20, len(on_ssd)
            try:  # refused (a typed error) is honest; acknowledged must survive the kill -9
                if change == "remove":
                    assert all(c.batch_remove(on_ssd))
                else:
                    c.batch_put(on_ssd, [block(k, size, 1) for k in on_ssd])
                acknowledged = True
            except KVPoolError:
                acknowledged = False
    finally:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.kill()
    w = WorkerProcess(state, **worker).wait_ready()  # type: ignore[arg-type]  (the disk has room again)
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            got = {k: c.get(k) for k in on_ssd}
    finally:
        w.stop()
    undone = [k for k, g in got.items() if g is not None and not is_block_of(k, g, 1)] if acknowledged else []
    assert undone == [], (f"{len(undone)} of {len(on_ssd)} keys acknowledged as "
                          f"{'removed' if change == 'remove' else 'overwritten'} served their older block")


# Bug: a clear() on a full disk unindexes every SSD block before LMDB's drop fails (SsdTier.clear forgets
# first, then store.clear() raises CapacityError, which the worker answers by closing the connection): the
# worker serves them all as misses from then on, yet LMDB keeps them, unindexed and never queued for
# deletion, and even a clean restart once the disk has room serves every cleared key again.
def test_a_clear_that_failed_on_a_full_disk_does_not_bring_its_keys_back_at_the_next_start(tmp_path: Path) -> None:
    state = tmp_path / "w"
    worker = dict(ssd=True, dram_bytes="4MiB", env=SMALL_DRAM)
    size = 64 << 10
    keys = [f"c{i}" for i in range(120)]
    w = WorkerProcess(state, **worker).wait_ready()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            for i in range(0, len(keys), 20):
                c.batch_put(keys[i:i + 20], [block(k, size) for k in keys[i:i + 20]])
            time.sleep(0.5)  # (the demoter's last batch)
            full = (state / "ssd" / "data.mdb").stat().st_size
            resource.prlimit(w.proc.pid, resource.RLIMIT_FSIZE, (full, resource.RLIM_INFINITY))  # the disk is full
            try:
                c.clear()
            except KVPoolError:
                pass  # (refused: then what the worker serves from here is what the next start must serve)
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            present = [k for k, held in zip(keys, c.batch_exists(keys)) if held]
        resource.prlimit(w.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert w.stop() == 0, w.log_tail()  # a clean stop, with room on the disk again
    finally:
        w.kill()
    w = WorkerProcess(state, **worker).wait_ready()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            back = [k for k in keys if k not in present and c.get(k) is not None]
    finally:
        w.stop()
    assert back == [], f"{len(back)} keys the worker served as cleared (misses) came back after a clean restart"


# Bug: the README says that after fork() "the child's copy of an embedded pool is its own (copy on write)",
# but a child forked while the parent's pool is busy (a put holding the cache's lock, a demotion writing
# to SSD) hangs for good on its first call: it waits for the lock that a parent's thread held
# (cache._reserve), for the parent's SSD writes in flight (TierMoves.alloc: `_writes` copied at the fork),
# or on closing the inherited LMDB environment (SsdStore.env); no os.register_at_fork resets them.
def test_a_child_forked_from_a_busy_embedded_pool_can_use_its_copy(tmp_path: Path) -> None:
    c = PoolClient(mode="embedded", ssd_path=str(tmp_path / "ssd"), dram_bytes=4 << 20, dram_slab_size=1 << 20,
                   prefault=False, ssd_map_size=256 << 20)
    stop = threading.Event()

    def load() -> None:  # the parent's pool at work: puts through a small arena, demotions to SSD
        i = 0
        while not stop.is_set():
            keys = [f"k{i + j}" for j in range(8)]
            c.batch_put(keys, [block(k, 64 << 10) for k in keys])
            i += 8

    t = threading.Thread(target=load, daemon=True)
    t.start()
    hung = []
    try:
        time.sleep(0.3)
        for trial in range(8):
            pid = os.fork()
            if pid == 0:  # the child: one put and one get on its copy, then out (no finalizers)
                code = 1
                try:
                    c.put("child", b"x" * 1000)
                    code = 0 if c.get("child") == b"x" * 1000 else 3
                finally:
                    os._exit(code)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0, f"fork {trial}: the child's put/get failed"
                    break
                time.sleep(0.02)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                hung.append(trial)
                break
    finally:
        stop.set()
        t.join(30)
        c.close()
    assert hung == [], f"a child forked from a busy embedded pool hung on its first call (fork {hung[0]})"


# Bug: a worker restarted with a smaller --ssd-map-size than the data its tier holds (an operator shrinking
# the tier) opens (LMDB maps the whole file) but can never write to it again, not even a delete (MapFull:
# no page free in the map); nothing is logged, every demotion is dropped, and removes and overwrites are
# acknowledged while the SSD copies they had to delete stay (the CapacityError is swallowed: SsdTier.
# delete_stale): after a kill -9, every removed key and every overwritten key's older block are served.
def test_a_tier_reopened_with_a_smaller_map_size_never_undoes_acknowledged_changes(tmp_path: Path) -> None:
    state = tmp_path / "w"
    size = 64 << 10
    keys = [f"s{i}" for i in range(300)]
    w = WorkerProcess(state, ssd=True, dram_bytes="4MiB", env=SMALL_DRAM).wait_ready()  # a 1 GiB map
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            for i in range(0, len(keys), 20):
                c.batch_put(keys[i:i + 20], [block(k, size) for k in keys[i:i + 20]])
    finally:
        assert w.stop() == 0, w.log_tail()  # ~20 MiB of blocks on SSD
    smaller = dict(ssd=True, dram_bytes="4MiB", env=SMALL_DRAM, extra=["--ssd-map-size", "8MiB"])
    w = WorkerProcess(state, **smaller).wait_ready()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            held = [k for k, h in zip(keys, c.batch_exists(keys)) if h]
            removed, overwritten = held[:40], held[40:80]
            assert all(c.batch_remove(removed))
            c.batch_put(overwritten, [block(k, size, 1) for k in overwritten])
    finally:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.kill()
    w = WorkerProcess(state, **smaller).wait_ready()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=10) as c:
            back = [k for k in removed if c.get(k) is not None]
            old = [k for k in overwritten if (g := c.get(k)) is not None and not is_block_of(k, g, 1)]
    finally:
        w.stop()
    assert (back, old) == ([], []), (f"after a kill -9: {len(back)} of {len(removed)} removed keys served again, "
                                     f"{len(old)} of {len(overwritten)} overwritten keys served at their older version")

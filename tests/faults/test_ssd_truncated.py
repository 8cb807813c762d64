"""An SSD tier whose data.mdb was cut short on disk (a copy interrupted, a filesystem repair, a file
shrunk by hand). LMDB maps the file and trusts its meta page's last page number: a page past the
file's end is a SIGBUS in whoever touches it. The promise is a typed error or a miss, never a crash
of the worker (and never a crash loop at each restart)."""
from __future__ import annotations

import os
import signal

import pytest

from kvpool.core import PoolUnavailable
from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from faulthelp import block

SIZE = 16 << 10
KEYS = [f"t{i:03d}" for i in range(200)]


def _fill_and_stop(state) -> None:
    w = WorkerProcess(state, ssd=True, dram_bytes="64MiB").wait_ready()
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            for i in range(0, len(KEYS), 50):
                c.batch_put(KEYS[i:i + 50], [block(k, SIZE) for k in KEYS[i:i + 50]])
    finally:
        assert w.stop() == 0, w.log_tail()  # SIGTERM: DRAM flushed to the SSD tier, its index saved


def _truncate(state) -> None:
    data = state / "ssd" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)


@pytest.mark.parametrize("index", ["kept", "gone"])
def test_a_truncated_data_file_is_a_storage_error_or_misses_never_a_crash(tmp_path, index):
    """`kept`: the index saved at the clean stop still names LMDB's state (its txnid, entries and
    inode are in the meta pages, which survive), so the start reads no block; the reads then touch
    pages past the file's end. `gone`: the start scans every header (as after a kill -9)."""
    state = tmp_path / "w"
    _fill_and_stop(state)
    _truncate(state)
    if index == "gone":
        (state / "ssd" / "kvpool-index").unlink()
    try:
        w = WorkerProcess(state, ssd=True, dram_bytes="64MiB").wait_ready()
    except PoolUnavailable as e:
        assert f"exited with {-signal.SIGBUS}" not in str(e), f"the worker died of SIGBUS at start: {e}"
        assert "StorageError" in str(e), e
        return
    try:
        with PoolClient(mode="local", worker=w.address, timeout_s=5) as c:
            for k in KEYS:
                try:
                    got = c.get(k)
                except PoolUnavailable as e:
                    try:
                        rc = w.proc.wait(5)
                    except Exception:
                        rc = None
                    pytest.fail(f"reading {k} of a truncated tier: {e}; the worker's exit status {rc}")
                assert got is None or bytes(got) == block(k, SIZE), f"wrong bytes for {k}"
        assert w.proc.poll() is None, f"the worker died (rc {w.proc.returncode}) reading a truncated tier"
    finally:
        w.kill()

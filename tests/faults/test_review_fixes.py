"""A review of session AR's fixes (a77efe6..54df5ec) found these bugs in them; each test failed before
its fix (its docstring says which)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core import protocol as P
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport

from faulthelp import inproc_worker
from tcpproxy import TcpProxy


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    """A worker whose same-node connections may reserve 4 MiB at once (32 MiB arena of 1 MiB slabs)."""
    w = inproc_worker(tmp_path, dram_bytes=32 << 20, dram_slab_size=1 << 20)
    assert w.max_reserve == 4 << 20
    yield w
    w.stop()


def test_a_frame_of_small_blocks_is_not_refused_for_budget_the_client_framed_it_within(worker: Worker) -> None:
    """Regression (8e9c965): `_alloc` charges a connection's reservations at least RESERVE_FLOOR a block, and the client
    frames puts by that rule (`P.frames(..., floor=RESERVE_FLOOR)`), but the budget left is computed as
    `max_reserve - sum(held) - floor * count(held < floor)`: a held block under 256 bytes costs its size *plus*
    256, not max(size, 256) (worker_ops.py `_alloc`). A frame of many small blocks ALLOCs its parts a chunk
    ahead (the first part still held when the next chunk is asked for), so a frame the client sized within
    `max_reserve` is refused with ITEM_FULL: here 16384 blocks of 255 bytes (16384 x 256 = max_reserve, one
    frame) fail with CapacityError on an almost empty 32 MiB arena."""
    t = ShmTransport(worker.unix_path)
    try:
        n = worker.max_reserve // P.RESERVE_FLOOR
        keys = [b"small%05d" % i for i in range(n)]
        blocks = [bytes([i % 251]) * 255 for i in range(n)]
        t.batch_put(keys, blocks)
        out = [bytearray(255) for _ in range(n)]
        assert t.batch_get_into(keys, out) == [255] * n
    finally:
        t.close()


class _PausableProxy(TcpProxy):
    """A TCP proxy whose answers (worker to client) can be held back: a worker that is slow to answer."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.flowing = threading.Event()
        self.flowing.set()
        super().__init__(upstream)

    def _passing(self, data: bytearray, direction: str) -> bytearray:
        if direction == "down":
            self.flowing.wait(30)
        return data


def test_a_write_queued_behind_a_reads_abandoned_first_round_does_not_leave_the_worker_out(tmp_path: Path) -> None:
    """Regression (3b0440a): a read's first round (half the timeout) that a worker misses now marks it only slow, "reads
    skip it, writes still go to it; only a call unanswered for the whole timeout leaves a worker out of
    writes" (fanout.py's doc). But `_abandon` still aborts the *transport* the read used, which every thread of
    the client shares: a put from another thread, waiting for that connection's session while the read held
    it, then fails at once ("the call was abandoned at its deadline", PoolUnavailable), and `each` takes that
    as the worker failing: `failed()` marks it *down*, so the put fails and the writes of the next
    SUSPECT_S leave the worker out, though it went unanswered for half the timeout only (no stall: it will
    not catch up by itself)."""
    from kvpool.core.fanout import FanOut
    from kvpool.core.records import WorkerInfo

    w = inproc_worker(tmp_path, dram_bytes=32 << 20, dram_slab_size=1 << 20)
    proxy = _PausableProxy(("127.0.0.1", w.port))
    fan = FanOut("elsewhere", None, 2.0)
    try:
        info = WorkerInfo.from_dict({**w.info(), "tcp": proxy.address, "node_id": "another-node"})
        live = {w.worker_id: info}
        groups = {w.worker_id: [0]}
        assert [r for _, _, r in fan.each(live, groups, lambda t, idx: t.batch_exists([b"k"]),
                                          time.monotonic() + 2.0)] == [[False]]  # connected
        proxy.flowing.clear()  # the worker is slow to answer for a moment (well under timeout_s)
        outcome: list[object] = []

        def read() -> None:  # a replicated read's first round: half the timeout
            list(fan.each(live, groups, lambda t, idx: t.batch_exists([b"k"]), time.monotonic() + 1.0, reads=True))

        def write() -> None:
            try:
                outcome.append([r for _, _, r in fan.each(live, groups, lambda t, idx: t.batch_put([b"k"], [b"v" * 64]),
                                                          time.monotonic() + 2.0)])
            except Exception as e:  # (what the put met is the finding)
                outcome.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.3)
        writer = threading.Thread(target=write)
        writer.start()  # waits for the connection the read holds
        reader.join(10)
        proxy.flowing.set()  # answering again ~1 s after it paused: never unanswered for timeout_s
        writer.join(10)
        skipped = fan._askable(live, groups) != groups
        assert outcome == [[None]] and not skipped, (
            f"the put that queued behind the abandoned read answered {outcome} (a put that reached the worker: "
            f"[[None]]); writes skip the worker now: {skipped}")
    finally:
        fan.close()
        proxy.close()
        w.stop()


def test_a_same_node_lease_of_more_keys_than_max_leases_serves_the_rest_as_copies(worker: Worker) -> None:
    """Regression (8e9c965): the worker now refuses a LEASE that would make a connection hold more than MAX_LEASES
    (4 x MAX_BATCH) leases, but the client was not taught the bound: `ShmTransport.batch_lease` splits a
    batch only by `P.frames` (MAX_BATCH/metadata) and holds every frame's leases until the `with` exits, so
    one `batch_lease` of more than 262,144 keys (here small blocks, one key repeated) fails with
    PoolUnavailable, its connection dropped, on a healthy worker (in cluster mode the worker is then marked
    down). Expected: the call is served (split, or served by copy), as any batch the API takes."""
    from kvpool.core.client import PoolClient

    with PoolClient(mode="local", worker=worker.unix_path, timeout_s=10) as c:
        c.put("leased", b"L" * 64)
        n = P.MAX_LEASES + 1
        with c.batch_lease(["leased"] * n) as views:
            assert len(views) == n and all(v is not None and bytes(v) == b"L" * 64 for v in views[:: 4096])


def test_load_reads_the_table_its_section_argument_names(tmp_path: Path) -> None:
    """Regression (c26cdea): `load(cls, file=..., section=...)` (public as `kvpool.core.load_config`) still takes a
    `section` ("its table (`section`, default the class's ...)", config.py `load`), and `_file_values` reads
    that table, but its check for stray names first refuses every table not in the `SECTIONS` registry
    (config.py `_file_values`: `k not in SECTIONS if k in tables`), the very table `section` names among
    them. So a section of the caller's own (`[pool]`, a per-node table, a user's dataclass loaded with
    `load_config`), read before this change, is now always a ConfigError ("unknown ... table(s) ['pool']")."""
    from kvpool.core.config import load

    path = tmp_path / "node.toml"
    path.write_text('[pool]\ndram_bytes = "64MiB"\nprefault = false\n')
    cfg = load(CacheConfig, file=path, section="pool", env={})
    assert (cfg.dram_bytes, cfg.prefault) == (64 << 20, False)


def test_a_flat_client_config_file_is_read_by_the_worker_too(tmp_path: Path) -> None:
    """Regression (c26cdea): README: "A config file holds settings at its top level, or in tables [cache], [worker] and
    [client] ... every reader (the Python API, `kvpool worker`) reads both". A flat file with ClientConfig's
    own setting `worker` (the worker a local-mode client reaches) is fine for PoolClient and CacheConfig, but
    `load(WorkerConfig, ...)` takes that string for its `[worker]` table (`section in data` in config.py
    `_file_values`) and raises ConfigError "[worker] is a str, not a table of settings": `kvpool worker` (or
    any worker a process with KVPOOL_CONFIG set starts, e.g. a bench's) refuses a file every other reader
    takes, whose top-level settings (`token` here) are meant for it too."""
    from kvpool.core.client import ClientConfig
    from kvpool.core.config import load

    path = tmp_path / "kvpool.json"
    path.write_text('{"worker": "/run/kvpool/worker.sock", "token": "a-pool-token-of-some-length"}')
    assert load(ClientConfig, file=path, env={}).worker == "/run/kvpool/worker.sock"
    assert load(WorkerConfig, file=path, env={}).token == "a-pool-token-of-some-length"

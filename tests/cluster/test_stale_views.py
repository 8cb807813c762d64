"""Writes and reads while a view of the cluster lags (an owner briefly paused; a client that has not seen a
worker come back): each test asserts what README.md promises and failed before its fix (one test per bug an
adversarial check found; its docstring says which). Real nats-server and `kvpool worker` processes; pauses
are SIGSTOP (`sigstop.freeze`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

from kvpool.core.client import PoolClient
from kvpool.core.cluster import rank
from kvpool.core.procs import WorkerProcess

from sigstop import freeze

Spawn = Callable[..., WorkerProcess]
SIZE = 64 << 10
SMALL_DRAM = {"KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "0"}


def block(key: str, version: int, size: int = SIZE) -> bytes:
    """Key `key`'s block number `version`: tells itself apart from every other key's and version's."""
    return (f"{key}@{version};".encode() * (size // 8 + 1))[:size]


def version_of(key: str, data: bytes | None, size: int = SIZE) -> int | None | str:
    """Which of `key`'s blocks `data` is (None: a miss; "wrong": no block of it at all)."""
    if data is None:
        return None
    return next((v for v in range(8) if bytes(data) == block(key, v, size)), "wrong")


def worker_id(w: WorkerProcess) -> str:
    with PoolClient(mode="local", worker=w.address, timeout_s=5) as c:
        return str(next(iter(c.members())))


def owned_only_by(ids: list[str], owners: set[str], n: int, prefix: str, r: int = 2) -> list[str]:
    """`n` keys whose `r` owners are exactly `owners`."""
    return [k for k in (f"{prefix}{i}" for i in range(50000)) if set(rank(k.encode(), ids)[:r]) == owners][:n]


def direct_versions(w: WorkerProcess, keys: list[str]) -> list[int | None | str]:
    """What worker `w` itself holds of each key (by a local-mode client to it alone)."""
    with PoolClient(mode="local", worker=w.address, timeout_s=5) as c:
        return [version_of(k, c.get(k)) for k in keys]


# A writer with R=2 and the least timeout replicas allow (1 s): it reads one key (its owners both asked),
# then rewrites every key, prints "put" and waits to be killed (-9: what it owes is never delivered).
HALF_TIMEOUT_WRITER = textwrap.dedent("""
    import sys
    from kvpool.core import PoolClient
    keys = sys.argv[2].split(",")
    def block(key, version, size=64 << 10):
        return (f"{key}@{version};".encode() * (size // 8 + 1))[:size]
    with PoolClient(mode="cluster", nats_url=sys.argv[1], replication=2, timeout_s=1.0, node_id="writer") as c:
        assert c.wait_for_members(lambda m: len(m) == 3, 15)
        assert c.get(keys[0]) == block(keys[0], 0)  # connected to both owners
        print("ready", flush=True)
        sys.stdin.readline()
        c.get(keys[0])  # one owner paused: its half of the read ends at timeout_s / 2
        c.batch_put(keys, [block(k, 1) for k in keys])
        print("put", flush=True)
        sys.stdin.readline()  # killed here
""")


def test_an_owner_silent_for_half_the_timeout_is_left_out_of_a_put_without_catching_up(nats, spawn: Spawn) -> None:
    """Regression: README (Replicas) promises "A client leaves a worker out of a write only once it went
    unanswered for the client's `timeout_s` ... a worker never stalled that long was never left out",
    which is why a writer that dies owing an owner its removal is safe: the owner stalled >= 1 s
    (`STALL_S`) and catches up by itself. But a R=2 read gives its first round only `timeout_s / 2`
    (`ClusterBackend._read_newest`, `halfway`), and `FanOut._abandon` marks the owner that misses it
    suspect; the puts of the next `SUSPECT_S` go on without it. An owner paused about 0.5 s (no stall) is
    left out of a put; the writer is killed before it can tell it; the owner that took the put evicts
    it; the left-out owner's older block is then the newest anyone holds, and is served."""
    workers = [spawn(nats_url=nats.url, node_id=f"node{i}", dram_bytes="16MiB", env=SMALL_DRAM) for i in range(3)]
    ids = [worker_id(w) for w in workers]
    took, paused, other = ids
    keys = owned_only_by(ids, {took, paused}, 20, "half")
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, timeout_s=2, node_id="reader") as c:
        assert c.wait_for_members(lambda m: len(m) == 3, 15)
        c.batch_put(keys, [block(k, 0) for k in keys])
        with subprocess.Popen([sys.executable, "-c", HALF_TIMEOUT_WRITER, nats.url, ",".join(keys)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
            assert child.stdout is not None and child.stdin is not None
            try:
                assert child.stdout.readline().strip() == "ready"
                freeze(workers[1].proc.pid)
                t0 = time.monotonic()
                try:
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    assert child.stdout.readline().strip() == "put"
                    child.kill()  # before the paused owner can be told what it missed
                    child.wait()
                finally:
                    os.kill(workers[1].proc.pid, signal.SIGCONT)
                    paused_s = time.monotonic() - t0
            finally:
                child.kill()
        # (paused well under STALL_S: it does not take itself as stalled; what it holds now, left out and
        # never told, is its older copy of every key)
        print(f"paused {paused_s:.2f} s; the left-out owner holds {direct_versions(workers[1], keys)}")
        assert direct_versions(workers[0], keys) == [1] * len(keys)  # the put was acknowledged
        fill = owned_only_by(ids, {took, other}, 512, "fill")  # 32 MiB through the 16 MiB arena of `took`
        for i in range(0, len(fill), 32):
            c.batch_put(fill[i:i + 32], [block(k, 0) for k in fill[i:i + 32]])
        assert direct_versions(workers[0], keys) == [None] * len(keys)  # the newest evicted
        got = {k: version_of(k, c.get(k)) for k in keys}
    stale = {k: v for k, v in got.items() if v not in (None, 1)}
    assert not stale, f"{len(stale)} of {len(keys)} keys served older than the acknowledged put: {stale}"


def test_a_worker_back_on_its_ssd_misses_what_was_written_between_its_catch_up_and_its_registration(
        nats, spawn: Spawn) -> None:
    """Regression: README ("What survives what": a worker stops and comes back on its SSD tier, R=1) promises
    misses for "the keys written or removed meanwhile", and "NATS ... unreachable: every block when it
    is back within the member TTL ... clients keep the last member list meanwhile". But a worker that
    starts on its state catches up from its peers *before* it registers (`Worker.start`:
    `_catch_up_at_start`, then `membership.register`) and never again: a put that a client makes while
    it does not list the worker yet (its view a moment behind: here its NATS link held up 2 s, well within
    the TTL) lands on the stand-in owner after the catch-up asked it, and the returning worker, once
    listed, serves its older copy."""
    from nats_nodes import Relay

    host = nats.url.split("//", 1)[1].split(",")[0]
    relay = Relay((host.rsplit(":", 1)[0], int(host.rsplit(":", 1)[1])))
    back: WorkerProcess | None = None
    try:
        returning = spawn(nats_url=nats.url, node_id="node0", ssd=True, extra=["--worker-id", "w-back"])
        spawn(nats_url=nats.url, node_id="node1", extra=["--worker-id", "w-stand-in"])
        keys = [k for k in (f"gap{i}" for i in range(200)) if rank(k.encode(), ["w-back", "w-stand-in"])[0] == "w-back"]
        with PoolClient(mode="cluster", nats_url=relay.url, timeout_s=2, node_id="client") as c:
            assert c.wait_for_members(lambda m: len(m) == 2, 15)
            c.batch_put(keys, [block(k, 0) for k in keys])
            assert returning.stop() == 0  # SIGTERM: flushed to its SSD tier, deregistered at once
            assert c.wait_for_members(lambda m: "w-back" not in m, 15)
            relay.cut()  # this client's NATS link is held up: it keeps the member list it has
            back = WorkerProcess(returning.state_dir, nats_url=nats.url, node_id="node0", ssd=True,
                                 dram_bytes="64MiB", extra=["--worker-id", "w-back"]).wait_ready()
            c.batch_put(keys, [block(k, 1) for k in keys])  # acknowledged, by the stand-in owner
            relay._cut.clear()  # the link passes bytes again (2 s or so later: within the member TTL)
            assert c.wait_for_members(lambda m: len(m) == 2, 20)
            got = {k: version_of(k, c.get(k)) for k in keys}
    finally:
        if back is not None:
            back.stop(timeout=5)
        relay.close()
    stale = {k: v for k, v in got.items() if v not in (None, 1)}
    assert not stale, f"{len(stale)} of {len(keys)} keys served older than the acknowledged put: {stale}"

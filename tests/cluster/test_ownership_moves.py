"""A key's owner changes as workers join and leave (rendezvous placement). The worker that owned it
before a newcomer keeps its copy; were that copy served again once the newcomer leaves, a reader would
get an older version than the one written meanwhile. Every put and remove therefore tells the workers
below the key's owners that may hold it to drop an older block of the key (`Op.SUPERSEDE`,
`kvpool.core.succession`)."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

import pytest

from kvpool.core import PoolClient, Stagers, versions
from kvpool.core.cluster import rank
from kvpool.core.procs import WorkerProcess
from kvpool.core.versions import CLOCK_SKEW_MS, COUNTER_BITS

from sigstop import freeze

N = 48
SIZE = 4096


def block(key: str, version: int) -> bytes:
    return (f"{key}@{version};".encode() * SIZE)[:SIZE]


def read(pool: PoolClient, keys: list[str]) -> list[int | str]:
    """Per key: the version read, -1 for a miss."""
    bufs = [bytearray(SIZE) for _ in keys]
    out: list[int | str] = []
    for k, b, n in zip(keys, bufs, pool.batch_get_into(keys, bufs)):
        out.append(-1 if n < 0 else next((v for v in (1, 2) if bytes(b) == block(k, v)), "wrong"))
    return out


def change_and_tell(pool: PoolClient, keys: list[str], change: str) -> None:
    """Overwrite `keys` with version 2 (read back) or remove them; then wait until the workers below
    their owners are told (`Op.SUPERSEDE` goes in the background)."""
    if change == "overwritten":
        pool.batch_put(keys, [block(k, 2) for k in keys])
        assert read(pool, keys) == [2] * len(keys)
    else:
        pool.batch_remove(keys)
    pool.backend.supersedes.wait()


@pytest.mark.parametrize(("change", "replication"), [("overwritten", 1), ("staged", 1), ("removed", 1),
                                                     ("overwritten", 2), ("removed", 2)])  # (staged: one copy only)
def test_a_key_written_while_a_newcomer_owned_it_is_never_served_older_after_it_leaves(
        nats, spawn: Callable[..., WorkerProcess], change: str, replication: int) -> None:
    first = [spawn(nats_url=nats.url, extra=["--worker-id", f"w-{i}"]) for i in range(replication)]
    keys = [f"moves/{i}" for i in range(N)]
    with PoolClient(mode="cluster", nats_url=nats.url, replication=replication, timeout_s=5) as pool:
        assert pool.wait_for_members(lambda m: len(m) == replication, 15)
        pool.batch_put(keys, [block(k, 1) for k in keys])
        newcomer = spawn(nats_url=nats.url, extra=["--worker-id", "w-new"])
        assert pool.wait_for_members(lambda m: len(m) == replication + 1, 15)
        ids = [*(f"w-{i}" for i in range(replication)), "w-new"]
        moved = [k for k in keys if "w-new" in rank(k.encode(), ids)[:replication]]
        assert moved, "some keys move to the newcomer"
        if change == "overwritten":
            pool.batch_put(moved, [block(k, 2) for k in moved])
            assert read(pool, moved) == [2] * len(moved)
        elif change == "staged":  # a stream producer's puts: through the newcomer's arena (`Stagers`)
            with contextlib.closing(Stagers(pool)) as stagers:
                names = [k.encode() for k in moved]
                stager = stagers.for_keys(names, [SIZE] * len(names))
                assert stager is not None
                stager.put(names, [memoryview(block(k, 2)) for k in moved], 0.0)
                stagers.settle()
            assert read(pool, moved) == [2] * len(moved)
        else:
            pool.batch_remove(moved)  # (the newcomer holds none of them: "not found" is its answer)
        pool.backend.supersedes.wait()  # (the worker next in line is told in the background)
        newcomer.stop(timeout=10)
        assert pool.wait_for_members(lambda m: "w-new" not in m, 15)
        got = dict(zip(keys, read(pool, keys)))
        assert "wrong" not in got.values()
        stale = {k: got[k] for k in moved if got[k] not in ((-1,) if change == "removed" else (2, -1))}
        assert not stale, f"served older than what was {change} while the newcomer owned them: {stale}"
        if change != "removed" and replication > 1:  # the other owner of each still holds version 2
            assert {k: got[k] for k in moved if got[k] != 2} == {}, "a replica's newest copy was not served"
        assert all(got[k] == 1 for k in keys if k not in moved), "keys that never moved are still served"
    assert first


@pytest.mark.parametrize("change", ["overwritten", "removed"])
def test_a_key_two_newcomers_both_took_is_never_served_older_after_both_leave(
        nats, spawn: Callable[..., WorkerProcess], change: str) -> None:
    """R=1: two workers join and both rank above a key's old owner, two places down. A write then goes
    to the first; the old owner is told too (it held blocks before either joined), so once both leave
    it serves nothing older. (An adversarial check found 66 of 66 such keys served old when only the
    worker next in line was told.)"""
    spawn(nats_url=nats.url, extra=["--worker-id", "w-0"])
    keys = [f"twice/{i}" for i in range(4 * N)]
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        pool.batch_put(keys, [block(k, 1) for k in keys])
        newcomers = [spawn(nats_url=nats.url, extra=["--worker-id", w]) for w in ("w-a", "w-b")]
        assert pool.wait_for_members(lambda m: len(m) == 3, 15)
        moved = [k for k in keys if rank(k.encode(), ["w-0", "w-a", "w-b"])[2] == "w-0"]
        assert moved, "some keys move two places"
        change_and_tell(pool, moved, change)
        for w in newcomers:
            w.stop(timeout=10)
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        got = dict(zip(keys, read(pool, keys)))
    stale = {k: got[k] for k in moved if got[k] != -1}
    assert not stale, f"served older than what was {change} while the newcomers owned them: {stale}"
    assert all(got[k] == 1 for k in keys if k not in moved), "keys that never moved are still served"


def test_a_block_stamped_by_a_clock_ahead_does_not_outlive_a_later_write(
        nats, spawn: Callable[..., WorkerProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """R=1: a block stamped by a clock running ahead (within the skew bound: another writer's; here this
    process's clock, moved ahead and back) while the first worker owned its key, then overwritten at a
    newcomer with a lower stamp: once the newcomer leaves, the first worker serves nothing older."""
    spawn(nats_url=nats.url, extra=["--worker-id", "w-0"])
    keys = [f"skew/{i}" for i in range(N)]
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        monkeypatch.setattr(versions.CLOCK, "_last", versions.CLOCK.now() + ((CLOCK_SKEW_MS // 2) << COUNTER_BITS))
        pool.batch_put(keys, [block(k, 1) for k in keys])
        monkeypatch.setattr(versions.CLOCK, "_last", 0)  # back: the next writer's clock is half a skew behind
        newcomer = spawn(nats_url=nats.url, extra=["--worker-id", "w-new"])
        assert pool.wait_for_members(lambda m: len(m) == 2, 15)
        moved = [k for k in keys if rank(k.encode(), ["w-0", "w-new"])[0] == "w-new"]
        pool.batch_put(moved, [block(k, 2) for k in moved])
        assert read(pool, moved) == [2] * len(moved)
        pool.backend.supersedes.wait()
        newcomer.stop(timeout=10)
        assert pool.wait_for_members(lambda m: "w-new" not in m, 15)
        got = read(pool, moved)
        assert set(got) <= {2, -1}, f"the block stamped ahead came back: {got}"


def test_a_put_does_not_wait_on_a_paused_worker_that_owns_none_of_its_keys(
        nats, spawn: Callable[..., WorkerProcess]) -> None:
    """The worker next in line is told in the background: a put whose owner answers returns at once,
    though the next in line (paused, and not yet connected to) answers nothing."""
    workers = [spawn(nats_url=nats.url, extra=["--worker-id", f"w-{i}"]) for i in range(3)]
    ids = [f"w-{i}" for i in range(3)]
    key = next(k for k in (f"paused/{i}" for i in range(1000)) if rank(k.encode(), ids)[1] == "w-2")
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=2) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 3, 15)
        freeze(workers[2].proc.pid)
        try:
            t0 = time.monotonic()
            pool.batch_put([key], [block(key, 1)])
            took = time.monotonic() - t0
        finally:
            os.kill(workers[2].proc.pid, signal.SIGCONT)
        assert read(pool, [key]) == [1]
    assert took < 1.0, f"the put took {took:.2f} s"


@pytest.mark.parametrize("change", ["overwritten", "removed"])
def test_a_worker_back_on_its_ssd_serves_nothing_older_than_a_write_whose_owner_left(
        nats, spawn: Callable[..., WorkerProcess], tmp_path, change: str) -> None:
    """R=1: w-2 owns the keys and keeps version 1 on its SSD tier while it is stopped; a newcomer, w-1,
    takes version 2 (w-0, next below it, is told); w-1 leaves, and w-2 comes back on its SSD. Its
    catch-up finds the write in w-0's change log, though the only copy of version 2 left with w-1.
    (An adversarial check found 100 of 100 such keys served old when the log held only what each
    worker took itself.) Keys nobody wrote meanwhile are served again: w-2 is back, not fenced."""
    def start_w2() -> WorkerProcess:
        return WorkerProcess(tmp_path / "w-2", nats_url=nats.url, ssd=True, extra=["--worker-id", "w-2"]).wait_ready()

    spawn(nats_url=nats.url, ssd=True, extra=["--worker-id", "w-0"])
    w2 = start_w2()
    try:
        ids = ["w-0", "w-1", "w-2"]
        keys = [k for k in (f"back/{i}" for i in range(40 * N)) if rank(k.encode(), ids) == ["w-1", "w-2", "w-0"]]
        moved, kept = keys[:N], keys[N:2 * N]
        with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as pool:
            assert pool.wait_for_members(lambda m: len(m) == 2, 15)
            pool.batch_put(keys, [block(k, 1) for k in keys])  # all at w-2
            newcomer = spawn(nats_url=nats.url, extra=["--worker-id", "w-1"])
            assert pool.wait_for_members(lambda m: len(m) == 3, 15)
            w2.stop(timeout=10)  # (its DRAM blocks go to SSD as it stops)
            assert pool.wait_for_members(lambda m: set(m) == {"w-0", "w-1"}, 15)
            change_and_tell(pool, moved, change)
            newcomer.stop(timeout=10)
            assert pool.wait_for_members(lambda m: set(m) == {"w-0"}, 15)
            w2 = start_w2()
            assert pool.wait_for_members(lambda m: set(m) == {"w-0", "w-2"}, 15)
            deadline = time.monotonic() + 15
            while read(pool, kept) != [1] * len(kept) and time.monotonic() < deadline:
                time.sleep(0.1)  # (until its catch-up is done: misses meanwhile)
            assert read(pool, kept) == [1] * len(kept), "w-2 serves what nobody wrote meanwhile"
            got = read(pool, moved)
        assert got == [-1] * len(moved), f"served older than what was {change} while w-2 was away: {got}"
    finally:
        w2.stop(timeout=10)

"""Adversarial checks of tenant isolation beyond the keys a request names: what one tenant does inside its
own namespace must not undo another tenant's removals and clears (the worker's bounded tables of
tombstones and clear marks are shared by every tenant), nor let it hold more of the arena than its quota
(blocks it removed while its own stalled reads still lease them).

Each test names the bug it shows; each fails on the code it was written against."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rawhelp import A_TOKEN, B_TOKEN, POOL, tenant_worker

from kvpool.core import protocol as P
from kvpool.core.client import PoolClient
from kvpool.core.connection import Connection
from kvpool.core.server import Worker
from kvpool.core.transport import connect
from kvpool.core.versions import Clears, Tombstones


@contextmanager
def _conn(address: str, token: str, timeout_s: float) -> Iterator[Connection]:
    """A raw connection (the calls a cluster client makes: versions, versioned puts and removes)."""
    c = connect(address, token, timeout_s)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    w = tenant_worker(tmp_path)
    yield w
    w.stop()


def _old_copy_of_b_k_comes_back(w: Worker, v_old: int) -> tuple[int, bytes | None]:
    """What a cluster reader compares replicas against for b's key (the miss's removal version), then what
    tenant b reads after the late put of its older copy that a read repair (or a replica back from a
    pause, or a catch-up) sends with the pool token, stamped with the copy's own old version."""
    with _conn(w.address, B_TOKEN, 5) as b:
        _, (seen,) = b.batch_versions([b"b/k"])
    with _conn(w.address, POOL, 5) as repair:
        repair.batch_put([b"b/k"], [b"tenant b's old bytes"], versions=[v_old])
    with PoolClient(mode="local", worker=w.address, token=B_TOKEN, timeout_s=5) as b2:
        return seen, b2.get("b/k")


# Bug: a clear is remembered as a mark (versions.Clears, max_marks 1,024, "the oldest clears go first") so
# that an older put of a key it covered that arrives late (a paused replica's, a read repair's) does not
# bring the key back, and a read that misses reports the clear's version (what outvotes a replica's older
# copy). The marks are one table for every tenant: tenant a clearing 1,024 prefixes of its own namespace
# (`clear("a/<i>/")`, each allowed) pushes out tenant b's clear, and b's cleared bytes come back.
# (core/versions.py Clears.add; core/worker_ops.py _clear.)
def test_another_tenants_clears_of_its_own_keys_do_not_undo_a_tenants_clear(worker: Worker) -> None:
    with _conn(worker.address, B_TOKEN, 5) as b:
        b.batch_put([b"b/k"], [b"tenant b's old bytes"])
        _, (v_old,) = b.batch_versions([b"b/k"])
        b.clear(None)  # a tenant's clear: "b/"
        present, (v_clear,) = b.batch_versions([b"b/k"])
    assert present == [False] and v_clear > v_old
    with _conn(worker.address, A_TOKEN, 5) as a:
        for i in range(Clears().max_marks):
            a.clear(b"a/%d/" % i)  # tenant a's own namespace only
    seen, got = _old_copy_of_b_k_comes_back(worker, v_old)
    assert seen >= v_clear and got is None, (
        f"tenant b cleared 'b/' (as of {v_clear}); after tenant a cleared {Clears().max_marks} prefixes of 'a/', "
        f"b's key reads as removed as of {seen} and a late put of its older copy (version {v_old}) makes b read "
        f"{got!r}")


# Bug: the same for removals: each leaves a tombstone (versions.Tombstones, at most 262,144 per worker, the
# oldest go first), one table for every tenant. Tenant a removing 262,144 keys of its own namespace (absent
# ones leave tombstones too: four REMOVE frames) forgets tenant b's removal, and b's removed bytes come back
# with a late older put. (core/versions.py Tombstones._trim; core/cache.py remove_as_of.)
def test_another_tenants_removals_of_its_own_keys_do_not_undo_a_tenants_removal(worker: Worker) -> None:
    with _conn(worker.address, B_TOKEN, 5) as b:
        b.batch_put([b"b/k"], [b"tenant b's old bytes"])
        _, (v_old,) = b.batch_versions([b"b/k"])
        assert b.batch_remove([b"b/k"]) == [True]
        _, (v_removed,) = b.batch_versions([b"b/k"])
    assert v_removed > v_old
    n = Tombstones().max_keys
    with _conn(worker.address, A_TOKEN, 30) as a:
        for j in range(n // P.MAX_BATCH):
            a.remove_as_of([b"a/%d.%d" % (j, i) for i in range(P.MAX_BATCH)], None)
    seen, got = _old_copy_of_b_k_comes_back(worker, v_old)
    assert seen >= v_removed and got is None, (
        f"tenant b removed 'b/k' (as of {v_removed}); after tenant a removed {n} keys of 'a/', b's key reads as "
        f"removed as of {seen} and a late put of its older copy (version {v_old}) makes b read {got!r}")

"""Adversarial checks of the engine-facing backends (SGLang HiCache storage, FastDeploy's store, the
Mooncake drop-in) as engines call them: boundary inputs and pool failures in the middle of a call.
The promise (README "SGLang", "FastDeploy"): an engine never crashes or hangs because of the pool, gets a
miss or a failed write (logged once), never a wrong or partial page as a hit, and in a cluster a worker
that stops answering fails only the keys it owns."""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvpool.backends.fastdeploy import KVPoolStore
from kvpool.backends.mooncake_compat import MooncakeDistributedStore, Status
from kvpool.backends.mooncake_shim import shim_path

from bkhelp import HostBuffer
from sigstop import freeze

N, S = 32, 4096
TIMEOUT_S = 1.0


@contextmanager
def _fastdeploy_with_one_paused_worker(nats: Any, spawn: Callable[..., Any]) -> Iterator[tuple[Any, ...]]:
    """A FastDeploy store on a two-worker cluster holding N blocks, one worker paused (SIGSTOP):
    (store, keys, healthy indices, paused indices, src, dst). `retry_s` is long, so an outage the
    adapter starts shows in every later call."""
    workers = [spawn(nats_url=nats.url, node_id=f"n{i}") for i in range(2)]
    store = KVPoolStore("m", mode="cluster", nats_url=nats.url, timeout_s=TIMEOUT_S, node_id="client", retry_s=30)
    src, dst = HostBuffer(N * S), HostBuffer(N * S)
    src.array[:] = (np.arange(N * S) % 251).astype(np.uint8)
    store.register_buffer(src.ptr, src.nbytes)
    store.register_buffer(dst.ptr, dst.nbytes)
    try:
        assert store._io.call(lambda c: c.wait_for_members(lambda m: len(m) == 2, 10), lambda st: False)
        keys = [f"a{i}" for i in range(N)]
        assert store.batch_set(keys, [src.ptr + i * S for i in range(N)], [S] * N) == [0] * N
        freeze(workers[1].proc.pid)
        try:
            got = store.batch_get(keys, [dst.ptr + i * S for i in range(N)], [S] * N)
            healthy = [i for i, n in enumerate(got) if n == S]
            paused = [i for i, n in enumerate(got) if n != S]
            assert healthy and paused
            yield store, keys, healthy, paused, src, dst
        finally:
            os.kill(workers[1].proc.pid, signal.SIGCONT)
    finally:
        store.close()


def _healthy_reads(store: KVPoolStore, keys: list[str], healthy: list[int], dst: HostBuffer) -> list[int]:
    dst.array[:] = 0
    return store.batch_get([keys[i] for i in healthy], [dst.ptr + i * S for i in healthy], [S] * len(healthy))


# Bug: a remove that reaches a paused worker raises PoolUnavailable, which HostIO takes for a whole-pool
# outage: for retry_s every call, reads of the healthy worker's blocks included, is answered RPC_FAIL.
def test_a_delete_of_a_block_on_a_paused_worker_does_not_blind_reads_of_the_healthy_one(nats, spawn) -> None:
    with _fastdeploy_with_one_paused_worker(nats, spawn) as (store, keys, healthy, paused, src, dst):
        assert store.delete(keys[paused[0]], timeout=0) is False
        assert _healthy_reads(store, keys, healthy, dst) == [S] * len(healthy)


# Bug: same root cause, through clear(): a clear that one paused worker did not answer starts an outage.
def test_a_clear_unanswered_by_a_paused_worker_does_not_blind_the_healthy_one(nats, spawn) -> None:
    with _fastdeploy_with_one_paused_worker(nats, spawn) as (store, keys, healthy, paused, src, dst):
        store.clear()  # the healthy worker clears: its blocks are gone, a put of them must work again
        assert store.batch_set([keys[i] for i in healthy], [src.ptr + i * S for i in healthy],
                               [S] * len(healthy)) == [0] * len(healthy)


# Bug: Mooncake's batch_remove answers per key, but one malformed key (empty, too long for bytes, not a
# str) fails the whole batch: the well-formed keys are neither removed nor reported removed.
def test_mooncake_batch_remove_fails_a_bad_key_alone(small_env: None) -> None:
    store = MooncakeDistributedStore()
    try:
        assert store.setup("h", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", "embedded") == 0
        assert store.put("k", b"value") == 0 and store.put("j", b"value") == 0
        got = store.batch_remove(["", "k", b"x" * 600, "j"])  # type: ignore[list-item]
        assert got == [Status.INVALID_PARAMS, 0, Status.INVALID_PARAMS, 0]
        assert store.batch_is_exist(["k", "j"]) == [0, 0]
    finally:
        store.close()


@pytest.fixture
def mooncake_on_kvpool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`from mooncake.store import ...` resolves to the drop-in, as `PYTHONPATH=$(kvpool mooncake-shim)` does."""
    monkeypatch.syspath_prepend(shim_path())
    for name in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        monkeypatch.delitem(sys.modules, name)
    yield


# Bug: the drop-in's batch_get_into reports a stored object smaller than the room as a positive byte
# count, and SGLang's Mooncake backend (like FastDeploy's) takes any positive count as the whole page:
# a TP=1 instance loads the half-size page a TP=2 instance of the same model stored under the same key
# (SGLang's Mooncake keys carry the model and the rank, not the TP size) as a hit, half of it stale bytes.
def test_sglang_mooncake_backend_never_loads_a_smaller_object_as_a_whole_page(mooncake_on_kvpool: None,
                                                                              spawn: Callable[..., Any]) -> None:
    from sglang_cpu import host_pool
    from sglang_pools import PAGE, StorageBackendFactory, config

    worker = spawn()
    extra = {"master_server_address": worker.unix_path, "protocol": "tcp"}
    tp2 = host_pool("page_first", heads=1, seed=1)  # rank 0 of TP=2: half the KV heads
    tp1 = host_pool("page_first", heads=2, seed=2)
    a = StorageBackendFactory.create_backend("mooncake", config(extra_config=extra, tp_size=2, tp_rank=0), tp2)
    b = StorageBackendFactory.create_backend("mooncake", config(extra_config=extra, tp_size=1, tp_rank=0), tp1)
    try:
        a.register_mem_pool_host(tp2)
        b.register_mem_pool_host(tp1)
        keys = [f"{i:064x}" for i in range(1, 3)]
        assert a.batch_set_v1(keys, tp2.alloc(2 * PAGE)) == [True, True]
        dst = tp1.alloc(2 * PAGE)
        got = b.batch_get_v1(keys, dst)
        for i, hit in enumerate(got):  # a hit must be a whole page of this instance's layout
            assert not hit, f"page {i}: a half-size object from the TP=2 instance was loaded as a hit"
    finally:
        a.store.close()
        b.store.close()


# Bug: put() promises "-600 for ... one that is not bytes-like", but a numpy array whose items are not
# plain data (object or datetime dtype) raises TypeError / ValueError out of core.buffers.readable
# into the engine.
@pytest.mark.parametrize("value", [np.array([object()]), np.array(["2020-01-01"], dtype="datetime64[D]")],
                         ids=["object", "datetime64"])
def test_mooncake_put_of_a_value_that_is_not_plain_bytes_is_a_status(small_env: None, value: Any) -> None:
    store = MooncakeDistributedStore()
    try:
        assert store.setup("h", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", "embedded") == 0
        assert store.put("k", value) == Status.INVALID_PARAMS
        assert store.put_parts("k", b"ab", value) == Status.INVALID_PARAMS
        assert store.put_batch(["k"], [value]) == Status.INVALID_PARAMS
    finally:
        store.close()

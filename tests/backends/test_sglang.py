"""KVPoolHiCacheStorage against the installed SGLang: created through SGLang's storage backend factory
(the dynamic path, as the cache controller does it) and driven with SGLang's own host KV pools."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvpool.core.client import PoolClient
from kvpool.core.errors import ConfigError

from sglang_pools import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE,
    HiCacheStorage,
    KVPoolHiCacheStorage,
    StorageMetrics,
    create,
    dynamic_extra,
    host_pool,
    page_bytes,
)

SMALL = {"dram_bytes": "32MiB", "dram_slab_size": "1MiB", "prefault": False}
"""An embedded pool that is quick to create, as it would be written in the JSON extra config."""

Make = Callable[..., Any]


@pytest.fixture
def make() -> Iterator[Make]:
    """make(host, **extra-config options, storage config fields=...) -> a registered backend; all closed at the end."""
    made: list[Any] = []

    def _make(host: Any, *, fields: dict[str, Any] | None = None, **options: Any) -> Any:
        backend = create(host, dynamic_extra(**{**SMALL, **options}) if options.get("mode") in (None, "embedded")
                         else dynamic_extra(**options), **(fields or {}))
        made.append(backend)
        return backend

    yield _make
    for b in made:
        b.close()


def _pages(host: Any, n: int) -> tuple[list[str], torch.Tensor]:
    return [f"{i:064x}" for i in range(1, n + 1)], host.alloc(n * PAGE)


def _assert_same_pages(host: Any, src: torch.Tensor, dst: torch.Tensor, n: int) -> None:
    for i in range(n):
        assert page_bytes(host, int(dst[i * PAGE])) == page_bytes(host, int(src[i * PAGE])), f"page {i} differs"


def test_factory_dynamic_path_builds_a_hicache_storage(make: Make) -> None:
    host = host_pool()
    backend = make(host, interface_v1=1)
    assert isinstance(backend, KVPoolHiCacheStorage) and isinstance(backend, HiCacheStorage)
    assert backend.v1 and backend.mem_pool_host is host


@pytest.mark.parametrize("mla,layout", [(False, lay) for lay in MHA_LAYOUTS] + [(True, lay) for lay in MLA_LAYOUTS])
def test_v1_round_trip_every_byte(make: Make, mla: bool, layout: str) -> None:
    host = host_pool(layout, mla=mla)
    backend = make(host, interface_v1=1, fields={"is_mla_model": mla})
    keys, src = _pages(host, 5)
    assert backend.batch_set_v1(keys, src) == [True] * 5
    dst = host.alloc(5 * PAGE)
    assert backend.batch_get_v1(keys, dst) == [True] * 5
    _assert_same_pages(host, src, dst, 5)


def test_v1_partial_read_and_prefix_semantics(make: Make) -> None:
    host = host_pool("page_first")
    backend = make(host, interface_v1=1)
    keys, src = _pages(host, 4)
    stored = [0, 1, 3]  # page 2 is missing
    assert backend.batch_set_v1([keys[i] for i in stored],
                                torch.cat([src[i * PAGE:(i + 1) * PAGE] for i in stored])) == [True] * 3
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists(keys[3:]) == 1
    assert [backend.exists(k) for k in keys] == [True, True, False, True]
    assert backend.batch_get_v1(keys, host.alloc(4 * PAGE)) == [True, True, False, True]


def test_a_page_missing_one_part_is_not_present(make: Make) -> None:
    host = host_pool("page_first")
    backend = make(host, interface_v1=1)
    keys, src = _pages(host, 2)
    backend.batch_set_v1(keys, src)
    v_of_page_1 = backend._names(keys[1:])[1]  # MHA: K then V of all layers
    backend._io.call(lambda c: c.batch_remove([v_of_page_1]), lambda st: None)
    assert backend.batch_exists(keys) == 1
    assert backend.batch_get_v1(keys, host.alloc(2 * PAGE)) == [True, False]
    assert backend.batch_set_v1(keys, src) == [True, True]  # only the missing part is written again
    assert backend.batch_exists(keys) == 2


def test_tensor_form(make: Make) -> None:
    host = host_pool("page_first")
    backend = make(host)
    assert not backend.v1
    keys, src = _pages(host, 3)
    pages = [host.get_data_page(int(src[i * PAGE]), flat=True) for i in range(3)]
    assert backend.batch_set(keys[:2], pages[:2]) is True
    assert backend.set(keys[2], pages[2]) is True
    assert backend.batch_exists(keys + ["f" * 64]) == 3 and backend.exists(keys[0]) and not backend.exists("f" * 64)
    got = backend.batch_get(keys + ["f" * 64], [host.get_dummy_flat_data_page() for _ in range(4)])
    assert got[3] is None
    for page, g in zip(pages, got[:3]):
        assert g is not None and torch.equal(g.view(torch.uint8), page.contiguous().view(torch.uint8))
    one = backend.get(keys[1])  # no target: a new flat page
    assert one is not None and torch.equal(one.view(torch.uint8), pages[1].contiguous().view(torch.uint8))
    assert backend.get("f" * 64) is None
    dst = host.alloc(PAGE)  # as SGLang's generic path copies a page back into the host pool
    host.set_from_flat_data_page(int(dst[0]), got[0])
    assert page_bytes(host, int(dst[0])) == page_bytes(host, int(src[0]))


def test_tensor_form_calls_on_a_v1_backend_use_whole_pages(make: Make) -> None:
    host = host_pool("page_first")
    backend = make(host, interface_v1=1)  # v1 stores a page as K and V parts; the tensor form as one
    keys, src = _pages(host, 2)
    pages = [host.get_data_page(int(src[i * PAGE]), flat=True) for i in range(2)]
    assert backend.batch_set(keys, pages) is True
    got = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    for page, g in zip(pages, got):
        assert g is not None and torch.equal(g.view(torch.uint8), page.contiguous().view(torch.uint8))


def test_keys_are_namespaced_by_model_rank_and_layout(spawn: Any) -> None:
    worker = spawn()
    opts = {"mode": "local", "worker": worker.unix_path, "interface_v1": 1}
    host = host_pool("page_first")
    made: list[Any] = []
    try:
        writer = create(host, dynamic_extra(**opts))
        made.append(writer)
        keys, src = _pages(host, 2)
        assert writer.batch_set_v1(keys, src) == [True, True]
        others = (({"tp_rank": 1, "tp_size": 2}, "page_first"), ({"model_name": "other/model"}, "page_first"),
                  ({}, "page_first_direct"))
        for fields, layout in others:
            other = create(host_pool(layout), dynamic_extra(**opts), **fields)
            made.append(other)
            assert other.batch_exists(keys) == 0, (fields, layout)
        same = create(host_pool("page_first", seed=1), dynamic_extra(**opts))
        made.append(same)
        assert same.batch_exists(keys) == 2
    finally:
        for b in made:
            b.close()


def test_mla_pages_are_shared_by_tp_ranks(spawn: Any) -> None:
    """MLA KV is the same on every TP rank: SGLang lets rank 0 write it and every rank read it."""
    worker = spawn()
    opts = {"mode": "local", "worker": worker.address, "interface_v1": 1}  # TCP, for once
    r0_host, r1_host = host_pool("page_first", mla=True), host_pool("page_first", mla=True, seed=1)
    r0 = create(r0_host, dynamic_extra(**opts), mla=True, tp_rank=0, tp_size=2)
    r1 = create(r1_host, dynamic_extra(**opts), mla=True, tp_rank=1, tp_size=2)
    try:
        keys, src = _pages(r0_host, 3)
        assert r0.batch_set_v1(keys, src) == [True] * 3
        assert r1.batch_exists(keys) == 3
        dst = r1_host.alloc(3 * PAGE)
        assert r1.batch_get_v1(keys, dst) == [True] * 3
        for i in range(3):
            assert page_bytes(r1_host, int(dst[i * PAGE])) == page_bytes(r0_host, int(src[i * PAGE]))
    finally:
        r0.close()
        r1.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_round_trip_through_a_local_worker(make: Make, spawn: Any, layout: str) -> None:
    worker = spawn()
    host = host_pool(layout)
    backend = make(host, mode="local", worker=worker.unix_path, interface_v1=1)
    keys, src = _pages(host, 6)
    assert backend.batch_set_v1(keys, src) == [True] * 6
    dst = host.alloc(6 * PAGE)
    assert backend.batch_exists(keys) == 6
    assert backend.batch_get_v1(keys, dst) == [True] * 6
    _assert_same_pages(host, src, dst, 6)
    with PoolClient(mode="local", worker=worker.unix_path) as pool:  # the pages are in the worker
        assert pool.batch_exists(backend._names(keys)) == [True] * 6 * len(backend._kv)


def test_clear(make: Make) -> None:
    host = host_pool()
    backend = make(host, interface_v1=1)
    keys, src = _pages(host, 2)
    backend.batch_set_v1(keys, src)
    backend.clear()
    assert backend.batch_exists(keys) == 0


def test_get_stats_is_sglang_storage_metrics(make: Make) -> None:
    host = host_pool()
    backend = make(host, interface_v1=1, fields={"enable_storage_metrics": True})
    keys, src = _pages(host, 3)
    backend.batch_set_v1(keys[:2], src[:2 * PAGE])
    backend.batch_get_v1(keys, host.alloc(3 * PAGE))
    page = len(page_bytes(host, int(src[0])))
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert (stats.hit_pages, stats.miss_pages) == (2, 1)
    assert stats.bytes_written == stats.bytes_read == 2 * page
    assert (stats.get_batches, stats.set_batches) == (1, 1) and stats.get_seconds > 0 and stats.set_seconds > 0
    assert stats.prefetch_pgs == [3] and stats.backup_pgs == [2] and len(stats.prefetch_bandwidth) == 1
    again = backend.get_stats()  # per-batch lists are since the last call; totals keep running
    assert again.prefetch_pgs == [] and again.backup_pgs == [] and again.hit_pages == 2


def test_pool_down_reports_misses_and_logs_once(make: Make, spawn: Any, caplog: pytest.LogCaptureFixture) -> None:
    worker = spawn()
    host = host_pool()
    backend = make(host, mode="local", worker=worker.unix_path, interface_v1=1, retry_s=30)
    keys, src = _pages(host, 2)
    assert backend.batch_set_v1(keys, src) == [True, True]
    worker.kill()
    caplog.set_level(logging.WARNING, logger="kvpool.backends.sglang")
    for _ in range(3):
        assert backend.batch_get_v1(keys, host.alloc(2 * PAGE)) == [False, False]
        assert backend.batch_set_v1(keys, src) == [False, False]
        assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])
        assert backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None, None]
        assert backend.batch_set(keys, [host.get_data_page(int(src[0]))] * 2) is False
    backend.clear()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


def test_unreachable_pool_at_start_up_is_not_fatal(make: Make, tmp_path: Any) -> None:
    host = host_pool()
    backend = make(host, mode="local", worker=str(tmp_path / "no-worker.sock"), interface_v1=1)
    keys, src = _pages(host, 1)
    assert backend.batch_set_v1(keys, src) == [False]
    assert backend.batch_exists(keys) == 0


def test_misconfiguration_fails_at_start_up() -> None:
    with pytest.raises(ConfigError, match="dram_bites"):
        create(host_pool(), dynamic_extra(dram_bites="1GiB"))
    with pytest.raises(ConfigError, match="mode"):
        create(host_pool(), dynamic_extra(mode="nowhere"))


def test_v1_without_the_flag_or_with_wrong_slots_fails_softly(make: Make, caplog: pytest.LogCaptureFixture) -> None:
    host = host_pool()
    caplog.set_level(logging.WARNING, logger="kvpool.backends.sglang")
    tensor_form = make(host)
    keys, src = _pages(host, 2)
    assert tensor_form.batch_set_v1(keys, src) == [False, False]
    v1 = make(host, interface_v1=1)
    assert v1.batch_set_v1(keys, src[:PAGE]) == [False, False]
    assert v1.batch_get_v1(keys, src[:PAGE + 1]) == [False, False]
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 2


@pytest.mark.parametrize("v1", [0, 1])
def test_empty_calls_are_empty_answers(make: Make, v1: int) -> None:
    host = host_pool()
    b = make(host, interface_v1=v1)
    empty = torch.empty(0, dtype=torch.int64)
    assert b.batch_exists([]) == 0
    assert b.batch_get([]) == []
    assert b.batch_set([], []) is True
    if v1:
        assert b.batch_set_v1([], empty) == []
        assert b.batch_get_v1([], empty) == []


def test_a_block_of_another_size_under_the_same_key_is_a_miss_and_leaves_the_page(
        make: Make, spawn: Any) -> None:
    """Another engine (another head count, same model name, layout and dtype) wrote the same key with a
    larger and a smaller block: both pages read False, and the host pool's pages keep their bytes."""
    worker = spawn()
    host = host_pool()
    b = make(host, mode="local", worker=worker.unix_path, interface_v1=1)
    keys, src = _pages(host, 3)
    assert b.batch_set_v1(keys, src) == [True] * 3
    names = b._names(keys)
    size = len(page_bytes(host, int(src[0])))
    parts = len(names) // 3
    with PoolClient(mode="local", worker=worker.unix_path) as c:
        # page 0: every part twice as large; page 1: every part half as large
        c.batch_put(names[:parts], [bytes([7]) * (2 * size // parts)] * parts)
        c.batch_put(names[parts:2 * parts], [bytes([9]) * (size // parts // 2)] * parts)
    dst = host.alloc(3 * PAGE)
    got = b.batch_get_v1(keys, dst)  # (SGLang uses the pages up to the first False)
    assert got == [False, False, True]
    assert page_bytes(host, int(dst[2 * PAGE])) == page_bytes(host, int(src[2 * PAGE]))
    # the tensor form sees the foreign blocks too: misses, not exceptions
    assert b.batch_exists(keys) == 3  # present, but of another size: the get must say no

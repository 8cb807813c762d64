"""KVPoolHiCacheStorage's HiCache v2 (hybrid models' side pools) with SGLang's own host pool classes:
every side pool type SGLang 0.5.23 names, byte-exact; hit policies; pool outages; clear by namespace."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvpool.core.client import PoolClient

from sglang_pools import (
    PAGE,
    SIDE_POOLS,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    create,
    dynamic_extra,
    host_pool,
    side_pool,
)

SMALL = {"dram_bytes": "32MiB", "dram_slab_size": "1MiB", "prefault": False}

Make = Callable[..., Any]


@pytest.fixture
def make() -> Iterator[Make]:
    """make(anchor, {name: side pool}, **extra config) -> a backend with every pool registered as
    SGLang's hybrid controller registers them; all closed at the end."""
    made: list[Any] = []

    def _make(anchor: Any, pools: dict[Any, Any] | None = None, *, fields: dict[str, Any] | None = None,
              **options: Any) -> Any:
        extra = dynamic_extra(**({**SMALL, **options} if options.get("mode") in (None, "embedded") else options))
        backend = create(anchor, extra, **(fields or {}))
        made.append(backend)
        backend.register_mem_host_pool_v2(anchor, PoolName.KV)
        for name, pool in (pools or {}).items():
            backend.register_mem_host_pool_v2(pool, name)
        backend.on_host_pools_registered()
        return backend

    yield _make
    for b in made:
        b.close()


def keys(n: int, first: int = 1) -> list[str]:
    return [f"{i:064x}" for i in range(first, first + n)]


def page(pool: Any, slot: Any) -> bytes:
    """Every byte of the page at `slot`, through the pool's own accessor."""
    return pool.get_data_page(int(slot), flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def pages(pool: Any, slots: torch.Tensor) -> list[bytes]:
    return [page(pool, slots[i]) for i in range(0, len(slots), pool.page_size)]


def span(pool: Any, first_page: int, n: int) -> torch.Tensor:
    """The host slots of pages [first_page, first_page + n) (some side pools have no allocator: SGLang
    hands them the indices of the pool they ride on)."""
    return torch.arange(first_page * pool.page_size, (first_page + n) * pool.page_size, dtype=torch.int64)


def t(name: Any, slots: torch.Tensor | None, ks: list[str], policy: Any = PoolHitPolicy.ALL_PAGES,
      **kw: Any) -> Any:
    return PoolTransfer(name=name, host_indices=slots, keys=ks, hit_policy=policy, **kw)


@pytest.mark.parametrize("case", list(SIDE_POOLS))
def test_v2_round_trip_of_every_pool_type(make: Make, case: str) -> None:
    name, kind = SIDE_POOLS[case]
    anchor, side = side_pool(kind, name)
    backend = make(anchor, {name: side}, interface_v1=1)
    ks = keys(3)
    src, dst = span(side, 0, 3), span(side, 3, 3)
    assert pages(side, src) != pages(side, dst)
    assert backend.batch_set_v1(ks, span(anchor, 0, 3)) == [True] * 3
    assert backend.batch_set_v2([t(name, src, ks)]) == {name: [True] * 3}
    assert backend.batch_exists_v2(ks, [t(name, None, ks)]).extra_pool_hit_pages.get(name) == 3
    assert backend.batch_get_v2([t(name, dst, ks)]) == {name: [True] * 3}
    assert pages(side, dst) == pages(side, src)


@pytest.mark.parametrize("case", ["mamba", "deepseek_v4_c4", "indexer-layer_first"])
def test_v2_pages_cross_instances_through_a_worker(spawn: Any, case: str) -> None:
    """Written by one instance (its own host pools), read by another."""
    worker = spawn(dram_bytes="128MiB")
    name, kind = SIDE_POOLS[case]
    (a_anchor, a_side), (b_anchor, b_side) = side_pool(kind, name, seed=1), side_pool(kind, name, seed=2)
    opts = dynamic_extra(mode="local", worker=worker.unix_path, interface_v1=1)
    a, b = create(a_anchor, opts), create(b_anchor, opts)
    try:
        for backend, anchor, side in ((a, a_anchor, a_side), (b, b_anchor, b_side)):
            backend.register_mem_host_pool_v2(anchor, PoolName.KV)
            backend.register_mem_host_pool_v2(side, name)
        ks = keys(2)
        src, dst, kv_src = span(a_side, 0, 2), span(b_side, 2, 2), span(a_anchor, 0, 2)
        assert a.batch_set_v1(ks, kv_src) == [True, True]
        assert a.batch_set_v2([t(name, src, ks)]) == {name: [True, True]}
        hit = b.batch_exists_v2(ks, [t(name, None, ks)])
        assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (2, [1, 2])
        assert b.batch_get_v1(ks, span(b_anchor, 2, 2)) == [True, True]
        assert b.batch_get_v2([t(name, dst, ks)]) == {name: [True, True]}
        assert pages(b_side, dst) == pages(a_side, src)
    finally:
        a.close()
        b.close()


def _hybrid(make: Make) -> tuple[Any, Any, Any, Any]:
    """A backend with an MHA anchor, an SWA pool and a Mamba pool, the KV of 6 pages stored."""
    anchor, mamba = side_pool("mamba", PoolName.MAMBA)
    swa = host_pool("page_first", seed=3)
    backend = make(anchor, {PoolName.SWA: swa, PoolName.MAMBA: mamba}, interface_v1=1)
    assert backend.batch_set_v1(keys(6), anchor.alloc(6 * PAGE)) == [True] * 6
    return backend, anchor, swa, mamba


def test_v2_hit_policies(make: Make) -> None:
    backend, _, swa, mamba = _hybrid(make)
    ks = keys(6)
    assert backend.batch_set_v2([t(PoolName.SWA, swa.alloc(4 * PAGE), ks[:4])]) == {PoolName.SWA: [True] * 4}
    states = mamba.alloc(2)
    assert backend.batch_set_v2([t(PoolName.MAMBA, states, [ks[1], ks[3]])]) == {PoolName.MAMBA: [True, True]}

    all_pages = t(PoolName.SWA, None, ks)
    trailing = t(PoolName.MAMBA, None, ks[-1:], PoolHitPolicy.TRAILING_PAGES)
    r = backend.batch_exists_v2(ks, [all_pages])
    assert (r.kv_hit_pages, r.restorable_prefix_pages, r.extra_pool_hit_pages) == (
        4, [1, 2, 3, 4], {PoolName.KV: 6, PoolName.SWA: 4})
    r = backend.batch_exists_v2(ks, [trailing])  # a state exists after pages 2 and 4 only
    assert (r.kv_hit_pages, r.restorable_prefix_pages, r.extra_pool_hit_pages[PoolName.MAMBA]) == (4, [2, 4], 4)
    window = t(PoolName.SWA, None, ks[-2:], PoolHitPolicy.TRAILING_PAGES)  # SWA's last 2 pages
    r = backend.batch_exists_v2(ks, [window])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [1, 2, 3, 4])
    r = backend.batch_exists_v2(ks, [all_pages, trailing])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [2, 4])
    groups = t(PoolName.SWA, None, ks, PoolHitPolicy.BLOCK_GROUPS, group_pages=3)  # never gates the KV hit
    r = backend.batch_exists_v2(ks, [groups])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages[PoolName.SWA]) == (6, 3)
    r = backend.batch_exists_v2(ks, [t(PoolName.INDEXER, None, ks)])  # no such pool registered
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])
    backend._io.call(lambda c: c.batch_remove(backend._names(ks[2:3])[:1]), lambda st: None)  # KV page 3 loses a part
    r = backend.batch_exists_v2(ks, [trailing])
    assert (r.kv_hit_pages, r.restorable_prefix_pages, r.extra_pool_hit_pages) == (
        2, [2], {PoolName.KV: 2, PoolName.MAMBA: 2})


def test_v2_page_missing_one_part_is_absent_and_rewritten(make: Make) -> None:
    backend, _, _, mamba = _hybrid(make)
    ks = keys(2)
    src = mamba.alloc(2)
    backend.batch_set_v2([t(PoolName.MAMBA, src, ks)])
    pool = backend._side.pools["mamba"]
    assert pool.zero_copy and pool.parts == 3  # temporal state and two conv states
    backend._io.call(lambda c: c.batch_remove([pool.names(ks[1:])[2]]), lambda st: None)
    assert backend.batch_get_v2([t(PoolName.MAMBA, mamba.alloc(2), ks)]) == {PoolName.MAMBA: [True, False]}
    r = backend.batch_exists_v2(ks, [t(PoolName.MAMBA, None, ks[-1:], PoolHitPolicy.TRAILING_PAGES)])
    assert r.restorable_prefix_pages == [1]
    assert backend.batch_set_v2([t(PoolName.MAMBA, src, ks)]) == {PoolName.MAMBA: [True, True]}
    dst = mamba.alloc(2)
    assert backend.batch_get_v2([t(PoolName.MAMBA, dst, ks)]) == {PoolName.MAMBA: [True, True]}
    assert pages(mamba, dst) == pages(mamba, src)


def test_v2_several_pools_in_one_call_and_kv_derived_sidecars(make: Make) -> None:
    """As SGLang's controller reads an indexer riding on the KV slots and a Mamba state in one batch."""
    anchor, indexer = side_pool("dsa", PoolName.INDEXER)
    _, mamba = side_pool("mamba", PoolName.MAMBA)
    backend = make(anchor, {PoolName.INDEXER: indexer, PoolName.MAMBA: mamba}, interface_v1=1,
                   fields={"is_mla_model": True})
    ks = keys(2)
    kv, state = anchor.alloc(2 * 64), mamba.alloc(2)
    out = backend.batch_set_v2([t(PoolName.INDEXER, kv, ks), t(PoolName.MAMBA, state, ks)])
    assert out == {PoolName.INDEXER: [True, True], PoolName.MAMBA: [True, True]}
    kv2, state2 = anchor.alloc(2 * 64), mamba.alloc(2)
    out = backend.batch_get_v2([t(PoolName.INDEXER, kv2, ks), t(PoolName.MAMBA, state2, ks)])
    assert out == {PoolName.INDEXER: [True, True], PoolName.MAMBA: [True, True]}
    assert pages(indexer, kv2) == pages(indexer, kv) and pages(mamba, state2) == pages(mamba, state)
    names = {p.name: p.prefix for p in backend._side.pools.values()}
    assert "/mla/" in names["indexer"] and "/tp0of1/" in names["mamba"]  # Mamba state is per TP rank


def test_v2_logical_anchor_defers_to_its_pools(make: Make) -> None:
    """DeepSeek-V4: the KV anchor has no bytes; the compressed pools decide the hit."""
    anchor, c4 = side_pool("dsv4", PoolName.DEEPSEEK_V4_C4)
    backend = make(anchor, {PoolName.DEEPSEEK_V4_C4: c4}, interface_v1=1)
    ks = keys(5)
    slots = anchor.alloc(5 * PAGE)
    assert backend.batch_set_v1(ks, slots) == [True] * 5 and backend.batch_get_v1(ks, slots) == [True] * 5
    assert backend.batch_exists(ks) == 0
    backend.batch_set_v2([t(PoolName.DEEPSEEK_V4_C4, c4.alloc(3 * PAGE), ks[:3])])
    r = backend.batch_exists_v2(ks, [t(PoolName.DEEPSEEK_V4_C4, None, ks)])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (3, {PoolName.KV: 5, PoolName.DEEPSEEK_V4_C4: 3})
    assert backend.batch_exists_v2(ks, []).kv_hit_pages == 0


def test_v2_on_the_tensor_form(make: Make) -> None:
    """v2 does not depend on interface_v1: the main KV then moves as flat pages."""
    anchor, mamba = side_pool("mamba", PoolName.MAMBA)
    backend = make(anchor, {PoolName.MAMBA: mamba})
    ks = keys(2)
    backend.batch_set(ks, [anchor.get_data_page(i * PAGE) for i in range(2)])
    backend.batch_set_v2([t(PoolName.MAMBA, mamba.alloc(2), ks)])
    r = backend.batch_exists_v2(ks, [t(PoolName.MAMBA, None, ks[-1:], PoolHitPolicy.TRAILING_PAGES)])
    assert r.kv_hit_pages == 2


def test_v2_wrong_slot_count_and_pool_down_fail_softly(make: Make, spawn: Any,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    worker = spawn()
    anchor, mamba = side_pool("mamba", PoolName.MAMBA)
    backend = make(anchor, {PoolName.MAMBA: mamba}, mode="local", worker=worker.unix_path, interface_v1=1,
                   retry_s=30)
    ks = keys(2)
    assert backend.batch_set_v2([t(PoolName.MAMBA, mamba.alloc(3), ks)]) == {PoolName.MAMBA: [False, False]}
    assert backend.batch_set_v2([t(PoolName.DRAFT, mamba.alloc(2), ks)]) == {PoolName.DRAFT: [False, False]}
    assert backend.batch_set_v2([t(PoolName.MAMBA, mamba.alloc(2), ks)]) == {PoolName.MAMBA: [True, True]}
    worker.kill()
    caplog.set_level(logging.WARNING, logger="kvpool.backends.sglang")
    caplog.clear()
    for _ in range(3):
        assert backend.batch_get_v2([t(PoolName.MAMBA, mamba.alloc(2), ks)]) == {PoolName.MAMBA: [False, False]}
        assert backend.batch_set_v2([t(PoolName.MAMBA, mamba.alloc(2), ks)]) == {PoolName.MAMBA: [False, False]}
        assert backend.batch_exists_v2(ks, [t(PoolName.MAMBA, None, ks)]).kv_hit_pages == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


def test_clear_removes_only_its_own_namespace(spawn: Any) -> None:
    worker = spawn()
    opts = dynamic_extra(mode="local", worker=worker.unix_path, interface_v1=1)
    made: list[Any] = []

    def backend(layout: str = "page_first", dtype: Any = None, **fields: Any) -> tuple[Any, Any, Any]:
        import sglang_cpu

        anchor = sglang_cpu.host_pool(layout, pages=16, page=PAGE, dtype=dtype)
        _, mamba = side_pool("mamba", PoolName.MAMBA)
        b = create(anchor, opts, **fields)
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        made.append(b)
        b.batch_set_v1(keys(2), anchor.alloc(2 * PAGE))
        b.batch_set_v2([t(PoolName.MAMBA, mamba.alloc(2), keys(2))])
        return b, anchor, mamba

    try:
        mine, _, _ = backend()
        others = [backend(model_name="org/other")[0], backend("layer_first")[0],
                  backend(dtype=torch.float16)[0], backend(tp_rank=1, tp_size=2)[0]]
        with PoolClient(mode="local", worker=worker.unix_path) as pool:
            pool.put("not-sglang/" + "a" * 64, b"x")
        mamba_t = [t(PoolName.MAMBA, None, keys(2), PoolHitPolicy.TRAILING_PAGES)]
        assert mine.batch_exists_v2(keys(2), mamba_t).kv_hit_pages == 2
        mine.clear()
        assert mine.batch_exists(keys(2)) == 0
        assert mine._side.present(mamba_t[0], keys(2)) == [False, False]
        for other in others:
            assert other.batch_exists_v2(keys(2), mamba_t).kv_hit_pages == 2, other._prefix
        with PoolClient(mode="local", worker=worker.unix_path) as pool:
            assert pool.batch_exists(["not-sglang/" + "a" * 64]) == [True]
    finally:
        for b in made:
            b.close()


@pytest.mark.parametrize("policies", [(PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES),
                                      (PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.TRAILING_PAGES)])
def test_v2_hits_agree_with_sglangs_own_file_backend(make: Make, tmp_path: Any, policies: tuple[Any, Any]) -> None:
    """The same pages stored through kvpool and through SGLang's `HiCacheFile` (its reference v2
    implementation): the same usable prefix, stop points and per-pool boundaries, over random holes."""
    import random

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from sglang_pools import config

    anchor, mamba = side_pool("mamba", PoolName.MAMBA)
    swa = host_pool("page_first", seed=3)
    pools = {PoolName.SWA: swa, PoolName.MAMBA: mamba}
    ours = make(anchor, pools, interface_v1=1)
    theirs = HiCacheFile(config(extra_config={"file_storage_path": str(tmp_path)}), str(tmp_path))
    theirs.register_mem_pool_host(anchor)
    for name, pool in pools.items():
        theirs.register_mem_host_pool_v2(pool, name)
    rng = random.Random(0)
    for trial in range(12):
        ks = keys(8, first=100 * trial + 1)
        kv_pages = rng.randint(0, 8)
        if kv_pages:
            ours.batch_set_v1(ks[:kv_pages], span(anchor, 0, kv_pages))
            theirs.batch_set(ks[:kv_pages], [anchor.get_data_page(p * PAGE) for p in range(kv_pages)])
        for name, pool in pools.items():
            held = [ks[i] for i in range(8) if rng.random() < 0.7]
            if held:
                stored = t(name, span(pool, 0, len(held)), held)
                assert ours.batch_set_v2([stored]) == theirs.batch_set_v2([stored]) == {name: [True] * len(held)}
        query = [t(PoolName.SWA, None, ks[-2:], policies[0]), t(PoolName.MAMBA, None, ks[-1:], policies[1])]
        a, b = ours.batch_exists_v2(ks, query), theirs.batch_exists_v2(ks, query)
        assert (a.kv_hit_pages, a.restorable_prefix_pages, a.extra_pool_hit_pages) == (
            b.kv_hit_pages, b.restorable_prefix_pages, b.extra_pool_hit_pages), trial

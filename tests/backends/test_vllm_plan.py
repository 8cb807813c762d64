"""The vLLM connector's scheduler-side arithmetic and its paged-KV copies, without vLLM: keys and
namespaces, matched-token counts, per-step load/save plans, and byte-exact gather/scatter/load/save
through a real (embedded) pool."""
from __future__ import annotations

import logging

import pytest
import torch

from kvpool.backends._hostio import HostIO
from kvpool.backends._vllm_paged import PagedKV
from kvpool.backends._vllm_plan import (
    Planner,
    Transfer,
    layer_groups,
    loadable_blocks,
    namespace,
    new_matched_tokens,
    part_keys,
    pool_config,
    pool_keys,
    request_namespace,
)
from kvpool.core.client import PoolClient
from kvpool.core.errors import ConfigError, PoolUnavailable

from bkhelp import SMALL_POOL

BS = 32
NS = namespace("llama", "bfloat16", BS, 0, 1, "cpu/FullAttentionSpec/2L/2x32x256")
TOKENS = list(range(1000, 1200))  # 200 tokens: 6 full blocks and 8 tokens


# ----- pool configuration ----------------------------------------------------------------------

def test_pool_config_takes_client_options_and_leaves_the_adapters_own() -> None:
    cfg = pool_config({"nats_url": "nats://127.0.0.1:4222", "timeout_s": 2, "model_name": "m", "retry_s": 3})
    assert (cfg.mode, cfg.nats_url, cfg.timeout_s) == ("cluster", "nats://127.0.0.1:4222", 2.0)
    assert pool_config({"worker": "/run/kvpool.sock"}).mode == "local"


def test_pool_config_reads_kvpool_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_NATS_URL", "nats://10.0.0.1:4222")
    assert pool_config(None).nats_url == "nats://10.0.0.1:4222"


@pytest.mark.parametrize("extra, match", [
    (None, "needs a shared pool"),
    ({"mode": "embedded"}, "needs a shared pool"),
    ({"nats_url": "nats://x:1", "nats": "typo"}, "unknown ClientConfig option"),
])
def test_pool_config_refuses_a_private_pool_and_unknown_keys(extra: dict | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        pool_config(extra)


# ----- keys ------------------------------------------------------------------------------------

def test_keys_are_stable_prefixed_and_cover_full_blocks_only() -> None:
    keys = pool_keys(TOKENS, BS, NS)
    assert len(keys) == 6
    assert all(k.startswith("vllm/") and len(k) == 5 + 64 for k in keys)
    assert keys == pool_keys(list(TOKENS), BS, NS)  # a pure function of tokens and namespace
    assert pool_keys(TOKENS[:96] + [7] * 104, BS, NS)[:3] == keys[:3]  # a shared prefix shares its keys
    assert pool_keys(TOKENS[:96] + [7] * 104, BS, NS)[3] != keys[3]


@pytest.mark.parametrize("other", [
    namespace("llama-2", "bfloat16", BS, 0, 1, "cpu/FullAttentionSpec/2L/2x32x256"),
    namespace("llama", "float16", BS, 0, 1, "cpu/FullAttentionSpec/2L/2x32x256"),
    namespace("llama", "bfloat16", BS, 1, 2, "cpu/FullAttentionSpec/2L/2x32x256"),
    namespace("llama", "bfloat16", BS, 0, 1, "cuda/FullAttentionSpec/2L/2x32x256"),
    request_namespace(NS, lora="adapter"),
    request_namespace(NS, cache_salt="tenant-a"),
    request_namespace(NS, mm_hashes=["img0"]),
])
def test_every_namespace_part_changes_every_key(other: str) -> None:
    assert set(pool_keys(TOKENS, BS, other)).isdisjoint(pool_keys(TOKENS, BS, NS))


def test_request_namespace_without_extras_is_the_base() -> None:
    assert request_namespace(NS) == NS


@pytest.mark.parametrize("layers, layer_bytes, cap, groups", [
    (6, 1000, 10_000, [(0, 6)]),
    (6, 1000, 3000, [(0, 3), (3, 6)]),
    (7, 1000, 3000, [(0, 3), (3, 6), (6, 7)]),
    (2, 5000, 3000, [(0, 1), (1, 2)]),  # a layer larger than the cap still gets a part of its own
])
def test_layer_groups_split_large_token_blocks_by_whole_layers(layers: int, layer_bytes: int, cap: int,
                                                               groups: list[tuple[int, int]]) -> None:
    assert layer_groups(layers, layer_bytes, cap) == groups


def test_part_keys_keep_one_part_unsuffixed_and_order_parts_block_by_block() -> None:
    assert part_keys(["a", "b"], 1) == ["a", "b"]
    assert part_keys(["a", "b"], 2) == ["a/0of2", "a/1of2", "b/0of2", "b/1of2"]


# ----- matched tokens --------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens, loadable", [(1, 0), (32, 0), (33, 1), (64, 1), (65, 2), (200, 6), (192, 5)])
def test_loadable_blocks_always_leave_the_last_token(num_tokens: int, loadable: int) -> None:
    assert loadable_blocks(num_tokens, BS) == loadable
    assert loadable * BS < num_tokens


@pytest.mark.parametrize("pool, num_tokens, local, expected", [
    (0, 200, 0, 0),       # miss
    (6, 200, 0, 192),     # everything loadable
    (6, 192, 0, 160),     # the whole prompt is in the pool: its last block is computed
    (3, 200, 0, 96),      # a partial hit
    (6, 200, 64, 128),    # vLLM has 2 blocks itself: only the rest comes from the pool
    (2, 200, 96, 0),      # vLLM has more than the pool
    (6, 200, 192, 0),
])
def test_new_matched_tokens(pool: int, num_tokens: int, local: int, expected: int) -> None:
    assert new_matched_tokens(pool, num_tokens, local, BS) == expected


# ----- the planner -----------------------------------------------------------------------------

def _planner_with(pool_blocks: int, local: int = 0, num_tokens: int = 200) -> tuple[Planner, list[str], int]:
    p = Planner(BS)
    keys = pool_keys(TOKENS[:num_tokens], BS, NS)
    n = p.match("r", lambda: keys, num_tokens, local, lambda ks: min(pool_blocks, len(ks)))
    return p, keys, n


def test_a_hit_loads_the_blocks_after_the_local_hit_and_saves_none_the_pool_has() -> None:
    p, keys, n = _planner_with(pool_blocks=6, local=64)
    assert n == 128
    assert p.allocated("r", n) == (2, 4)
    blocks = [10, 11, 12, 13, 14, 15, 16]
    p.scheduled("r", blocks, replace=True, num_computed_tokens=64 + n, num_scheduled_tokens=200 - 64 - n)
    plan = p.take_plan()
    assert plan.loads == [Transfer("r", tuple(keys[2:6]), (12, 13, 14, 15))]
    assert plan.saves == []  # all 6 full blocks are in the pool already
    assert p.take_plan().loads == []  # a plan is taken once


def test_a_miss_saves_each_full_prompt_block_once_as_chunked_prefill_completes_it() -> None:
    p, keys, n = _planner_with(pool_blocks=0)
    assert n == 0 and p.allocated("r", 0) is None
    p.scheduled("r", [5, 6, 7], replace=True, num_computed_tokens=0, num_scheduled_tokens=80)  # chunk 1: 80 tokens
    assert p.take_plan().saves == [Transfer("r", tuple(keys[:2]), (5, 6))]
    p.scheduled("r", [8, 9, 10, 11], replace=False, num_computed_tokens=80, num_scheduled_tokens=120)
    plan = p.take_plan()
    assert plan.loads == [] and plan.saves == [Transfer("r", tuple(keys[2:6]), (7, 8, 9, 10))]
    p.scheduled("r", None, replace=False, num_computed_tokens=200, num_scheduled_tokens=1)  # decode: nothing new
    assert p.take_plan().saves == []


def test_a_partial_pool_hit_saves_the_blocks_the_pool_lacks() -> None:
    p, keys, n = _planner_with(pool_blocks=3)
    p.allocated("r", n)
    p.scheduled("r", list(range(7)), replace=True, num_computed_tokens=n, num_scheduled_tokens=200 - n)
    plan = p.take_plan()
    assert plan.loads == [Transfer("r", tuple(keys[:3]), (0, 1, 2))]
    assert plan.saves == [Transfer("r", tuple(keys[3:6]), (3, 4, 5))]


def test_the_pool_failing_to_answer_is_a_miss() -> None:
    p = Planner(BS)

    def down(keys: list[str]) -> int:
        return 0  # what the connector's fail-soft prefix_match answers for an unreachable pool

    assert p.match("r", lambda: pool_keys(TOKENS, BS, NS), 200, 0, down) == 0


def test_repeated_matches_compute_keys_once_and_use_the_last_local_count() -> None:
    p = Planner(BS)
    calls = []

    def keys() -> list[str]:
        calls.append(1)
        return pool_keys(TOKENS, BS, NS)

    p.match("r", keys, 200, 0, lambda ks: 6)
    p.match("r", keys, 200, 96, lambda ks: 6)  # the scheduler retried after vLLM cached 3 blocks
    assert len(calls) == 1
    assert p.allocated("r", 96) == (3, 3)


def test_finished_requests_are_forgotten_and_later_calls_ignored() -> None:
    p, _, _ = _planner_with(pool_blocks=6)
    assert len(p) == 1
    p.finished("r")
    assert len(p) == 0
    p.scheduled("r", [1], replace=True, num_computed_tokens=0, num_scheduled_tokens=200)
    assert p.take_plan().saves == []


def test_saving_off_plans_loads_only() -> None:
    p = Planner(BS, save=False)
    keys = pool_keys(TOKENS, BS, NS)
    n = p.match("r", lambda: keys, 200, 0, lambda ks: 2)
    p.allocated("r", n)
    p.scheduled("r", list(range(7)), replace=True, num_computed_tokens=n, num_scheduled_tokens=200 - n)
    plan = p.take_plan()
    assert len(plan.loads) == 1 and plan.saves == []


def test_prompt_without_token_ids_matches_nothing() -> None:
    p = Planner(BS)
    assert p.match("r", lambda: [], 200, 0, lambda ks: pytest.fail("no keys: no pool call")) == 0


# ----- paged KV <-> pool blocks ----------------------------------------------------------------

LAYERS, NUM_BLOCKS, HEADS, HEAD_DIM = 3, 12, 2, 64


def _cpu_kv(seed: int, device: str = "cpu") -> list[torch.Tensor]:
    """vLLM CPU backend per-layer caches: [blocks, kv heads, block size, 2 * head dim], bf16."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD_DIM, generator=g).to(torch.bfloat16).to(device)
            for _ in range(LAYERS)]


def _strided_kv(seed: int, device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer views of one [blocks, layers, ...] buffer with heads outermost in each block, so no
    block is contiguous (exercises the per-block fallback)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(HEADS, NUM_BLOCKS, LAYERS, BS, 2 * HEAD_DIM, generator=g).to(torch.bfloat16).to(device)
    return [raw[:, :, j].transpose(0, 1) for j in range(LAYERS)]


ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA device")])


@pytest.fixture
def io() -> HostIO:
    h = HostIO(lambda: PoolClient(**SMALL_POOL), logger=logging.getLogger("test.vllm"))
    yield h
    h.close()


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("make", [_cpu_kv, _strided_kv])
def test_save_then_load_moves_exact_bytes_between_different_blocks(io: HostIO, make, device: str) -> None:
    """On a GPU (vLLM's layers are CUDA tensors there) the gather and scatter stay on the device, and
    the pool moves the blocks through pinned host memory."""
    src, dst = make(1, device), make(2, device)
    a, b = PagedKV(src, NUM_BLOCKS, staging_bytes=2 * LAYERS * HEADS * BS * 2 * HEAD_DIM * 2), PagedKV(dst, NUM_BLOCKS)
    assert a.fast == (make is _cpu_kv)
    assert a.block_bytes == LAYERS * HEADS * BS * 2 * HEAD_DIM * 2
    keys = pool_keys(TOKENS, BS, NS)[:5]
    assert a.save(io, keys, [7, 2, 9, 0, 4]) == 5  # 3 chunks of at most 2 blocks
    assert io.call(lambda c: c.prefix_match(keys), lambda st: -1) == 5
    untouched = [t.clone() for t in dst]
    assert b.load(io, keys, [1, 3, 5, 8, 11]) == 5
    for s, d, u in zip(src, dst, untouched):
        for sb, db in zip([7, 2, 9, 0, 4], [1, 3, 5, 8, 11]):
            assert torch.equal(s[sb], d[db])
        for other in (0, 2, 4, 6, 7, 9, 10):
            assert torch.equal(d[other], u[other])


def test_load_stops_at_the_first_missing_block(io: HostIO) -> None:
    src, dst = _cpu_kv(1), _cpu_kv(2)
    a, b = PagedKV(src, NUM_BLOCKS), PagedKV(dst, NUM_BLOCKS)
    keys = pool_keys(TOKENS, BS, NS)[:4]
    a.save(io, keys[:2] + keys[3:], [0, 1, 3])  # block 2 never stored
    before = [t.clone() for t in dst]
    assert b.load(io, keys, [4, 5, 6, 7]) == 2
    assert all(torch.equal(d[6], u[6]) and torch.equal(d[7], u[7]) for d, u in zip(dst, before))


def test_a_block_of_another_size_is_a_miss(io: HostIO) -> None:
    dst = _cpu_kv(2)
    key = pool_keys(TOKENS, BS, NS)[0]
    io.call(lambda c: c.put(key, b"x" * 100), lambda st: None)
    assert PagedKV(dst, NUM_BLOCKS).load(io, [key], [0]) == 0


def test_an_unreachable_pool_is_a_miss_and_a_skipped_save(caplog: pytest.LogCaptureFixture) -> None:
    def connect() -> PoolClient:
        raise PoolUnavailable("no worker at 127.0.0.1:9")

    io = HostIO(connect, logger=logging.getLogger("test.vllm"), retry_s=60)
    kv = PagedKV(_cpu_kv(1), NUM_BLOCKS)
    keys = pool_keys(TOKENS, BS, NS)[:3]
    assert kv.save(io, keys, [0, 1, 2]) == 0
    assert kv.load(io, keys, [0, 1, 2]) == 0
    assert sum("kvpool unavailable" in r.getMessage() for r in caplog.records) == 1  # logged once
    io.close()


def test_a_token_block_split_into_parts_moves_whole_and_needs_every_part(io: HostIO) -> None:
    layer_bytes = HEADS * BS * 2 * HEAD_DIM * 2
    src, dst = _cpu_kv(1), _cpu_kv(2)
    a = PagedKV(src, NUM_BLOCKS, max_part_bytes=2 * layer_bytes)
    b = PagedKV(dst, NUM_BLOCKS, max_part_bytes=2 * layer_bytes)
    assert a.groups == [(0, 2), (2, 3)]
    keys = pool_keys(TOKENS, BS, NS)[:3]
    assert a.save(io, keys, [0, 1, 2]) == 3
    parts = part_keys(keys, 2)
    assert io.call(lambda c: c.prefix_match(parts), lambda st: -1) == 6
    io.call(lambda c: c.batch_remove([parts[5]]), lambda st: None)  # the last layer of block 2
    assert b.load(io, keys, [9, 10, 11]) == 2
    assert all(torch.equal(s[0:2], d[9:11]) for s, d in zip(src, dst))


def test_layers_of_different_shapes_are_refused() -> None:
    layers = _cpu_kv(1)
    with pytest.raises(ValueError, match="differ"):
        PagedKV([layers[0], layers[1][:, :1]], NUM_BLOCKS)


def test_layers_on_no_cpu_or_cuda_device_are_refused() -> None:
    layers = [torch.empty(NUM_BLOCKS, HEADS, BS, 2 * HEAD_DIM, dtype=torch.bfloat16, device="meta")] * 2
    with pytest.raises(ValueError, match="on no CPU or CUDA device"):
        PagedKV(layers, NUM_BLOCKS)


def test_kernel_block_views_are_regrouped_into_manager_blocks(io: HostIO) -> None:
    """A cache split into kernel blocks (2 per manager block) moves manager blocks whole."""
    src = [t.reshape(NUM_BLOCKS * 2, HEADS, BS // 2, 2 * HEAD_DIM) for t in _cpu_kv(1)]
    dst = [t.reshape(NUM_BLOCKS * 2, HEADS, BS // 2, 2 * HEAD_DIM) for t in _cpu_kv(2)]
    a, b = PagedKV(src, NUM_BLOCKS), PagedKV(dst, NUM_BLOCKS)
    key = pool_keys(TOKENS, BS, NS)[:1]
    a.save(io, key, [3])
    assert b.load(io, key, [5]) == 1
    assert all(torch.equal(s[6:8], d[10:12]) for s, d in zip(src, dst))

"""Pages shared across tensor-parallel sizes: with SGLang's `tp_lcm_size` and the `page_head` host
layout, an MHA rank stores K and V per group of KV heads, so a TP=2 instance reads what a TP=1
instance wrote and the other way round, byte for byte."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import sglang_cpu
from sglang_pools import PAGE, create, dynamic_extra

HEADS = 4
"""KV heads of the model; a TP=2 rank holds 2."""


@pytest.fixture
def opts(spawn: Any) -> Iterator[dict[str, Any]]:
    worker = spawn()
    yield dynamic_extra(mode="local", worker=worker.unix_path, interface_v1=1)


@pytest.fixture
def made() -> Iterator[list[Any]]:
    backends: list[Any] = []
    yield backends
    for b in backends:
        b.close()


def rank(opts: dict[str, Any], made: list[Any], tp_rank: int, tp_size: int, lcm: int | None = 2,
         layout: str = "page_head", seed: int = 0) -> tuple[Any, Any]:
    """(backend, host pool) of one rank, configured as SGLang configures it from `tp_lcm_size`."""
    host = sglang_cpu.host_pool(layout, pages=16, page=PAGE, heads=HEADS // tp_size, seed=seed + tp_rank)
    split = bool(lcm) and layout == "page_head" and lcm > tp_size  # SGLang's should_split_heads
    backend = create(host, opts, tp_rank=tp_rank, tp_size=tp_size, tp_lcm_size=lcm, should_split_heads=split)
    made.append(backend)
    return backend, host


def heads(host: Any, slot: int, first: int, count: int) -> torch.Tensor:
    """K and V of KV heads [first, first + count) of the page at `slot` (page_head: page, head, token...)."""
    return host.kv_buffer[:, slot // PAGE, first:first + count].contiguous().view(torch.uint8)  # NaNs compare bytewise


def keys(n: int) -> list[str]:
    return [f"{i:064x}" for i in range(1, n + 1)]


def test_tp2_ranks_read_what_a_tp1_instance_wrote(opts: dict[str, Any], made: list[Any]) -> None:
    writer, w_host = rank(opts, made, 0, 1)
    src = torch.arange(0, 3 * PAGE)
    assert writer.batch_set_v1(keys(3), src) == [True] * 3
    for r in range(2):
        reader, r_host = rank(opts, made, r, 2, seed=10)
        dst = torch.arange(5 * PAGE, 8 * PAGE)
        assert not torch.equal(heads(r_host, 5 * PAGE, 0, 2), heads(w_host, 0, 2 * r, 2))
        assert reader.batch_exists(keys(3)) == 3
        assert reader.batch_get_v1(keys(3), dst) == [True] * 3
        for p in range(3):
            assert torch.equal(heads(r_host, (5 + p) * PAGE, 0, 2), heads(w_host, p * PAGE, 2 * r, 2)), (r, p)


def test_a_tp1_instance_reads_what_tp2_ranks_wrote(opts: dict[str, Any], made: list[Any]) -> None:
    ranks = [rank(opts, made, r, 2) for r in range(2)]
    for backend, _ in ranks:
        assert backend.batch_set_v1(keys(2), torch.arange(0, 2 * PAGE)) == [True, True]
    reader, r_host = rank(opts, made, 0, 1, seed=20)
    assert reader.batch_exists(keys(2)) == 2
    assert reader.batch_get_v1(keys(2), torch.arange(4 * PAGE, 6 * PAGE)) == [True, True]
    for p in range(2):
        for r, (_, host) in enumerate(ranks):
            assert torch.equal(heads(r_host, (4 + p) * PAGE, 2 * r, 2), heads(host, p * PAGE, 0, 2))


def test_half_the_head_groups_is_not_a_page(opts: dict[str, Any], made: list[Any]) -> None:
    """A TP=1 reader needs both head groups of a page: one TP=2 rank's share is a miss."""
    only_rank_1, _ = rank(opts, made, 1, 2)
    only_rank_1.batch_set_v1(keys(2), torch.arange(0, 2 * PAGE))
    reader, _ = rank(opts, made, 0, 1, seed=30)
    assert reader.batch_exists(keys(2)) == 0
    assert reader.batch_get_v1(keys(2), torch.arange(4 * PAGE, 6 * PAGE)) == [False, False]


@pytest.mark.parametrize("writer_lcm,layout", [(None, "page_head"), (2, "page_first")])
def test_no_sharing_without_tp_lcm_size_or_page_head(opts: dict[str, Any], made: list[Any],
                                                      writer_lcm: int | None, layout: str) -> None:
    """Without `tp_lcm_size` (or in a layout where a head group is not contiguous) a rank keeps its
    whole share under its own TP rank and size, as before: other TP sizes miss (and recompute)."""
    writer, _ = rank(opts, made, 0, 1, lcm=writer_lcm, layout=layout)
    assert writer.batch_set_v1(keys(2), torch.arange(0, 2 * PAGE)) == [True, True]
    assert writer.batch_exists(keys(2)) == 2
    reader, _ = rank(opts, made, 0, 2, layout=layout, seed=40)
    assert reader.batch_exists(keys(2)) == 0

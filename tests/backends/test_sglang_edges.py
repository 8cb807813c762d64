"""Adversarial checks of the SGLang HiCache adapter at its engine-facing edges: empty calls, a block of
another size under the same key, a full pool. Each must be a miss / failure status, never an exception
into the scheduler, never wrong bytes in the host pool."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvpool.core.client import PoolClient

from sglang_pools import PAGE, create, dynamic_extra, host_pool, page_bytes

SMALL = {"dram_bytes": "32MiB", "dram_slab_size": "1MiB", "prefault": False}


@pytest.fixture
def make() -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def _make(host: Any, **options: Any) -> Any:
        extra = dynamic_extra(**{**SMALL, **options}) if options.get("mode") in (None, "embedded") \
            else dynamic_extra(**options)
        b = create(host, extra)
        made.append(b)
        return b

    yield _make
    for b in made:
        b.close()


def _pages(host: Any, n: int) -> tuple[list[str], torch.Tensor]:
    return [f"{i:064x}" for i in range(1, n + 1)], host.alloc(n * PAGE)


@pytest.mark.parametrize("v1", [0, 1])
def test_empty_calls_are_empty_answers(make: Callable[..., Any], v1: int) -> None:
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
        make: Callable[..., Any], spawn: Any, caplog: pytest.LogCaptureFixture) -> None:
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
    before = [page_bytes(host, int(dst[i * PAGE])) for i in range(3)]
    caplog.set_level(logging.DEBUG, logger="kvpool")
    got = b.batch_get_v1(keys, dst)
    assert got == [False, False, True]
    assert page_bytes(host, int(dst[2 * PAGE])) == page_bytes(host, int(src[2 * PAGE]))
    # the tensor form sees the foreign blocks too: misses, not exceptions
    assert b.batch_exists(keys) == 3  # present, but of another size: the get must say no
    assert before  # (the False pages may hold partial bytes, as documented; SGLang stops at the first)

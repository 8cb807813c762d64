"""FastDeploy's cache transfer manager takes `k > 0 and v > 0` from `batch_get` as a block loaded whole
(cache_transfer_manager.py `_run_read_storage`, copied under tests/backends/data). Its keys,
`prefix{v}_{hash}_{rank}_key`, name neither the TP size nor the KV dtype, so two deployments of one
model that differ in either (TP 1 and TP 2; a bf16 and a block_wise_fp8 cache) write the same key with
blocks of other sizes and layouts. A positive result for a block smaller than the target hands the
engine a block whose tail is whatever its staging buffer held before: wrong KV bytes."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.backends.fastdeploy import KVPoolStore
from kvpool.core.client import PoolClient

from bkhelp import SMALL_POOL, HostBuffer, fastdeploy_keys, payload

BF16_STRIDE = 4 * 2 * 16 * 64 * 2  # 4 layers x 2 kv heads x 16 tokens x 64 dims x 2 bytes (TP 1)
BLOCKS = 4


@pytest.fixture
def pool() -> Iterator[PoolClient]:
    c = PoolClient(**SMALL_POOL)
    yield c
    c.close()


def _write(store: KVPoolStore, keys: list[list[str]], stride: int, tag: str) -> None:
    buf = HostBuffer(2 * BLOCKS * stride)
    buf.array[:] = payload(tag, buf.nbytes)
    store.register_buffer(buf.ptr, buf.nbytes)
    names = keys[0] + keys[1]
    assert store.batch_set(names, [buf.ptr + i * stride for i in range(len(names))], [stride] * len(names)) == \
        [0] * len(names)


def _engine_loads(store: KVPoolStore, keys: list[list[str]], stride: int) -> tuple[int, HostBuffer]:
    """What FastDeploy does with batch_get's result: the number of leading blocks it takes as loaded."""
    buf = HostBuffer(2 * BLOCKS * stride)
    buf.array[:] = 0xAB  # what the staging buffer held from an earlier request
    store.register_buffer(buf.ptr, buf.nbytes)
    names = keys[0] + keys[1]
    result = store.batch_get(names, [buf.ptr + i * stride for i in range(len(names))], [stride] * len(names))
    k, v = result[:BLOCKS], result[BLOCKS:]
    ok = 0
    for kr, vr in zip(k, v):
        if not (kr > 0 and vr > 0):
            break
        ok += 1
    return ok, buf


@pytest.mark.parametrize("writer, reader_stride", [
    (dict(tp_rank=0, tp_size=2), BF16_STRIDE),      # a TP-2 deployment's rank 0 wrote half the heads
    (dict(tp_rank=0, tp_size=1), BF16_STRIDE),      # a block_wise_fp8 deployment wrote 1-byte KV (below)
], ids=["tp2-writer-tp1-reader", "fp8-writer-bf16-reader"])
def test_a_smaller_block_of_another_deployment_is_never_taken_as_loaded(pool: PoolClient, writer: dict,
                                                                        reader_stride: int) -> None:
    keys = fastdeploy_keys([f"h{i}" for i in range(BLOCKS)])
    other = KVPoolStore("ERNIE", client=pool, **writer)
    _write(other, keys, BF16_STRIDE // 2, "other deployment")
    me = KVPoolStore("ERNIE", tp_rank=0, tp_size=1, client=pool)
    loaded, buf = _engine_loads(me, keys, reader_stride)
    # a block the engine takes as loaded must be all of its bytes, none of them stale
    for i in range(loaded):
        assert not (buf.at(i * reader_stride, reader_stride) == 0xAB).all(axis=None)
        assert (buf.at(i * reader_stride + reader_stride // 2, reader_stride // 2) != 0xAB).any(), \
            f"block {i} taken as loaded with its second half stale"
    assert loaded == 0


def test_a_same_size_block_of_another_tp_size_is_never_loaded(pool: PoolClient) -> None:
    """A bf16 TP-2 rank 0 block (half the heads, 2 bytes each) is exactly as large as a block_wise_fp8 TP-1
    block (every head, 1 byte each): no size check can tell them apart, only the key can (the store is
    told tp_size; FastDeploy's key carries only the rank)."""
    keys = fastdeploy_keys([f"h{i}" for i in range(BLOCKS)])
    half = BF16_STRIDE // 2
    _write(KVPoolStore("ERNIE", tp_rank=0, tp_size=2, client=pool), keys, half, "tp2 bf16")
    loaded, _ = _engine_loads(KVPoolStore("ERNIE", tp_rank=0, tp_size=1, client=pool), keys, half)
    assert loaded == 0

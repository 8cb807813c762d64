"""HostIO (FastDeploy store, Mooncake drop-in, SGLang v1) answers a batch that the pool refuses as a
whole by asking again key by key. A block larger than its destination (another deployment's layout
under the same key, which stays there) is such a refusal: every batch that includes it then costs one
pool round trip per key, each bounded by the client's timeout, for as long as the block is there
(10,000 keys: 1.6 s instead of 0.05 s on a same-node worker). The key at fault is known (the error
names it): the rest of the batch costs one more call, not one per key. So for a put of a block too
large for the pool."""
from __future__ import annotations

import numpy as np

from kvpool.backends.fastdeploy import KVPoolStore, Status
from kvpool.core.client import PoolClient

from bkhelp import SMALL_POOL, HostBuffer

N, S = 256, 1024


def test_one_oversized_block_does_not_turn_a_batch_into_one_call_per_key() -> None:
    pool = PoolClient(**SMALL_POOL)
    try:
        store = KVPoolStore("m", client=pool)
        src, dst = HostBuffer(N * S), HostBuffer(N * S)
        src.array[:] = (np.arange(N * S) % 251).astype(np.uint8)
        store.register_buffer(src.ptr, src.nbytes)
        store.register_buffer(dst.ptr, dst.nbytes)
        keys = [f"k{i}" for i in range(N)]
        assert store.batch_set(keys, [src.ptr + i * S for i in range(N)], [S] * N) == [0] * N
        pool.put("m/tp1/k7", b"x" * (2 * S))  # another layout under the same key
        calls = []
        real = pool.batch_get_into
        pool.batch_get_into = lambda k, b: (calls.append(len(k)), real(k, b))[1]  # type: ignore[method-assign]
        got = store.batch_get(keys, [dst.ptr + i * S for i in range(N)], [S] * N)
        assert got[7] < 0 and all(n == S for i, n in enumerate(got) if i != 7)
        assert np.array_equal(np.delete(dst.array.reshape(N, S), 7, 0), np.delete(src.array.reshape(N, S), 7, 0))
        assert len(calls) <= 3, f"{len(calls)} pool calls for one batch of {N} keys"
    finally:
        pool.close()


def test_one_block_too_large_for_the_pool_fails_alone_and_the_rest_go_in_one_more_call() -> None:
    pool = PoolClient(**SMALL_POOL)
    try:
        store = KVPoolStore("m", client=pool)
        big = 2 << 20  # larger than the pool's largest block (its slab, 1 MiB)
        src = HostBuffer(N * S + big)
        src.array[:] = (np.arange(src.nbytes) % 251).astype(np.uint8)
        store.register_buffer(src.ptr, src.nbytes)
        keys = [f"p{i}" for i in range(N)]
        ptrs, sizes = [src.ptr + i * S for i in range(N)], [S] * N
        ptrs[9], sizes[9] = src.ptr + N * S, big  # larger than the pool's largest block
        calls = []
        real = pool.batch_put
        pool.batch_put = lambda k, b, **kw: (calls.append(len(k)), real(k, b, **kw))[1]  # type: ignore[method-assign]
        got = store.batch_set(keys, ptrs, sizes)
        assert got[9] == Status.INVALID_PARAMS and all(st == 0 for i, st in enumerate(got) if i != 9)
        assert calls == [N, N - 1]
        assert store.exists(keys) == {k: i != 9 for i, k in enumerate(keys)}
    finally:
        pool.close()

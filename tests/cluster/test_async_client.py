"""AsyncPoolClient: PoolClient's API as coroutines; many tasks share one client without blocking the loop."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvpool.core import AsyncPoolClient, InvalidKey


def _block(i: int) -> bytes:
    return np.random.default_rng(i).bytes(64 << 10)


def test_the_api_on_the_embedded_pool() -> None:
    async def main() -> None:
        async with AsyncPoolClient(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False) as c:
            await c.put("a", _block(0))
            await c.batch_put(["b", "c"], [_block(1), _block(2)])
            assert await c.get("a") == _block(0)
            bufs = [bytearray(64 << 10) for _ in range(3)]
            assert await c.batch_get_into(["b", "c", "zz"], bufs) == [64 << 10, 64 << 10, -1]
            assert bytes(bufs[1]) == _block(2)
            assert await c.batch_exists(["a", "zz"]) == [True, False]
            assert await c.prefix_match(["a", "b", "zz", "c"]) == 2
            assert await c.batch_remove(["a"]) == [True]
            assert (await c.stats()).total.puts == 3
            with pytest.raises(InvalidKey):
                await c.get("")

    asyncio.run(main())


def test_tasks_overlap_against_a_worker_and_the_loop_stays_free(spawn) -> None:
    w = spawn()

    async def main() -> None:
        async with AsyncPoolClient(mode="local", worker=w.unix_path) as c:
            keys = [f"k{i}" for i in range(32)]
            await asyncio.gather(*(c.put(k, _block(i)) for i, k in enumerate(keys)))
            ticks = 0

            async def ticker() -> None:  # runs while the gets are in flight: the loop is not blocked
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            t = asyncio.create_task(ticker())
            got = await asyncio.gather(*(c.get(k) for k in keys))
            t.cancel()
            assert got == [_block(i) for i in range(32)]
            assert ticks > 1

    asyncio.run(main())

"""`AsyncPoolClient`: the PoolClient API as coroutines, for asyncio engines and services.

Every call runs the blocking `PoolClient` call in a thread (`asyncio.to_thread`), so the event loop
never waits on the pool, and calls from many tasks overlap (PoolClient is thread-safe: each
connection is used by one call at a time, the cluster bookkeeping is locked). Semantics, errors and
timeouts are PoolClient's. `lease` (zero-copy views valid inside a `with`) stays synchronous: use
`client.sync.lease(...)`.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .client import PoolClient
from .keys import Key

T = TypeVar("T")


class AsyncPoolClient:
    """Wraps `client` (or a new `PoolClient(**options)`, built in the caller's thread: cluster mode
    connects to NATS, embedded mode pre-faults its arena; `await asyncio.to_thread(AsyncPoolClient)`
    keeps that off the loop too)."""

    def __init__(self, client: PoolClient | None = None, **options: Any) -> None:
        self.sync = client if client is not None else PoolClient(**options)

    async def _run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kw)

    async def put(self, key: Key, data: Any) -> None:
        await self._run(self.sync.put, key, data)

    async def batch_put(self, keys: Sequence[Key], buffers: Sequence[Any], *, pin_s: float = 0.0) -> None:
        await self._run(self.sync.batch_put, keys, buffers, pin_s=pin_s)

    async def get(self, key: Key) -> bytes | None:
        return await self._run(self.sync.get, key)

    async def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        return await self._run(self.sync.batch_get_into, keys, buffers)

    async def exists(self, keys: Sequence[Key]) -> list[bool]:
        return await self._run(self.sync.exists, keys)

    async def prefix_match(self, keys: Sequence[Key]) -> int:
        return await self._run(self.sync.prefix_match, keys)

    async def remove(self, keys: Sequence[Key]) -> list[bool]:
        return await self._run(self.sync.remove, keys)

    async def pin(self, keys: Sequence[Key], seconds: float) -> None:
        await self._run(self.sync.pin, keys, seconds)

    async def clear(self, prefix: Key | None = None) -> None:
        await self._run(self.sync.clear, prefix)

    async def stats(self) -> dict[str, Any]:
        return await self._run(self.sync.stats)

    async def close(self) -> None:
        await self._run(self.sync.close)

    async def __aenter__(self) -> AsyncPoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

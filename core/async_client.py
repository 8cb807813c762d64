"""`AsyncPoolClient`: the PoolClient API as coroutines, for asyncio engines and services.

Every call runs the blocking `PoolClient` call in a thread (`asyncio.to_thread`), so the event loop
never waits on the pool, and calls from many tasks overlap (PoolClient is thread-safe: each
connection is used by one call at a time, the cluster bookkeeping is locked). Semantics, errors and
timeouts are PoolClient's; a cancelled call that reads or writes the caller's buffers (a put, a get into
them) raises CancelledError once its thread's call has ended.
`lease` / `batch_lease` (zero-copy views valid inside a `with`) stay synchronous: use
`client.sync.batch_lease(...)`.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

from .client import PoolClient
from .keys import Key
from .pool_backend import MembersPredicate
from .records import PoolStats, WorkerInfo

__all__ = ["AsyncPoolClient"]

T = TypeVar("T")
P = ParamSpec("P")


class AsyncPoolClient:
    """Wraps `client` (or a new `PoolClient(**options)`, built in the caller's thread: cluster mode
    connects to NATS, embedded mode pre-faults its arena; `await asyncio.to_thread(AsyncPoolClient)`
    keeps that off the loop too)."""

    def __init__(self, client: PoolClient | None = None, **options: Any) -> None:
        self.sync = client if client is not None else PoolClient(**options)

    async def _run(self, fn: Callable[P, T], *args: P.args, **kw: P.kwargs) -> T:
        """`fn` in a thread (a cancelled call returns at once: it holds none of the caller's buffers)."""
        return await asyncio.to_thread(fn, *args, **kw)

    async def _run_on_buffers(self, fn: Callable[P, T], *args: P.args, **kw: P.kwargs) -> T:
        """`fn`, which reads or writes the caller's buffers, in a thread. Cancelled (`asyncio.wait_for`,
        `task.cancel()`), the call still ends its thread's call first (bounded by the client's
        `timeout_s`), so that nothing is written into (or sent from) the buffers once the caller has
        them back."""
        call = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kw))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            while not call.done():
                try:
                    await asyncio.wait([call])
                except asyncio.CancelledError:
                    continue
            if not call.cancelled():
                call.exception()  # (its outcome goes with the cancellation: retrieved, not logged)
            raise

    async def put(self, key: Key, data: Any, *, pin_s: float = 0.0) -> None:
        await self._run_on_buffers(self.sync.put, key, data, pin_s=pin_s)

    async def batch_put(self, keys: Sequence[Key], buffers: Sequence[Any], *, pin_s: float = 0.0) -> None:
        await self._run_on_buffers(self.sync.batch_put, keys, buffers, pin_s=pin_s)

    async def get(self, key: Key) -> bytes | None:
        return await self._run(self.sync.get, key)

    async def get_into(self, key: Key, buffer: Any) -> int:
        return await self._run_on_buffers(self.sync.get_into, key, buffer)

    async def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        return await self._run_on_buffers(self.sync.batch_get_into, keys, buffers)

    async def exists(self, key: Key) -> bool:
        return await self._run(self.sync.exists, key)

    async def batch_exists(self, keys: Sequence[Key]) -> list[bool]:
        return await self._run(self.sync.batch_exists, keys)

    async def prefix_match(self, keys: Sequence[Key]) -> int:
        return await self._run(self.sync.prefix_match, keys)

    async def remove(self, key: Key) -> bool:
        return await self._run(self.sync.remove, key)

    async def batch_remove(self, keys: Sequence[Key]) -> list[bool]:
        return await self._run(self.sync.batch_remove, keys)

    async def pin(self, key: Key, pin_s: float) -> None:
        await self._run(self.sync.pin, key, pin_s)

    async def batch_pin(self, keys: Sequence[Key], pin_s: float) -> None:
        await self._run(self.sync.batch_pin, keys, pin_s)

    async def clear(self, prefix: Key | None = None) -> None:
        await self._run(self.sync.clear, prefix)

    async def members(self) -> dict[str, WorkerInfo]:
        return await self._run(self.sync.members)

    async def wait_for_members(self, predicate: MembersPredicate, timeout_s: float) -> bool:
        return await self._run(self.sync.wait_for_members, predicate, timeout_s)

    async def stats(self) -> PoolStats:
        return await self._run(self.sync.stats)

    async def close(self) -> None:
        await self._run(self.sync.close)

    async def __aenter__(self) -> AsyncPoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""`EmbeddedBackend`: the pool as a TieredCache inside this process (no services), as a PoolBackend."""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from .cache import TieredCache
from .pool_backend import MembersPredicate
from .records import PoolStats, WorkerInfo

__all__ = ["EmbeddedBackend"]


class EmbeddedBackend:
    """Every call goes straight to `cache` (timed pins included); the backend owns it and closes it."""

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache

    @property
    def max_block(self) -> int:
        return self.cache.max_block

    def batch_put(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float = 0.0) -> None:
        self.cache.batch_put(keys, buffers, pin_s=pin_s)

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        return self.cache.batch_get_into(keys, buffers)

    def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.cache.batch_exists(keys)

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        return self.cache.prefix_match(keys)

    def batch_remove(self, keys: Sequence[bytes]) -> list[bool]:
        return self.cache.batch_remove(keys)

    def batch_pin(self, keys: Sequence[bytes], pin_s: float) -> None:
        self.cache.batch_pin(keys, pin_s)

    def batch_lease(self, keys: Sequence[bytes]) -> AbstractContextManager[list[memoryview | None]]:
        """Zero copy: views of the cache's own arena."""
        return self.cache.batch_lease(keys)

    def clear(self, prefix: bytes | None = None) -> None:
        self.cache.clear(prefix)

    def stats(self) -> PoolStats:
        return PoolStats(self.cache.stats())

    def members(self) -> dict[str, WorkerInfo]:
        return {}

    def wait_for_members(self, predicate: MembersPredicate, timeout_s: float) -> bool:
        return predicate({})  # no workers, now or later

    def close(self) -> None:
        self.cache.close()
